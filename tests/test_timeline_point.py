"""benchmarks/timeline_point.py's split of a GPU timeline into calls, on synthetic events."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("timeline_point", ROOT / "benchmarks" / "timeline_point.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)
Event = timeline.Event


def loop_events(calls: int, with_memset: bool) -> list[Event]:
    """A loop of `calls` calls, 120 us apart (us): [memset 2 at +0], kernel 100 at +5, a fusion
    3 at +107, overlapping nothing; idle 2 + 10 (+ 3 before the memset)."""
    out, t = [], 0.0
    for _ in range(calls):
        if with_memset:
            out.append(Event(t * 1e3, 2e3, "Memset (Device)"))
        out.append(Event((t + 5) * 1e3, 100e3, "void fa3::fwd_kernel<fa3::FwdTraits<x, 128>>(T1::Params)"))
        out.append(Event((t + 107) * 1e3, 3e3, "loop_add_fusion"))
        t += 120
    return sorted(out)


def test_split_with_memset():
    split = timeline.split_calls(loop_events(10, with_memset=True))
    assert split["anchor"] == "fwd_kernel"  # the op with the most GPU time
    assert split["calls"] == 7  # first and last left out
    assert split["period_us"] == pytest.approx(120.0)
    assert split["ops_us"] == pytest.approx({"fwd_kernel": 100.0, "loop_add_fusion": 3.0, "Memset (Device)": 2.0})
    # busy: kernel 5-105, fusion 107-110, next memset 120-122, next kernel at 125
    assert split["idle_us"] == pytest.approx(2.0 + 10.0 + 3.0)


def test_split_without_memset_and_named_anchor():
    split = timeline.split_calls(loop_events(6, with_memset=False), anchor=r"fwd_kernel")
    assert split["calls"] == 3
    assert split["ops_us"] == pytest.approx({"fwd_kernel": 100.0, "loop_add_fusion": 3.0})
    assert split["idle_us"] == pytest.approx(2.0 + 15.0)
    table = timeline.render(split, "t")
    assert "| (idle: no op running) | 17.0 | 14.2% |" in table


def test_op_missing_from_some_calls_counts_zero():
    events = loop_events(8, with_memset=False)
    extra = Event(events[7].start_ns + 101e3, 1e3, "memcpy")  # one call only
    split = timeline.split_calls(sorted(events + [extra]))
    assert split["ops_us"]["memcpy"] == 0.0  # median over the calls, most without it


def test_too_few_calls_and_no_events():
    with pytest.raises(ValueError, match="too few calls"):
        timeline.split_calls(loop_events(3, with_memset=False))
    with pytest.raises(ValueError, match="no GPU events"):
        timeline.split_calls([])


def test_short_name():
    assert timeline.short_name("void fa3::bwd::bwd_main_kernel<T, 0>(P)") == "bwd_main_kernel"
    assert timeline.short_name("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
                               "flash::CollectiveMainloopFwdSm90<2, x>>>>(Params)") == "FlashAttnFwdSm90"
    assert timeline.short_name("void cutlass::device_kernel<flash::FlashAttnBwdPreprocess<cute::tuple<"
                               "cute::C<64>>, float>>(Params)") == "FlashAttnBwdPreprocess"
    assert timeline.short_name("loop_multiply_fusion_3") == "loop_multiply_fusion_3"


def test_main_end_to_end(capsys):
    """The whole tool on a tiny XLA attention: a table on a GPU, a clear refusal elsewhere."""
    import jax

    rc = timeline.main(["--impl", "xla", "--tokens", "256", "--seqlen", "128", "--hidden", "256", "--calls", "6"])
    out = capsys.readouterr().out
    if jax.devices()[0].platform == "gpu":
        assert rc == 0 and "us per call" in out and "(idle: no op running)" in out
    else:
        assert rc == 2 and "this needs a GPU" in out
