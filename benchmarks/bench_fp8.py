"""FP8 (e4m3) attention forward on Hopper, side by side (issue 28), with the FP8 matmul ceiling.

    python3 -P benchmarks/bench_fp8.py --out DIR --tag s22            # the whole grid
    python3 -P benchmarks/bench_fp8.py --head-dims 128 --seqlens 16384 --causal 0

Shapes as benchmarks/bench_attention.py (batch * seqlen = --tokens, heads * head_dim = --hidden).
Implementations, each timed in the same rounds per point:
  jax_fa3_fp8   jax_fa3.flash_attention on float8_e4m3fn q/k/v with per-(batch, head) descales
                (implementation="cuda"), bf16 out;
  jax_fa3_bf16  our bf16 forward on the same (dequantized) data;
  fa3_fp8       FA3's own FP8 kernel from the flash-attn3-jax wheel, called through its FFI target
                (the wheel's Python API takes bf16/fp16 only; its library holds hd128 e4m3);
  cudnn_fp8     cuDNN's FP8 flash attention (inference mode) through JAX's own binding of it,
                jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(use_fp8=True): the
                public jax.nn.dot_product_attention takes no FP8 inputs. cuDNN takes one descale
                per tensor, so its q/k/v are the bf16 data quantized per tensor, and its output is
                e4m3 (scaled by 1 / v's descale), decoded to float only for the error check.
The FP8 matmul ceiling: an 8192^3 float8_e4m3fn GEMM (bf16 out) through XLA, timed the same way.
Outputs: DIR/<date>-<gpu>-fp8[-tag].{json,md}. TFLOP/s count 4 * batch * heads * pairs * head_dim
(pairs: unmasked query-key pairs), like bench_attention.py.
"""

from __future__ import annotations

import argparse
import datetime as dt
import functools
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import (calibrate, chained, gpu_name, grid_shape, make_loop, relative_error,  # noqa: E402
                             time_rounds, unmasked_pairs)

import jax_fa3  # noqa: E402
from jax_fa3.fp8 import dequantize_fp8, quantize_fp8  # noqa: E402

IMPLS = ("jax_fa3_fp8", "jax_fa3_bf16", "fa3_fp8", "cudnn_fp8")
F8 = jnp.float8_e4m3fn
# Our implementations run with this `implementation` (tests/test_bench_fp8.py runs the script's
# bookkeeping on CPU with "xla", the portable paths).
IMPLEMENTATION = "cuda"


def fa3_fp8_fn(causal: bool, descales):
    """FA3's FP8 forward through the wheel's FFI target ('flash_mha_fwd', registered on import),
    with the operand list of the wheel's own bf16 lowering (flash_hlo.py) and FP8 q/k/v."""
    import flash_attn3_jax  # noqa: F401  (registers the FFI targets)

    qd, kd, vd = descales

    def fn(q, k, v):
        b, s, h, d = q.shape
        empty_i32 = jnp.zeros((0,), jnp.int32)
        empty_f32 = jnp.zeros((0,), jnp.float32)
        empty_q = jnp.zeros((0,), q.dtype)
        out_types = [jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16),
                     jax.ShapeDtypeStruct((b, h, s), jnp.float32),
                     jax.ShapeDtypeStruct((1, 1, 1, 1), jnp.float32),
                     jax.ShapeDtypeStruct((1, 1, 1), jnp.float32)]
        o, *_ = jax.ffi.ffi_call("flash_mha_fwd", out_types, has_side_effect=False)(
            q, k, v, empty_q, empty_q, empty_q, empty_i32, empty_i32, empty_i32, empty_i32,
            empty_i32, empty_i32, empty_i32, empty_i32, empty_q, empty_q, empty_i32,
            qd, kd, vd, empty_i32,
            max_seqlen_q=s, max_seqlen_q_has_value=True, max_seqlen_k=k.shape[1],
            max_seqlen_k_has_value=True, softmax_scale_val=1.0 / math.sqrt(d),
            softmax_scale_has_value=True, pack_gqa_val=False, pack_gqa_has_value=False,
            is_causal=causal, window_size_left=-1, window_size_right=-1, attention_chunk=0,
            softcap=0.0, is_rotary_interleaved=False, num_splits=1, sm_margin=0)
        return o
    return fn


# cuDNN rounds P * CUDNN_P_SCALE to e4m3 (scale_s; P <= 1): 256 as our kernel's max offset of 8.
CUDNN_P_SCALE = 256.0


def cudnn_fp8_fn(causal: bool, head_dim: int, descales):
    """cuDNN's FP8 forward through JAX's binding (no training residuals: inference mode).
    descales: the per-tensor (q, k, v) descales, shape (). Returns e4m3 out * (1 / v's descale)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_sdpa

    cudnn_sdpa.check_cudnn_version()  # raises "cuDNN is not detected." off the GPU
    one = lambda x: jnp.reshape(jnp.asarray(x, jnp.float32), (1, 1, 1, 1))  # noqa: E731
    qd, kd, vd = descales
    params = {name: one(1.0) for name in cudnn_sdpa.fp8_params_keys}
    params.update(descale_q=one(qd), descale_k=one(kd), descale_v=one(vd),
                  scale_s=one(CUDNN_P_SCALE), descale_s=one(1.0 / CUDNN_P_SCALE),
                  scale_o=one(1.0 / vd), descale_o=one(vd))
    mask = cudnn_sdpa.MaskType.CAUSAL if causal else cudnn_sdpa.MaskType.NO_MASK

    def fn(q, k, v):
        out, _, _ = cudnn_sdpa.dot_product_attention(
            q, k, v, fp8_params=params, scale=1.0 / math.sqrt(head_dim), mask_type=mask,
            qkv_layout="BTNH", use_fp8=True)
        return out
    return fn


def point_fns(impl: str, causal: bool, fp8_inputs, bf16_inputs):
    """(fn, (q, k, v), decode) for one implementation, or raises with the reason it cannot run;
    decode(out) is the output as float for the error check (outside the timed call)."""
    (q8, qd), (k8, kd), (v8, vd) = fp8_inputs
    same = lambda out: out  # noqa: E731
    if impl == "jax_fa3_fp8":
        fn = lambda q, k, v: jax_fa3.flash_attention(  # noqa: E731
            q, k, v, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
            implementation=IMPLEMENTATION)
        return fn, (q8, k8, v8), same
    if impl == "jax_fa3_bf16":
        fn = lambda q, k, v: jax_fa3.flash_attention(  # noqa: E731
            q, k, v, causal=causal, implementation=IMPLEMENTATION)
        return fn, bf16_inputs, same
    if impl == "fa3_fp8":
        if q8.shape[-1] != 128:
            raise RuntimeError("the flash-attn3-jax wheel holds FP8 kernels for head dim 128 only")
        return fa3_fp8_fn(causal, (qd, kd, vd)), (q8, k8, v8), same
    if impl == "cudnn_fp8":
        per_tensor = [quantize_fp8(x, granularity="tensor") for x in bf16_inputs]
        descales = tuple(float(d) for _, d in per_tensor)
        fn = cudnn_fp8_fn(causal, q8.shape[-1], descales)
        decode = lambda out: out.astype(jnp.float32) * descales[2]  # noqa: E731
        return fn, tuple(x for x, _ in per_tensor), decode
    raise ValueError(impl)


def gemm_ceiling(args) -> dict:
    """An 8192^3 e4m3 GEMM through XLA (cuBLASLt's FP8 path on Hopper), bf16 out."""
    n = 8192
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32).astype(F8)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32).astype(F8)
    rec = {"impl": "fp8_gemm", "m": n, "n": n, "k": n}
    try:
        @functools.partial(jax.jit, static_argnums=0)
        def loop(calls, a, b):
            def body(_, c):  # a depends on the previous product: no call is hoisted or merged
                x = jax.lax.dot_general(chained(a, c), b, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.bfloat16)
                return x[0, 0].astype(jnp.float32)
            return jax.lax.fori_loop(0, calls, body, jnp.float32(0))
        run = lambda calls: loop(calls, a, b)  # noqa: E731
        [(rec, _)] = list(time_rounds([(rec, run, calibrate(run, args.target_ms))], args.repeats, 2.0 * n ** 3))
    except Exception as e:  # noqa: BLE001  (reported, not hidden)
        rec["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return rec


def run_grid(args) -> list[dict]:
    records = []
    for hd in args.head_dims:
        for seqlen in args.seqlens:
            shape = grid_shape(hd, seqlen, args.tokens, args.hidden)
            b, s, h, d = shape
            keys = jax.random.split(jax.random.key(seqlen * 1000 + hd), 3)
            xs = [jax.random.normal(kk, shape, jnp.float32) for kk in keys]
            fp8_inputs = [quantize_fp8(x, granularity="head") for x in xs]
            bf16_inputs = tuple(dequantize_fp8(x8, dsc).astype(jnp.bfloat16) for x8, dsc in fp8_inputs)
            for causal in args.causal:
                flops = 4.0 * b * h * unmasked_pairs(seqlen, bool(causal)) * d
                ready, reference = [], None
                for impl in args.impls:
                    rec = {"impl": impl, "head_dim": hd, "seqlen": seqlen, "causal": bool(causal),
                           "batch": b, "heads": h}
                    records.append(rec)
                    try:
                        fn, inputs, decode = point_fns(impl, bool(causal), fp8_inputs, bf16_inputs)
                        run, once = make_loop(fn, "fwd", *inputs)
                        out = decode(jax.block_until_ready(once()))
                        if impl == "jax_fa3_bf16":
                            reference = out
                        rec["_out"] = out
                        ready.append((rec, run, calibrate(run, args.target_ms)))
                    except Exception as e:  # noqa: BLE001  (reported as n/a with the reason)
                        rec["skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                for rec, _ in time_rounds(ready, args.repeats, flops):
                    pass
                for rec in records:
                    out = rec.pop("_out", None)
                    if out is not None and reference is not None and rec["impl"] != "jax_fa3_bf16":
                        # FP8 against bf16 on the same dequantized inputs: P in e4m3 costs ~2^-4.
                        rec["rel_err_vs_bf16"] = round(relative_error(out, reference), 5)
                print(" | ".join(f"{r['impl']} {r.get('tflops', 'n/a')}" for r in records[-len(args.impls):]),
                      f"<- hd{hd} s{seqlen} causal={causal}", flush=True)
    return records


def markdown(records, gemm, header) -> str:
    shown = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    ceiling = f"{gemm['tflops']} TFLOP/s" if "tflops" in gemm else f"n/a ({gemm.get('skipped')})"
    lines = [f"# {header}", "",
             f"FP8 matmul ceiling (8192^3 e4m3 GEMM through XLA, bf16 out): {ceiling}", "",
             "| hd | causal | seqlen | " + " | ".join(shown) + " | fp8 / bf16 | fp8 / fa3_fp8 | fp8 / cudnn_fp8 |",
             "|---|---|---|" + "---|" * (len(shown) + 3)]
    points = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in records})
    for hd, causal, seqlen in points:
        row = {r["impl"]: r for r in records if (r["head_dim"], r["causal"], r["seqlen"]) == (hd, causal, seqlen)}
        cells = [str(row[i].get("tflops", "n/a")) if i in row else "-" for i in shown]
        ratio = lambda a, b: (f"{row[b]['ms'] / row[a]['ms']:.2f}x"  # noqa: E731  (speed: time ratio)
                              if a in row and b in row and "ms" in row[a] and "ms" in row[b] else "-")
        lines.append(f"| {hd} | {'yes' if causal else 'no'} | {seqlen} | " + " | ".join(cells)
                     + f" | {ratio('jax_fa3_fp8', 'jax_fa3_bf16')} | {ratio('jax_fa3_fp8', 'fa3_fp8')}"
                     + f" | {ratio('jax_fa3_fp8', 'cudnn_fp8')} |")
    reasons = sorted({(r["impl"], r["skipped"]) for r in records if "skipped" in r})
    if reasons:
        lines += ["", "Not run (n/a):", ""] + [f"- {i}: {why}" for i, why in reasons]
    for impl in ("jax_fa3_fp8", "fa3_fp8", "cudnn_fp8"):
        errs = [r["rel_err_vs_bf16"] for r in records if "rel_err_vs_bf16" in r and r["impl"] == impl]
        if errs:
            lines += ["", f"{impl} relative error against our bf16 forward on the same dequantized "
                          f"inputs: max {max(errs):.4f} (P rounded to e4m3 costs about 2^-4 per weight"
                          + ("; cuDNN's inputs are quantized per tensor and its output is e4m3)."
                             if impl == "cudnn_fp8" else ").")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="heads * head_dim")
    p.add_argument("--target-ms", type=float, default=40.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-gemm", action="store_true", help="skip the FP8 GEMM ceiling")
    p.add_argument("--tag", default="")
    args = p.parse_args(argv)
    gemm = {"skipped": "--no-gemm"} if args.no_gemm else gemm_ceiling(args)
    records = run_grid(args)
    name = f"{dt.date.today()}-{gpu_name()}-fp8" + (f"-{args.tag}" if args.tag else "")
    header = (f"FP8 attention forward, {dt.date.today()}, {gpu_name()}, jax {jax.__version__}, "
              f"batch*seqlen={args.tokens}, heads*head_dim={args.hidden}{', ' + args.tag if args.tag else ''} (TFLOP/s)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"gemm": gemm, "records": records}, indent=1))
    md = markdown(records, gemm, header)
    (args.out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
