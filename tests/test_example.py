"""Smoke test of examples/train_llm.py: a few steps in-process, the loss falls, the outputs
are written where the first lines say, a rerun refuses to replace the earlier run, a resumed
run continues from the checkpoint and --overwrite starts over; documents are packed with
segment ids by default (--no-pack turns it off), also with the sequence sharded over
'context'. Plus its data pipeline (packing included) and flag errors, which need no
training."""

from __future__ import annotations

import importlib
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    """Imports examples/<name>.py (the examples are scripts, not a package)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def train_llm():
    return _load("train_llm")


@pytest.fixture(scope="module")
def llm_data():
    return _load("llm_data")


# A model small enough that a step takes milliseconds; lr high and warmup short so that ten
# steps visibly lower the loss from ln(256) ~ 5.55.
SMALL = ["--d-model", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
         "--mlp-hidden", "128", "--seq-len", "64", "--batch-size", "8", "--lr", "1e-2",
         "--warmup-steps", "2", "--eval-every", "5", "--eval-batches", "2", "--log-every", "5",
         "--ckpt-every", "5", "--sample-tokens", "8", "--no-progress", "--preset", "cpu-tiny"]


def _ckpt_steps(out):
    ckpt = os.path.join(out, "checkpoints")
    return sorted(int(name) for name in os.listdir(ckpt) if name.isdigit())


def test_train_resume(train_llm, tmp_path, capsys):
    out = str(tmp_path / "run")
    first = train_llm.main(SMALL + ["--steps", "10", "--out-dir", out])
    printed = capsys.readouterr().out.strip().splitlines()
    # The first lines say where the run's files go, before anything is built.
    assert printed[0].startswith(f"out dir: {out} ") and "summary.json" in printed[0], printed[:2]
    assert printed[1] == f"checkpoints: {os.path.join(out, 'checkpoints')}", printed[:2]
    assert first["out_dir"] == out and first["ckpt_dir"] == os.path.join(out, "checkpoints")
    assert first["start_step"] == 0 and first["steps"] == 10
    # Packing is the default: the log says so and gives the padding, as the summary does.
    assert first["packing"] is True and 0.0 <= first["padding_fraction"] < 0.01, first
    assert any(line.startswith("packing: ") and "padding" in line for line in printed), printed
    assert first["initial_loss"] > 5.0
    assert first["final_loss"] < first["initial_loss"] - 1.0, first
    assert first["eval_loss"] < first["initial_loss"] - 1.0, first
    assert first["tokens_per_s"] > 0 and first["mfu"] is None  # no MFU on CPU
    for name in ("summary.json", "loss.png", "metrics.jsonl"):
        assert os.path.getsize(os.path.join(out, name)) > 0, name
    with open(os.path.join(out, "summary.json")) as f:
        assert json.load(f)["final_loss"] == first["final_loss"]
    assert json.loads(printed[-1])["eval_loss"] == first["eval_loss"]  # last line: the JSON
    assert _ckpt_steps(out) == [5, 10]

    # A rerun without --resume or --overwrite refuses, names both, and changes nothing.
    with open(os.path.join(out, "summary.json")) as f:
        summary_before = f.read()
    with pytest.raises(SystemExit) as exc:
        train_llm.main(SMALL + ["--steps", "10", "--out-dir", out])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--resume" in err and "--overwrite" in err and "steps [5, 10]" in err, err
    assert _ckpt_steps(out) == [5, 10]
    with open(os.path.join(out, "summary.json")) as f:
        assert f.read() == summary_before

    # Resume: starts at the saved step 10, and from the trained weights (a fresh model would
    # start again near ln(256)).
    second = train_llm.main(SMALL + ["--steps", "15", "--out-dir", out, "--resume"])
    assert second["start_step"] == 10 and second["steps"] == 15
    assert second["initial_loss"] < first["initial_loss"] - 1.0, second
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if '"train"' in line]
    assert steps == sorted(steps) and steps[-1] == 15 and 10 in steps

    # An explicit checkpoint dir that holds checkpoints is never overwritten silently, even
    # with a fresh out dir.
    with pytest.raises(SystemExit):
        train_llm.main(SMALL + ["--steps", "15", "--out-dir", str(tmp_path / "fresh"),
                                "--ckpt-dir", os.path.join(out, "checkpoints")])
    assert "steps [5, 10, 15]" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "fresh")

    # --overwrite deletes the earlier run, says what it deletes, and starts from step 0.
    capsys.readouterr()
    third = train_llm.main(SMALL + ["--steps", "5", "--out-dir", out, "--overwrite",
                                    "--sample-tokens", "0"])
    said = capsys.readouterr().out
    assert "--overwrite: removing the earlier run: checkpoints at steps [5, 10, 15]" in said, said
    assert os.path.join(out, "summary.json") in said, said
    assert third["start_step"] == 0 and third["initial_loss"] > 5.0, third
    assert _ckpt_steps(out) == [5]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert max(json.loads(line)["step"] for line in f) == 5


def test_no_pack_and_context_parallel_packing(train_llm, tmp_path, capsys):
    """--no-pack trains on windows (no segment ids); with packing and the sequence sharded
    over 'context' (ring attention with segment ids) the first loss equals the unsharded
    run's (same weights, same batch) and training lowers it."""
    common = SMALL + ["--steps", "10", "--ckpt-every", "0", "--sample-tokens", "0"]
    windows = train_llm.main(common + ["--out-dir", str(tmp_path / "windows"), "--no-pack"])
    assert windows["packing"] is False and windows["padding_fraction"] == 0.0
    assert windows["final_loss"] < windows["initial_loss"] - 1.0, windows
    assert "packing: off" in capsys.readouterr().out
    packed = train_llm.main(common + ["--out-dir", str(tmp_path / "packed")])
    # Under pytest the Python stacks are deep, and with full tracebacks in the HLO locations
    # XLA:CPU's call inliner spends minutes comparing stack-frame metadata of the ring's
    # nested calls (seen with JAX 0.10.2, packed or not; seconds outside pytest).
    import jax
    previous = jax.config.jax_include_full_tracebacks_in_locations
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    try:
        context = train_llm.main(common + ["--out-dir", str(tmp_path / "context"),
                                           "--context", "2"])
    finally:
        jax.config.update("jax_include_full_tracebacks_in_locations", previous)
    assert context["packing"] is True
    assert abs(context["initial_loss"] - packed["initial_loss"]) < 1e-4, (context, packed)
    assert context["final_loss"] < context["initial_loss"] - 1.0, context


def test_flag_errors(train_llm, tmp_path, capsys):
    cases = [
        (["--data", str(tmp_path / "missing.txt")], "no such file"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--n-heads", "4", "--n-kv-heads", "3"], "n_kv_heads"),
        (["--resume", "--out-dir", str(tmp_path / "empty")], "no checkpoint"),
        (["--resume", "--overwrite", "--out-dir", str(tmp_path / "empty")], "pass one"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            # A fresh --out-dir first (a case's own comes later and wins): the default one is the
            # working directory's out/train_llm, where the README's main job leaves a run that
            # is refused before these flags are read.
            train_llm.main(["--out-dir", str(tmp_path / "fresh"), *argv, "--no-progress", "--preset", "cpu-tiny"])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv


def test_data_sources_and_batches(llm_data, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 20)
    data = llm_data.load_tokens(str(text), seq_len=32, eval_fraction=0.1)
    assert data.is_bytes and data.vocab_size == 256 and data.train.size + data.eval.size == 5120

    tokens = (np.arange(5000) % 700).astype(np.uint16)
    tokens.tofile(tmp_path / "tokens.bin")
    np.save(tmp_path / "tokens.npy", tokens.astype(np.int32))
    for name in ("tokens.bin", "tokens.npy"):
        data = llm_data.load_tokens(str(tmp_path / name), seq_len=32)
        assert not data.is_bytes and data.vocab_size == 700
        np.testing.assert_array_equal(np.concatenate([data.train, data.eval]), tokens)
    with pytest.raises(ValueError, match="vocab-size"):
        llm_data.load_tokens(str(tmp_path / "tokens.npy"), seq_len=32, vocab_size=500)

    # Windows of seq_len + 1 consecutive tokens; batches depend only on (seed, step); one
    # epoch visits every window once.
    data = llm_data.load_tokens(str(tmp_path / "tokens.npy"), seq_len=32)
    b = llm_data.train_batch(data, 3, 4, 32, seed=0)
    assert b.shape == (4, 33) and b.dtype == np.int32
    assert ((np.diff(b, axis=1) % 700) == 1).all()
    np.testing.assert_array_equal(b, llm_data.train_batch(data, 3, 4, 32, seed=0))
    data = llm_data.TokenData(np.arange(3201), np.arange(100), 3201, False, "arange")
    n = llm_data.num_windows(data.train, 32)
    epoch = np.concatenate([llm_data.train_batch(data, s, 4, 32, seed=1) for s in range(n // 4)])
    assert sorted(epoch[:, 0]) == list(range(0, 3200, 32))


def test_packing(llm_data, tmp_path):
    """pack_documents: every token of every document (of 2 or more tokens) lands in exactly
    one row, pieces never cross a document, rows hold at most row_len tokens; the rows'
    segment ids count up from 1 with padding 0 after them, positions restart at each piece,
    and the tokens are the documents'. Best fit: rests share rows where they fit."""
    row = 8
    lengths = [20, 5, 3, 1, 2, 6, 8, 4]  # 20 = two full rows + a rest of 4; 1 is dropped
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    total = int(np.sum(lengths))
    tokens = np.arange(total, dtype=np.int32) + 1000
    packing = llm_data.pack_documents(starts, total, row)
    doc_of = np.repeat(np.arange(len(lengths)), lengths)
    cover = np.zeros(total, np.int64)
    for s, n in zip(packing.piece_start, packing.piece_len):
        cover[s:s + n] += 1
        assert len(set(doc_of[s:s + n])) == 1 and n <= row
    np.testing.assert_array_equal(cover, (np.asarray(lengths) != 1)[doc_of])
    # rests 6, 5, 4, 4, 3, 2 (and the full pieces 8, 8, 8) into rows of 8: 3 + 3 rows
    assert packing.num_rows == 6
    assert np.isclose(packing.padding_fraction, 1 - (total - 1) / (6 * row))
    rows = llm_data.packed_rows(tokens, packing, np.arange(packing.num_rows))
    for b in range(packing.num_rows):
        seg, pos, tok = rows["segment_ids"][b], rows["positions"][b], rows["tokens"][b]
        real = seg > 0
        assert (np.diff(seg[real]) >= 0).all() and seg[real][0] == 1 and not seg[~real].any()
        assert real[:real.sum()].all()  # padding only at the end
        for sid in np.unique(seg[real]):
            piece = seg == sid
            np.testing.assert_array_equal(pos[piece], np.arange(piece.sum()))
            assert (np.diff(tok[piece]) == 1).all()  # consecutive tokens of one document

    # Documents of a user file end after each --doc-sep token; the split keeps them.
    ids = np.array([5, 6, 0, 7, 8, 9, 0, 1, 2] * 40, np.int32)
    np.save(tmp_path / "docs.npy", ids)
    data = llm_data.load_tokens(str(tmp_path / "docs.npy"), seq_len=8, doc_sep=0,
                                eval_fraction=0.1)
    assert data.train_starts[0] == 0 and data.eval_starts[0] == 0
    assert (data.train[data.train_starts[1:] - 1] == 0).all()
    with pytest.raises(ValueError, match="doc-sep"):
        llm_data.load_tokens(str(tmp_path / "docs.npy"), seq_len=8, doc_sep=50)

    # Batches are a pure function of (seed, step), and an epoch visits every row once.
    data = llm_data.TokenData(tokens, tokens[:10], 2000, False, "arange", starts, np.zeros(1))
    b = llm_data.packed_train_batch(data, packing, 1, 3, seed=0)
    assert b["tokens"].shape == (3, row) and b["segment_ids"].dtype == np.int32
    again = llm_data.packed_train_batch(data, packing, 1, 3, seed=0)
    for name in b:
        np.testing.assert_array_equal(b[name], again[name])
    epoch = np.concatenate([llm_data.packed_train_batch(data, packing, s, 3, seed=0)["tokens"]
                            for s in range(2)])
    assert sorted(map(tuple, epoch)) == sorted(map(tuple, rows["tokens"]))


def test_stdlib_corpus_is_python(llm_data):
    files = llm_data.stdlib_files()
    assert len(files) > 100 and all(f.endswith(".py") for f in files)
    assert not any("site-packages" in f for f in files)
    corpus, starts = llm_data.stdlib_documents()  # one document per file
    assert starts[0] == 0 and len(starts) <= len(files) and (np.diff(starts) > 0).all()
    assert all(corpus[s - 2:s] == b"\n\n" for s in starts[1:50])
