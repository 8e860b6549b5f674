"""Packed sequences side by side on one GPU (issue 27): jax_fa3 packed/varlen, a dense batch, FA3
varlen and cuDNN, all called from JAX in this one process.

Layouts (--layouts): documents packed into one row of --tokens tokens (16384):
  NxL     N documents of L tokens each ("8x2k" = 8 x 2048, "32x512"); N * L must be --tokens
  mixed   lengths drawn from a lognormal (median --mixed-median, sigma --mixed-sigma, seeded
          by --seed), clipped to [--mixed-min, --mixed-max], drawn until the row is full, the
          last document cut to fit
Heads = --hidden (2048) // head dim, head dims --head-dims (64 128), causal 0/1, forward and
backward, bf16 (--dtype).

Implementations (--impls; each one that cannot run a point gets a record with the reason):
  packed         jax_fa3.flash_attention on (1, tokens, h, d) with q_segment_ids 1..n, one id
                 per document (the keys share them); causal follows the row index, which is the
                 documents' own causal band for self-attention of contiguous documents
  varlen         jax_fa3.flash_attention_varlen on (tokens, h, d) with cu_seqlens
  dense          the same documents as a batch on our kernel: (n, longest, h, d) with padding
                 segment id 0 after each shorter document; when all lengths are equal, plain
                 flash_attention on (n, L, h, d) without segment ids (the "batch of 8 2k" call)
  fa3_varlen     flash_attn3_jax.flash_mha_varlen (FA3's own kernels; head dim 128 only)
  cudnn_mask     jax.nn.dot_product_attention(implementation="cudnn") on the packed row with a
                 dense (1, 1, tokens, tokens) bool block-diagonal mask (causal: is_causal=True,
                 so cuDNN skips the tiles above the diagonal; if cuDNN rejects that, the causal
                 band goes into the mask instead); jax.nn turns the mask into an additive bias
  cudnn_seqlens  jax.nn.dot_product_attention(implementation="cudnn") on the dense padded batch
                 with query_seq_lengths = key_value_seq_lengths = the document lengths
--implementation xla sends the three jax_fa3 calls to the portable path (a CPU smoke run).

FLOPs of the useful work only: 4 * heads * head_dim * sum over documents of l*l (causal
l*(l+1)/2); backward 2.5x. Padding and masked-out work is not counted, so it shows as lower
TFLOP/s.

Timing is bench_attention's (imported, not copied): make_loop's jitted loop of dependent calls
with a compile-time trip count, calibrate to about --target-ms per loop, then at each point the
implementations take turns for --repeats rounds, each round starting one later; the median ms
per call is reported, every round in the JSON (ms_rounds) and the spread under the tables.
Forward: the per-call arrays (segment ids, cu_seqlens, lengths, the mask) are arguments of the
jitted loop, not constants folded into it, so their per-call processing (band building for
jax_fa3, mask -> bias for jax.nn) is timed as a training step would pay it. Backward: one
jax.vjp outside the loop, the loop calls the pullback.

Cross-check: every implementation's result (out; dq for the backward), mapped back to the packed
token order (padding dropped), against packed's (or the first finite result when packed does not
run); further than --max-rel-err, or not finite, is flagged suspect (its time is no valid figure).
All implementations see the same q, k, v and output cotangent, token for token.

Writes <out>/<date>-<gpu>-packed[-tag].json and .md: a table per (head dim, direction, causal)
with a row per layout, TFLOP/s (ms) per implementation, and the ratios issue 27 is done on:
packed time / dense time (<= 1.1), packed's speed over fa3_varlen's (>= 1.05x, hd128) and over
cudnn_mask's (>= 3x); its "Done when" section evaluates them on the 8x2k layout.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import (calibrate, cuda_version, gpu_name, make_loop,  # noqa: E402
                             check_result, spread_note, time_rounds, unmasked_pairs)

IMPLS = ("packed", "varlen", "dense", "fa3_varlen", "cudnn_mask", "cudnn_seqlens")
DONE_WHEN = dict(dense_max=1.1, fa3_min=1.05, cudnn_mask_min=3.0)  # issue 27, 8 x 2k


class Unsupported(Exception):
    """An implementation that cannot run a point here (the reason is its message)."""


# ----------------------------------------------------------------------------- layouts

def mixed_lengths(tokens: int, median: float, sigma: float, lo: int, hi: int,
                  seed: int) -> list[int]:
    """Long-tailed document lengths filling `tokens`: lognormal draws clipped to [lo, hi], the
    last one cut to fit."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < tokens:
        length = int(np.clip(round(rng.lognormal(np.log(median), sigma)), lo, hi))
        length = min(length, tokens - total)
        lengths.append(length)
        total += length
    return lengths


def layout_lengths(spec: str, args) -> list[int]:
    if spec == "mixed":
        return mixed_lengths(args.tokens, args.mixed_median, args.mixed_sigma, args.mixed_min,
                             args.mixed_max, args.seed)
    m = re.fullmatch(r"(\d+)x(\d+)(k?)", spec)
    if not m:
        raise SystemExit(f"bench_packed: layout {spec!r} is neither NxL (e.g. 8x2k) nor mixed")
    n, length = int(m[1]), int(m[2]) * (1024 if m[3] else 1)
    if n * length != args.tokens:
        raise SystemExit(f"bench_packed: layout {spec} has {n * length} tokens, the row "
                         f"--tokens {args.tokens}")
    return [length] * n


class Layout:
    """Documents of `lengths` tokens packed back to back into one row, and the same documents
    as a dense batch padded to the longest."""

    def __init__(self, name: str, lengths: list[int]):
        self.name, self.lengths = name, [int(x) for x in lengths]
        self.n, self.longest, self.tokens = len(lengths), max(lengths), sum(lengths)
        self.equal = len(set(self.lengths)) == 1
        self.cu = np.concatenate([[0], np.cumsum(self.lengths)]).astype(np.int32)
        self.segment_ids = np.repeat(np.arange(1, self.n + 1, dtype=np.int32), self.lengths)
        # Where each packed token sits in the padded batch flattened to (n * longest).
        self.pad_index = np.concatenate([d * self.longest + np.arange(length) for d, length in
                                         enumerate(self.lengths)]).astype(np.int32)
        self.valid = (np.arange(self.longest)[None, :]
                      < np.asarray(self.lengths)[:, None]).astype(np.int32)  # (n, longest)

    def pad(self, x):
        """(tokens, ...) in packed order -> (n, longest, ...), zeros after each document."""
        if self.equal:
            return x.reshape(self.n, self.longest, *x.shape[1:])
        flat = jnp.zeros((self.n * self.longest, *x.shape[1:]), x.dtype).at[self.pad_index].set(x)
        return flat.reshape(self.n, self.longest, *x.shape[1:])

    def unpad(self, y):
        """(n, longest, ...) -> (tokens, ...) in packed order, padding dropped."""
        flat = y.reshape(self.n * self.longest, *y.shape[2:])
        return flat if self.equal else flat[self.pad_index]

    def summary(self) -> dict:
        return dict(name=self.name, documents=self.n, longest=self.longest,
                    shortest=min(self.lengths), tokens=self.tokens,
                    padded_tokens=self.n * self.longest, lengths=self.lengths)


def useful_pairs(layout: Layout, causal: bool) -> int:
    return sum(unmasked_pairs(length, causal) for length in layout.lengths)


# ----------------------------------------------------------------------------- implementations

def build(impl: str, layout: Layout, causal: bool, head_dim: int, args):
    """(fn, extras, to_layout, from_layout): fn(q, k, v, extras) in the implementation's layout;
    extras the per-call arrays it takes; to_layout maps (tokens, h, d) packed-order data into
    that layout, from_layout a result back to (tokens, h, d). Raises Unsupported."""
    packed_in = (lambda x: x[None]), (lambda y: y[0])
    flat = (lambda x: x), (lambda y: y)
    padded = layout.pad, layout.unpad
    impl_fa3 = args.implementation
    if impl == "packed":
        import jax_fa3

        def fn(q, k, v, seg):
            return jax_fa3.flash_attention(q, k, v, causal=causal, q_segment_ids=seg,
                                           implementation=impl_fa3)
        return fn, jnp.asarray(layout.segment_ids[None]), *packed_in
    if impl == "varlen":
        import jax_fa3

        def fn(q, k, v, cu):
            return jax_fa3.flash_attention_varlen(q, k, v, cu, cu, layout.longest, layout.longest,
                                                  causal=causal, implementation=impl_fa3)
        return fn, jnp.asarray(layout.cu), *flat
    if impl == "dense":
        import jax_fa3
        if layout.equal:  # the plain batch: no segment ids at all
            def fn(q, k, v, _):
                return jax_fa3.flash_attention(q, k, v, causal=causal, implementation=impl_fa3)
            return fn, (), *padded

        def fn(q, k, v, seg):
            return jax_fa3.flash_attention(q, k, v, causal=causal, q_segment_ids=seg,
                                           implementation=impl_fa3)
        return fn, jnp.asarray(layout.valid), *padded
    if impl == "fa3_varlen":
        if head_dim != 128:
            raise Unsupported("the flash-attn3-jax wheel is built for head dim 128 only")
        try:
            from flash_attn3_jax import flash_mha_varlen
        except Exception as err:  # noqa: BLE001 - the wheel is optional
            raise Unsupported(f"flash_attn3_jax not importable ({type(err).__name__}: {err})")

        def fn(q, k, v, cu):
            return flash_mha_varlen(q, k, v, cu, cu, max_seqlen_q=layout.longest,
                                    max_seqlen_k=layout.longest, is_causal=causal)
        return fn, jnp.asarray(layout.cu), *flat
    if impl == "cudnn_mask":
        def fn(q, k, v, mask):
            return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                                implementation="cudnn")
        seg = jnp.asarray(layout.segment_ids)
        mask = (seg[:, None] == seg[None, :])[None, None]  # (1, 1, tokens, tokens) bool
        return fn, mask, *packed_in
    if impl == "cudnn_seqlens":
        def fn(q, k, v, lengths):
            return jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                query_seq_lengths=lengths,
                                                key_value_seq_lengths=lengths,
                                                implementation="cudnn")
        return fn, jnp.asarray(layout.lengths, jnp.int32), *padded
    raise ValueError(f"unknown implementation {impl!r}")


def causal_in_mask(layout: Layout):
    """cudnn_mask's fallback when cuDNN takes no mask together with is_causal: the causal band
    folded into the block-diagonal mask (then passed with is_causal=False)."""
    seg = jnp.asarray(layout.segment_ids)
    idx = jnp.arange(layout.tokens)
    mask = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])

    def fn(q, k, v, mask):
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")
    return fn, mask[None, None]


def prepare(fn, extras, direction, q, k, v, dout):
    """(run, once) from bench_attention.make_loop for fn(q, k, v, extras). Forward: extras ride
    along with k as arguments of the jitted loop (a closed-over array would become a constant
    of the program: the mask alone is 268 MB). Backward: the jax.vjp outside the loop is eager,
    so extras end in the pullback's residuals, which the loop takes as arguments."""
    if direction == "fwd":
        return make_loop(lambda q, kx, v: fn(q, kx[0], v, kx[1]), "fwd", q, (k, extras), v)
    return make_loop(lambda q, k, v: fn(q, k, v, extras), "bwd", q, k, v, dout=dout)


def reason_of(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:300] if text else ''}"


# ----------------------------------------------------------------------------- timing

def time_point(args, point: dict, layout: Layout, data, dout) -> list[dict]:
    """One (layout, head dim, causal, direction): every implementation is built, run once,
    cross-checked and calibrated; then the timed loops take turns for --repeats rounds, each
    round starting one implementation later. One record per implementation: ms, TFLOP/s and the
    cross-check, or `unsupported` with the reason."""
    causal, direction, head_dim = point["causal"], point["direction"], point["head_dim"]
    flops = 4 * point["heads"] * head_dim * useful_pairs(layout, causal)
    flops *= 2.5 if direction == "bwd" else 1.0
    records, ready, reference = [], [], None
    # packed first: it is the yardstick the others are checked against.
    impls = sorted(args.impls, key=lambda i: i != "packed")
    for impl in impls:
        rec = dict(impl=impl, **point)
        records.append(rec)
        try:
            fn, extras, to_layout, from_layout = build(impl, layout, causal, head_dim, args)
            q, k, v = (to_layout(x) for x in data)
            try:
                run, once = prepare(fn, extras, direction, q, k, v, to_layout(dout))
                result = from_layout(once())
            except Exception as err:  # noqa: BLE001
                if impl != "cudnn_mask" or not causal:
                    raise
                # cuDNN may refuse a mask together with its causal flag: fold causal in.
                first = reason_of(err)
                fn, extras = causal_in_mask(layout)
                try:
                    run, once = prepare(fn, extras, direction, q, k, v, to_layout(dout))
                    result = from_layout(once())
                except Exception as err2:  # noqa: BLE001
                    raise Unsupported(f"with is_causal: {first}; causal in the mask: "
                                      f"{reason_of(err2)}") from err2
                rec["note"] = f"causal folded into the mask (with is_causal: {first})"
            n = calibrate(run, args.target_ms)
        except Exception as err:  # noqa: BLE001 - an implementation that cannot run this point
            rec["unsupported"] = str(err) if isinstance(err, Unsupported) else reason_of(err)
            print(f"  {impl:13s} {direction} hd{head_dim} {layout.name} causal={int(causal)}: "
                  f"unsupported ({rec['unsupported'][:160]})", flush=True)
            continue
        reference = check_result(rec, direction, result, reference, args.max_rel_err)
        del result
        ready.append((rec, run, n))
    for rec, ms in time_rounds(ready, args.repeats, flops):
        print(f"  {rec['impl']:13s} {direction} hd{head_dim} {layout.name:7s} "
              f"causal={int(causal)}: {ms:8.3f} ms {rec['tflops']:7.1f} TFLOP/s", flush=True)
    return records


def run_all(args, layouts: list[Layout]) -> list[dict]:
    dtype = jnp.dtype(args.dtype)
    records = []
    for head_dim in args.head_dims:
        heads = args.hidden // head_dim
        for li, layout in enumerate(layouts):
            keys = jax.random.split(jax.random.key(1000 * head_dim + li), 4)
            shape = (layout.tokens, heads, head_dim)
            data = tuple(jax.random.normal(key, shape, dtype) for key in keys[:3])  # q, k, v
            dout = jax.random.normal(keys[3], shape, dtype)  # the backward's output cotangent
            for causal in args.causal:
                for direction in args.directions:
                    point = dict(layout=layout.name, dtype=dtype.name, head_dim=head_dim,
                                 heads=heads, tokens=layout.tokens, documents=layout.n,
                                 causal=causal, direction=direction)
                    records += time_point(args, point, layout, data, dout)
            del data, dout
    return records


# ----------------------------------------------------------------------------- report

def _timed(r: dict | None) -> bool:
    return r is not None and "ms" in r and not r.get("suspect")


def ratios(at: dict) -> dict:
    """The issue's ratios at one point from its records by impl (None where one is missing or
    suspect): packed time / dense time, and packed's speed over fa3_varlen and cudnn_mask."""
    p = at.get("packed")
    out = {}
    for name, peer, inverse in (("packed_over_dense_time", "dense", True),
                                ("speedup_vs_fa3_varlen", "fa3_varlen", False),
                                ("speedup_vs_cudnn_mask", "cudnn_mask", False)):
        other = at.get(peer)
        if _timed(p) and _timed(other):
            out[name] = round(p["ms"] / other["ms"] if inverse else other["ms"] / p["ms"], 3)
        else:
            out[name] = None
    return out


def _groups(records):
    keys = sorted({(r["head_dim"], r["direction"], r["causal"]) for r in records},
                  key=lambda k: (k[0], k[1] != "fwd", k[2]))
    for key in keys:
        yield key, [r for r in records if (r["head_dim"], r["direction"], r["causal"]) == key]


def done_when(records: list[dict], layout_name: str = "8x2k") -> list[dict]:
    """The issue's figures on the 8 x 2k layout, per (head dim, direction, causal)."""
    checks = []
    for (hd, direction, causal), group in _groups(records):
        at = {r["impl"]: r for r in group if r["layout"] == layout_name}
        if not at:
            continue
        rat = ratios(at)
        for name, value, ok in (
                ("packed / dense time <= 1.1", rat["packed_over_dense_time"],
                 lambda x: x <= DONE_WHEN["dense_max"]),
                ("packed vs fa3_varlen >= 1.05x", rat["speedup_vs_fa3_varlen"],
                 lambda x: x >= DONE_WHEN["fa3_min"]),
                ("packed vs cudnn_mask >= 3x", rat["speedup_vs_cudnn_mask"],
                 lambda x: x >= DONE_WHEN["cudnn_mask_min"])):
            if name.startswith("packed vs fa3") and hd != 128:
                continue
            checks.append(dict(head_dim=hd, direction=direction, causal=causal, check=name,
                               value=value, passed=None if value is None else bool(ok(value))))
    return checks


def _fmt_ratio(x, suffix=""):
    return "-" if x is None else f"{x:.2f}{suffix}"


def markdown(records: list[dict], layouts: list[dict], header: str) -> str:
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    lines = [header, "",
             "Layouts: " + "; ".join(
                 f"{l['name']} = {l['documents']} documents, {l['shortest']}..{l['longest']} "
                 f"tokens (padded batch {l['padded_tokens']} tokens)" for l in layouts),
             "", "Cells: TFLOP/s of the useful work (ms per call). Ratios: packed time / dense "
             "time (want <= 1.1); packed's speed over fa3_varlen's (want >= 1.05x, hd128) and "
             "over cudnn_mask's (want >= 3x).", ""]
    reasons = {}
    for (hd, direction, causal), group in _groups(records):
        lines += [f"## hd{hd} {direction} {'causal' if causal else 'non-causal'}", ""]
        cols = ["layout", "docs"] + impls + ["packed/dense time", "vs fa3_varlen", "vs cudnn_mask"]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for lay in layouts:
            at = {r["impl"]: r for r in group if r["layout"] == lay["name"]}
            if not at:
                continue
            row = [lay["name"], str(lay["documents"])]
            for impl in impls:
                r = at.get(impl)
                if r is None:
                    row.append("-")
                elif "unsupported" in r:
                    reasons.setdefault((impl, r["unsupported"]), []).append(
                        f"hd{hd} {direction} c{int(causal)} {lay['name']}")
                    row.append("n/a")
                else:
                    row.append(f"{r['tflops']:.1f} ({r['ms']:.3f})"
                               + (" (wrong result)" if r.get("suspect") else ""))
            rat = ratios(at)
            row += [_fmt_ratio(rat["packed_over_dense_time"]),
                    _fmt_ratio(rat["speedup_vs_fa3_varlen"], "x"),
                    _fmt_ratio(rat["speedup_vs_cudnn_mask"], "x")]
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    checks = done_when(records)
    if checks:
        lines += ["## Done when (issue 27), 8x2k", ""]
        for c in checks:
            verdict = "n/a" if c["passed"] is None else ("pass" if c["passed"] else "FAIL")
            lines.append(f"- hd{c['head_dim']} {c['direction']} causal={int(c['causal'])}: "
                         f"{c['check']}: {_fmt_ratio(c['value'])} {verdict}")
        lines.append("")
    if reasons:
        lines += ["Not run (n/a):", ""]
        for (impl, why), where in reasons.items():
            lines.append(f"- {impl} ({len(where)} points, e.g. {where[0]}): {why}")
        lines.append("")
    notes = sorted({(r["impl"], r["note"]) for r in records if "note" in r})
    for impl, note in notes:
        lines.append(f"- {impl}: {note}")
    lines += ["", spread_note(records, point=lambda r: r["layout"])]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--layouts", nargs="+", default=["8x2k", "32x512", "mixed"])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    p.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=16384, help="tokens of the packed row")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    p.add_argument("--mixed-median", type=float, default=512.0)
    p.add_argument("--mixed-sigma", type=float, default=1.5)
    p.add_argument("--mixed-min", type=int, default=16)
    p.add_argument("--mixed-max", type=int, default=8192)
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed lengths")
    p.add_argument("--implementation", default="cuda", choices=["cuda", "xla"],
                   help="of the jax_fa3 calls (xla: the portable path, for a CPU smoke run)")
    p.add_argument("--target-ms", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tag", default="", help="suffix of the results files")
    p.add_argument("--max-rel-err", type=float, default=0.02,
                   help="results further than this from packed's are flagged suspect")
    args = p.parse_args(argv)
    args.causal = [bool(c) for c in args.causal]
    if jax.default_backend() != "gpu" and args.implementation == "cuda":
        print(f"bench_packed: needs a GPU (backend is {jax.default_backend()}); "
              f"--implementation xla runs the portable path anywhere", file=sys.stderr)
        return 2

    layouts = [Layout(spec, layout_lengths(spec, args)) for spec in args.layouts]
    date = dt.date.today().isoformat()
    meta = dict(date=date, gpu=gpu_name(), jax=jax.__version__, cuda=cuda_version(),
                implementation=args.implementation, tag=args.tag)
    try:
        import jax_fa3
        meta["jax_fa3_build"] = jax_fa3.build_info()
    except Exception as err:  # noqa: BLE001
        meta["jax_fa3_build"] = f"unavailable: {err}"
    print(f"bench_packed: {meta}", flush=True)
    for lay in layouts:
        print(f"  layout {lay.name}: {lay.n} documents, lengths {lay.lengths}", flush=True)
    records = run_all(args, layouts)
    summaries = [lay.summary() for lay in layouts]
    stem = args.out / "-".join(x for x in (date, meta["gpu"], "packed", args.tag) if x)
    args.out.mkdir(parents=True, exist_ok=True)
    point_ratios = []
    for (hd, direction, causal), group in _groups(records):
        for lay in layouts:
            at = {r["impl"]: r for r in group if r["layout"] == lay.name}
            if at:
                point_ratios.append(dict(head_dim=hd, direction=direction, causal=causal,
                                         layout=lay.name, **ratios(at)))
    report = dict(meta, config=dict(tokens=args.tokens, hidden=args.hidden, dtype=args.dtype,
                                    target_ms=args.target_ms, repeats=args.repeats,
                                    max_rel_err=args.max_rel_err),
                  layouts=summaries, records=records, ratios=point_ratios,
                  done_when=done_when(records))
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    header = (f"# Packed sequences, {date}, {meta['gpu']}, jax {meta['jax']}, {args.dtype}, "
              f"one row of {args.tokens} tokens, heads*head_dim={args.hidden}, jax_fa3 "
              f"implementation={args.implementation}{', ' + args.tag if args.tag else ''}")
    table = markdown(records, summaries, header)
    stem.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
