"""Train a small decoder-only LM whose attention is jax_fa3.

    python examples/train_llm.py                       # cpu-tiny on CPU, h200-125m on a GPU
    python examples/train_llm.py --attention cudnn     # same model through cuDNN, to compare
    python examples/train_llm.py --data my.txt --steps 2000 --out-dir /tmp/run1
    python examples/train_llm.py --out-dir /tmp/run1 --resume --steps 4000
    python examples/train_llm.py --out-dir /tmp/run1 --overwrite   # discard that run, start anew
    python examples/train_llm.py --no-pack            # windows of the stream, no segment ids

What it does: byte-level data (the Python standard library's sources unless --data is
given) whose documents (the library's files; --doc-sep cuts a user file) are packed into
fixed-length rows with segment ids, so that attention stays inside each document (RoPE
positions restart at each one, the loss skips targets across a boundary or in padding, and
the fraction of padding tokens is reported); --no-pack cuts the stream into windows instead.
A Flax NNX transformer (llm_model.py) with float32
parameters and float32 or bfloat16 compute; AdamW with warmup and cosine decay and gradient
clipping, in one jitted step; parameters sharded over the 'fsdp' axis and the batch over
('data', 'fsdp') of a device mesh, optionally the sequence over 'context' (context
parallelism: attention then reads keys and values across those devices, partitioned by
jax_fa3's sharding rules where they apply and by XLA otherwise), so the same script runs on
one device, several, or several hosts (--distributed); orbax checkpoints; periodic eval; a sample at the end; a loss
curve PNG and a summary.json in --out-dir. The first lines on stdout say where the files go;
the last line is the summary as JSON. A run never replaces an earlier one in the same
directories unless told: --resume continues it, --overwrite deletes it first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # llm_model, llm_data
try:
    import jax_fa3  # installed with `pip install ".[examples]"`
except ImportError:  # a source checkout that is not installed: use it in place (portable path)
    sys.path.insert(1, os.path.dirname(HERE))
    import jax_fa3

import llm_data  # noqa: E402
import llm_model  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.8M parameters; about a minute on two CPU cores; the loss falls from ln(256) ~ 5.5 to ~2.
    "cpu-tiny": dict(
        d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_hidden=384, dtype="float32",
        seq_len=128, batch_size=16, steps=300, lr=3e-3, warmup_steps=30,
        eval_every=100, eval_batches=4, log_every=10, ckpt_every=100, sample_tokens=200,
    ),
    # ~125M parameters, head_dim 128, sequences of 4096: the H200 measurement run.
    "h200-125m": dict(
        d_model=1024, n_layers=12, n_heads=8, n_kv_heads=2, mlp_hidden=2560, dtype="bfloat16",
        seq_len=4096, batch_size=16, steps=1000, lr=6e-4, warmup_steps=100,
        eval_every=250, eval_batches=8, log_every=10, ckpt_every=500, sample_tokens=256,
    ),
}

# Dense bf16 peak FLOP/s per chip, matched against jax's device_kind (longest key first).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "GH200": 989e12,
                   "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10G": 70e12}


@dataclasses.dataclass
class Config:
    """Everything one run depends on: a preset, then the flags that override it."""

    preset: str
    # every preset sets these (PRESETS); flags override them
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden: int
    dtype: str
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup_steps: int
    eval_every: int
    eval_batches: int
    log_every: int
    ckpt_every: int
    sample_tokens: int
    # the rest: same defaults for every preset
    attention: str = "fa3"
    remat: bool = False
    pack: bool = True
    doc_sep: int | None = None
    data: str | None = None
    bin_dtype: str = "uint16"
    vocab_size: int | None = None
    eval_fraction: float = 0.01
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    out_dir: str = "out/train_llm"
    ckpt_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    fsdp: int = -1
    context: int = 1
    prompt: str | None = None
    temperature: float = 0.8
    progress: bool = True


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="default: cpu-tiny on CPU, h200-125m on GPU")
    p.add_argument("--attention", choices=("fa3", "cudnn", "xla"), default="fa3",
                   help="fa3: jax_fa3.flash_attention; cudnn/xla: jax.nn.dot_product_attention")
    p.add_argument("--distributed", action="store_true",
                   help="call jax.distributed.initialize() first (multi-host)")
    g = p.add_argument_group("model (override the preset)")
    for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden"):
        g.add_argument("--" + name.replace("_", "-"), type=int)
    g.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (params stay float32)")
    g.add_argument("--remat", action="store_true", default=None, help="recompute blocks in backward")
    g = p.add_argument_group("data")
    g.add_argument("--data", help="text file (bytes), .npy (1-D token ids) or .bin (raw token ids)")
    g.add_argument("--no-pack", dest="pack", action="store_false", default=None,
                   help="cut the token stream into windows (documents back to back, no segment "
                   "ids) instead of packing documents into rows with segment ids")
    g.add_argument("--doc-sep", type=int, help="token id that ends a document in --data (default: "
                   "the file is one document; the standard library's files are documents)")
    g.add_argument("--bin-dtype", help="dtype of .bin token files (default uint16)")
    g.add_argument("--vocab-size", type=int, help="for token files (default: max id + 1)")
    g.add_argument("--eval-fraction", type=float)
    g.add_argument("--seq-len", type=int)
    g.add_argument("--batch-size", type=int, help="global batch size (sequences per step)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, help="total steps (a resumed run continues to this step)")
    g.add_argument("--lr", type=float, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--min-lr-ratio", type=float, help="final lr as a fraction of the peak")
    g.add_argument("--weight-decay", type=float)
    g.add_argument("--grad-clip", type=float, help="global-norm clip (0 = off)")
    g.add_argument("--seed", type=int)
    g = p.add_argument_group("bookkeeping")
    g.add_argument("--eval-every", type=int)
    g.add_argument("--eval-batches", type=int)
    g.add_argument("--log-every", type=int)
    g.add_argument("--ckpt-every", type=int, help="0 = only at the end")
    g.add_argument("--out-dir", help="loss curve, metrics and summary (default out/train_llm)")
    g.add_argument("--ckpt-dir", help="orbax checkpoints (default <out-dir>/checkpoints)")
    g.add_argument("--resume", action="store_true", default=None, help="continue from the latest checkpoint")
    g.add_argument("--overwrite", action="store_true", default=None,
                   help="delete an earlier run's checkpoints and files in these directories, then "
                   "start from step 0 (without it, and without --resume, a run refuses to start "
                   "where an earlier run left files)")
    g.add_argument("--fsdp", type=int, help="devices on the 'fsdp' mesh axis (default: all "
                   "that --context leaves)")
    g.add_argument("--context", type=int, help="devices on the 'context' axis, over which the "
                   "sequence is sharded (default 1)")
    g.add_argument("--prompt", help="prompt of the final sample (default: 'def ' for text)")
    g.add_argument("--sample-tokens", type=int)
    g.add_argument("--temperature", type=float, help="0 = greedy")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None)
    return p, p.parse_args(argv)


def build_config(parser: argparse.ArgumentParser, args: argparse.Namespace, backend: str) -> Config:
    preset = args.preset or ("h200-125m" if backend == "gpu" else "cpu-tiny")
    overrides = {k: v for k, v in vars(args).items()
                 if v is not None and k not in ("preset", "distributed")}
    cfg = Config(preset=preset, **{**PRESETS[preset], **overrides})
    positive = ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden", "seq_len",
                "batch_size", "steps", "eval_every", "eval_batches", "log_every")
    for name in positive:
        if getattr(cfg, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    for name in ("warmup_steps", "ckpt_every", "sample_tokens", "weight_decay", "grad_clip", "temperature"):
        if getattr(cfg, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
    if not (0.0 < cfg.lr < 1.0):
        parser.error(f"--lr must be in (0, 1), got {cfg.lr}")
    if not (0.0 < cfg.eval_fraction < 0.5):
        parser.error(f"--eval-fraction must be in (0, 0.5), got {cfg.eval_fraction}")
    if cfg.attention == "cudnn" and backend != "gpu":
        parser.error(f"--attention cudnn needs an NVIDIA GPU; this run is on {backend}")
    if cfg.attention == "cudnn" and cfg.dtype != "bfloat16":
        parser.error("--attention cudnn needs --dtype bfloat16")
    return cfg


# ------------------------------------------------------------------------------- sharding


def make_mesh(cfg: Config, parser: argparse.ArgumentParser) -> Mesh:
    n = jax.device_count()
    context = cfg.context
    if context <= 0 or n % context:
        parser.error(f"--context {context} must be positive and divide the {n} devices")
    if cfg.seq_len % context:
        parser.error(f"--seq-len {cfg.seq_len} must be a multiple of --context {context}")
    per_context = n // context
    fsdp = per_context if cfg.fsdp <= 0 else cfg.fsdp
    if per_context % fsdp:
        parser.error(f"--fsdp {fsdp} does not divide the {per_context} devices left by --context {context}")
    if cfg.batch_size % per_context:
        parser.error(f"--batch-size {cfg.batch_size} must be a multiple of data x fsdp = {per_context}")
    devices = np.asarray(jax.devices()).reshape(per_context // fsdp, fsdp, context)
    return Mesh(devices, ("data", "fsdp", "context"))


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """Shard the largest axis that the 'fsdp' size divides; replicate small or odd arrays."""
    candidates = [i for i, d in enumerate(shape) if d % fsdp == 0 and d >= fsdp]
    if fsdp == 1 or not candidates:
        return P()
    axis = max(candidates, key=lambda i: shape[i])
    return P(*[("fsdp" if i == axis else None) for i in range(len(shape))])


# ------------------------------------------------------------------------------- helpers


def peak_flops(device: jax.Device) -> float | None:
    """bf16 dense peak of one device, or None when unknown (CPU, other chips)."""
    if device.platform != "gpu":
        return None
    kind = device.device_kind
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):
        if key in kind:
            return PEAK_BF16_FLOPS[key]
    return None


def attention_description(cfg: Config) -> str:
    """What --attention runs here, including whether jax_fa3 takes its Hopper kernel."""
    if cfg.attention != "fa3":
        return f"jax.nn.dot_product_attention(implementation={cfg.attention!r})"
    head_dim = cfg.d_model // cfg.n_heads
    reasons = {d: jax_fa3.unavailable_reason(d, jnp.dtype(cfg.dtype), head_dim) for d in ("fwd", "bwd")}
    if reasons["fwd"] is None:
        bwd = "kernel" if reasons["bwd"] is None else f"portable ({reasons['bwd']})"
        return f"jax_fa3.flash_attention: Hopper kernel forward, {bwd} backward"
    return f"jax_fa3.flash_attention: portable path ({reasons['fwd']})"


RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png")  # what a run writes in --out-dir


def earlier_run(out_dir: str, ckpt_dir: str) -> tuple[list[int], list[str]]:
    """What an earlier run left here: its checkpoint steps and its files in the out dir."""
    steps = sorted(ocp.utils.checkpoint_steps(ckpt_dir)) if os.path.isdir(ckpt_dir) else []
    files = [name for name in RUN_FILES if os.path.exists(os.path.join(out_dir, name))]
    return steps, files


def check_earlier_run(parser: argparse.ArgumentParser, cfg: Config, out_dir: str, ckpt_dir: str,
                      steps: list[int], files: list[str]) -> None:
    """Refuses (before anything is built) a run that would silently replace an earlier one."""
    if cfg.resume and cfg.overwrite:
        parser.error("--resume continues the earlier run and --overwrite deletes it: pass one")
    if cfg.resume and not steps:
        parser.error(f"--resume: no checkpoint in {ckpt_dir}" +
                     (" (to start over there: --overwrite)" if files else ""))
    if cfg.resume or cfg.overwrite or not (steps or files):
        return
    found = []
    if steps:
        found.append(f"checkpoints at steps {steps} in {ckpt_dir}")
    if files:
        found.append(f"{', '.join(files)} in {out_dir}")
    parser.error(f"an earlier run is here ({'; '.join(found)}), and nothing was changed. "
                 "Pass --resume to continue it, --overwrite to delete it and start over, "
                 "or choose another --out-dir (and --ckpt-dir, if you set it) for a new run.")


def plot_losses(path: str, train: list[tuple[int, float]], evals: list[tuple[int, float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def read_metrics(path: str, upto: int) -> tuple[list, list]:
    """Train/eval history of an earlier run (for the curve of a resumed run)."""
    train, evals = [], []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                if rec["step"] <= upto:
                    (train if rec["kind"] == "train" else evals).append((rec["step"], rec["loss"]))
    return train, evals


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser, args = parse_args(argv)
    if args.distributed:
        jax.distributed.initialize()  # before anything touches the backend
    backend = jax.default_backend()
    cfg = build_config(parser, args, backend)
    lead = jax.process_index() == 0

    def log(msg: str) -> None:
        if lead:
            tqdm.write(msg, file=sys.stdout)

    # ---- where the files go; an earlier run there is kept unless --resume or --overwrite
    out_dir = os.path.abspath(cfg.out_dir)
    ckpt_dir = os.path.abspath(cfg.ckpt_dir or os.path.join(out_dir, "checkpoints"))
    log(f"out dir: {out_dir} ({', '.join(RUN_FILES)})")
    log(f"checkpoints: {ckpt_dir}")
    earlier_steps, earlier_files = earlier_run(out_dir, ckpt_dir)
    check_earlier_run(parser, cfg, out_dir, ckpt_dir, earlier_steps, earlier_files)

    # ---- data
    try:
        data = llm_data.load_tokens(cfg.data, seq_len=cfg.seq_len, eval_fraction=cfg.eval_fraction,
                                    vocab_size=cfg.vocab_size, bin_dtype=cfg.bin_dtype,
                                    doc_sep=cfg.doc_sep)
    except ValueError as err:
        parser.error(str(err))
    packings = None
    if cfg.pack:  # rows of seq_len + 1 tokens: inputs and targets are the two shifted slices
        packings = {name: llm_data.pack_documents(starts, stream.size, cfg.seq_len + 1)
                    for name, stream, starts in (("train", data.train, data.train_starts),
                                                 ("eval", data.eval, data.eval_starts))}
        for name, packing in packings.items():
            if packing.num_rows == 0:
                parser.error(f"{data.source}: the {name} split has no document of 2 or more "
                             f"tokens to pack (see --doc-sep, or pass --no-pack)")
    if cfg.prompt is not None and not data.is_bytes:
        parser.error("--prompt needs byte-level data (text); with token files the sample "
                     "continues the first eval tokens")
    model_cfg = llm_model.ModelConfig(
        vocab_size=data.vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_kv_heads, mlp_hidden=cfg.mlp_hidden, dtype=cfg.dtype, remat=cfg.remat)
    try:
        model_cfg.validate()
    except ValueError as err:
        parser.error(str(err))

    # ---- mesh, model and optimiser state, created sharded
    mesh = make_mesh(cfg, parser)
    fsdp = mesh.shape["fsdp"]
    attend = llm_model.make_attend(cfg.attention)

    def make_model() -> llm_model.Transformer:
        return llm_model.Transformer(model_cfg, attend, rngs=nnx.Rngs(cfg.seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(make_model))
    param_sharding = jax.tree.map(lambda a: NamedSharding(mesh, fsdp_spec(a.shape, fsdp)), abstract)
    params = jax.jit(lambda: nnx.state(make_model()), out_shardings=param_sharding)()
    n_params, n_matmul = llm_model.count_params(params)

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(cfg.steps, cfg.warmup_steps + 1), cfg.lr * cfg.min_lr_ratio)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        # No weight decay on norm scales (the only 1-D parameters).
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                    mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    )
    opt_state = jax.jit(tx.init)(params)
    # Moments inherit the parameters' shardings; scalars (step counts) are replicated.
    opt_sharding = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, P()),
        opt_state)
    opt_state = jax.device_put(opt_state, opt_sharding)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp"), None))

    # Windows hold seq_len + 1 tokens: inputs and targets are the two shifted slices, which
    # (not the odd-length window) get the sequence sharding over 'context'.
    token_sharding = NamedSharding(mesh, P(("data", "fsdp"), "context"))

    def loss_fn(params, batch):
        # batch: "tokens" (batch, seq_len + 1), and when packed "segment_ids" and "positions"
        shifted = lambda x, start, stop: jax.lax.with_sharding_constraint(x[:, start:stop],
                                                                           token_sharding)
        inputs, targets = shifted(batch["tokens"], 0, -1), shifted(batch["tokens"], 1, None)
        model = nnx.merge(graphdef, params)
        if "segment_ids" not in batch:
            logits = model(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        segments = shifted(batch["segment_ids"], 0, -1)
        logits = model(inputs, segment_ids=segments, positions=shifted(batch["positions"], 0, -1))
        # A target counts when it continues the input's document (not padding, not the next
        # document, which the input cannot see).
        keep = (segments == shifted(batch["segment_ids"], 1, None)) & (segments != 0)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(jnp.where(keep, losses, 0.0)) / jnp.maximum(jnp.sum(keep), 1)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)

    train_step = jax.jit(train_step, donate_argnums=(0, 1),
                         out_shardings=(param_sharding, opt_sharding, None, None))
    eval_step = jax.jit(loss_fn)

    def device_batch(batch: np.ndarray, sharding: NamedSharding = batch_sharding) -> jax.Array:
        # Every process builds the same global array and hands over the shards it owns
        # (a plain jnp.asarray would live on one local device only: wrong on several hosts).
        return jax.make_array_from_callback(batch.shape, sharding, lambda idx: batch[idx])

    def device_batches(batch: dict[str, np.ndarray] | np.ndarray) -> dict[str, jax.Array]:
        """A batch (the windows' array, or the packed rows' dict) on the devices, as a dict."""
        batch = batch if isinstance(batch, dict) else {"tokens": batch}
        return {name: device_batch(x) for name, x in batch.items()}

    def train_batch(step: int) -> dict[str, jax.Array]:
        if packings is None:
            return device_batches(llm_data.train_batch(data, step, cfg.batch_size, cfg.seq_len,
                                                       cfg.seed))
        return device_batches(llm_data.packed_train_batch(data, packings["train"], step,
                                                          cfg.batch_size, cfg.seed))

    # ---- checkpoints
    if lead:
        os.makedirs(out_dir, exist_ok=True)
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=3))
    start_step = 0
    latest = mngr.latest_step()
    config_path = os.path.join(ckpt_dir, "model_config.json")
    # What the parameters' shapes depend on (compute dtype and remat may change on resume).
    shape_fields = {k: v for k, v in dataclasses.asdict(model_cfg).items() if k not in ("dtype", "remat")}
    if cfg.resume:
        with open(config_path) as f:
            saved = json.load(f)
        if any(saved.get(k) != v for k, v in shape_fields.items()):
            parser.error(f"--resume: the checkpoint in {ckpt_dir} is of another model:\n"
                         f"  saved {saved}\n  now   {shape_fields}")
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              {"params": params, "opt_state": opt_state, "step": np.asarray(0, np.int32)})
        restored = mngr.restore(latest, args=ocp.args.StandardRestore(target))
        params, opt_state, start_step = restored["params"], restored["opt_state"], int(restored["step"])
        log(f"resumed from {ckpt_dir} at step {start_step}")
    elif cfg.overwrite and (earlier_steps or earlier_files):
        steps = sorted(mngr.all_steps())
        removed = [f"checkpoints at steps {steps} in {ckpt_dir}"] if steps else []
        removed += [os.path.join(out_dir, name) for name in earlier_files]
        log("--overwrite: removing the earlier run: " + "; ".join(removed))
        for step in steps:
            mngr.delete(step)
        if lead:
            for name in earlier_files:
                os.remove(os.path.join(out_dir, name))
    if lead:
        os.makedirs(ckpt_dir, exist_ok=True)
        with open(config_path, "w") as f:
            json.dump(shape_fields, f)

    def save(step: int) -> None:
        state = {"params": params, "opt_state": opt_state, "step": np.asarray(step, np.int32)}
        mngr.save(step, args=ocp.args.StandardSave(state))

    # ---- bookkeeping
    tokens_per_step = cfg.batch_size * cfg.seq_len
    padding = 0.0 if packings is None else packings["train"].padding_fraction
    mean_keys = None if packings is None else packings["train"].mean_keys()
    flops_per_step = (llm_model.train_flops_per_token(model_cfg, n_matmul, cfg.seq_len, mean_keys)
                      * tokens_per_step)
    peak = peak_flops(jax.devices()[0])
    peak_total = peak * jax.device_count() if peak and cfg.dtype == "bfloat16" else None
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    train_hist, eval_hist = read_metrics(metrics_path, start_step) if cfg.resume else ([], [])
    if lead:  # rewrite the history up to the start, so a resumed run appends cleanly
        with open(metrics_path, "w") as f:
            for kind, hist in (("train", train_hist), ("eval", eval_hist)):
                for step, loss in hist:
                    f.write(json.dumps({"kind": kind, "step": step, "loss": loss}) + "\n")
    if packings is None:
        eval_set = llm_data.eval_batches(data, cfg.eval_batches, cfg.batch_size, cfg.seq_len)
    else:
        eval_set = llm_data.packed_eval_batches(data, packings["eval"], cfg.eval_batches,
                                                cfg.batch_size)
    eval_set = [device_batches(b) for b in eval_set]

    def evaluate() -> float:
        return float(np.mean([float(eval_step(params, b)) for b in eval_set]))

    def record(kind: str, step: int, loss: float) -> None:
        (train_hist if kind == "train" else eval_hist).append((step, loss))
        if lead:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({"kind": kind, "step": step, "loss": loss}) + "\n")

    log(f"preset {cfg.preset} | {backend} x{jax.device_count()} ({jax.devices()[0].device_kind}) | "
        f"mesh data={mesh.shape['data']} fsdp={fsdp} context={mesh.shape['context']}")
    log(f"model {n_params / 1e6:.2f}M params (d_model {cfg.d_model}, {cfg.n_layers} layers, "
        f"{cfg.n_heads} heads / {cfg.n_kv_heads} kv heads, head_dim {model_cfg.head_dim}), "
        f"compute {cfg.dtype}, params float32")
    log(f"attention: {attention_description(cfg)}")
    log(f"data: {data.describe()}; batch {cfg.batch_size} x {cfg.seq_len} tokens")
    if packings is None:
        log("packing: off (--no-pack): windows of the token stream, documents back to back")
    else:
        train_pack = packings["train"]
        log(f"packing: {data.train_starts.size:,} train documents into {train_pack.num_rows:,} "
            f"rows of {cfg.seq_len + 1} tokens with segment ids; padding {padding:.3%} of tokens")

    # ---- train
    first_loss = last_loss = None
    eval_loss = None
    timed_steps, timed_s = 0, 0.0  # steady-state throughput: excludes step 1 (compile) and evals
    wall_start = time.perf_counter()
    bar = tqdm(range(start_step, cfg.steps), initial=start_step, total=cfg.steps,
               disable=not (lead and cfg.progress), dynamic_ncols=True, file=sys.stderr)
    window_start, window_steps = time.perf_counter(), 0
    for step in bar:
        params, opt_state, loss, grad_norm = train_step(params, opt_state, train_batch(step))
        done = step + 1
        if step == start_step:  # compile step: wait for it, then start the clocks
            first_loss = float(loss)
            record("train", done, first_loss)
            window_start, window_steps = time.perf_counter(), 0
            continue
        window_steps += 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            last_loss = float(loss)  # waits for the step: the clock below is honest
            elapsed = time.perf_counter() - window_start
            timed_steps, timed_s = timed_steps + window_steps, timed_s + elapsed
            tok_s = window_steps * tokens_per_step / elapsed
            mfu = f"{window_steps * flops_per_step / elapsed / peak_total:.1%}" if peak_total else "n/a"
            record("train", done, last_loss)
            bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tok_s:,.0f}", mfu=mfu,
                            gnorm=f"{float(grad_norm):.2f}", lr=f"{float(schedule(step)):.1e}")
            window_start, window_steps = time.perf_counter(), 0
        is_eval = done % cfg.eval_every == 0 or done == cfg.steps
        is_save = (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps
        if is_eval or is_save:
            jax.block_until_ready(loss)  # finish the queued training work before pausing the clock
            paused = time.perf_counter()
            if is_eval:
                eval_loss = evaluate()
                record("eval", done, eval_loss)
                log(f"step {done}: train loss {float(loss):.4f}, eval loss {eval_loss:.4f}")
            if is_save:
                save(done)
            window_start += time.perf_counter() - paused  # eval and saving are not training time
    bar.close()
    mngr.wait_until_finished()
    train_s = time.perf_counter() - wall_start
    if last_loss is None and first_loss is not None:
        last_loss = first_loss
    if eval_loss is None:
        eval_loss = evaluate()
    if start_step >= cfg.steps:
        log(f"nothing to train: the checkpoint is at step {start_step} >= --steps {cfg.steps}")

    # ---- sample
    replicated = NamedSharding(mesh, P())
    sample = generate(graphdef, params, data, cfg, lambda x: device_batch(np.asarray(x), replicated))
    log("sample:\n" + sample)

    # ---- summary
    tok_s = timed_steps * tokens_per_step / timed_s if timed_s > 0 else None
    mfu_value = (tok_s * flops_per_step / tokens_per_step / peak_total) if (tok_s and peak_total) else None
    summary = {
        "preset": cfg.preset,
        "attention": cfg.attention,
        "attention_impl": attention_description(cfg),
        "packing": cfg.pack,
        "padding_fraction": padding,
        "steps": cfg.steps,
        "start_step": start_step,
        "initial_loss": first_loss,
        "final_loss": last_loss,
        "eval_loss": eval_loss,
        "tokens_per_s": tok_s,
        "mfu": mfu_value,
        "params": n_params,
        "wall_time_s": train_s,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "out_dir": out_dir,
        "ckpt_dir": ckpt_dir,
    }
    if lead:
        plot_losses(os.path.join(out_dir, "loss.png"), train_hist, eval_hist,
                    f"{cfg.preset}, attention={cfg.attention}")
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(json.dumps(summary), flush=True)
    mngr.close()
    return summary


def generate(graphdef: nnx.GraphDef, params: nnx.State, data: llm_data.TokenData, cfg: Config,
             to_device: Any) -> str:
    """Samples ``cfg.sample_tokens`` tokens after a prompt; returns the decoded text (byte
    data) or the token ids. Each step runs the model on a fixed-length window, so one compiled
    function serves every step (fine for a demo; a server would keep a KV cache)."""
    if cfg.sample_tokens == 0:
        return ""
    if cfg.prompt is not None:
        prompt = list(cfg.prompt.encode())
    elif data.is_bytes and data.source == llm_data.STDLIB_SOURCE:
        prompt = list(b"def ")
    else:
        prompt = [int(t) for t in data.eval[:16]]
    tokens = prompt[-cfg.seq_len :] or [0]

    @jax.jit
    def next_token(params, window, length, i):
        logits = nnx.merge(graphdef, params)(window[None])[0, length - 1]
        if cfg.temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        key = jax.random.fold_in(jax.random.key(cfg.seed + 1), i)
        return jax.random.categorical(key, logits / cfg.temperature).astype(jnp.int32)

    for i in range(cfg.sample_tokens):
        context = tokens[-cfg.seq_len :]
        window = np.zeros(cfg.seq_len, np.int32)  # padding after the context is never attended
        window[: len(context)] = context
        length, step = np.asarray(len(context), np.int32), np.asarray(i, np.int32)
        tokens.append(int(next_token(params, to_device(window), to_device(length), to_device(step))))
    if data.is_bytes:
        return bytes(tokens).decode("utf-8", errors="replace")
    return " ".join(map(str, tokens))


if __name__ == "__main__":
    main()
