"""The straggler detector, progress output and per-rank log files (no processes needed)."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.observe.metrics import MetricsWriter, Progress
from ddptrain.observe.runlog import PACKAGE_LOG, ConsoleHandler, run_logging
from ddptrain.observe.stragglers import StragglerDetector

log = logging.getLogger("ddptrain.tests")


@contextmanager
def console(stream: io.StringIO) -> Iterator[None]:
    """Rank 0's console handler, writing into stream."""
    handler = ConsoleHandler(stream)
    PACKAGE_LOG.addHandler(handler)
    try:
        yield
    finally:
        PACKAGE_LOG.removeHandler(handler)


def _feed(
    det: StragglerDetector, per_rank: list[float], steps: int, comm: float = 0.004, wait: list[float] | None = None
) -> list:
    """steps identical steps: per_rank[r] seconds of local time on rank r, wait[r] of it waiting for a CPU."""
    waits = wait or [0.0] * len(per_rank)
    return det.add([[x] * steps for x in per_rank], [[comm] * steps for _ in per_rank], [[w] * steps for w in waits])


def test_a_slow_rank_is_named_after_confirmation_at_two_ranks() -> None:
    det = StragglerDetector(world_size=2, window=20, factor=1.2, confirm=2)
    assert _feed(det, [0.010, 0.010], 20) == []
    assert _feed(det, [0.010, 0.013], 20) == []  # first strike: not yet
    found = _feed(det, [0.010, 0.013], 10)
    assert [(f.kind, f.rank) for f in found] == [("compute", 1)]
    assert found[0].ratio == pytest.approx(1.3)


def test_a_median_including_the_rank_itself_would_hide_it_the_other_ranks_do_not() -> None:
    det = StragglerDetector(world_size=2, window=10, factor=1.5, confirm=1)
    found = _feed(det, [0.010, 0.018], 10)  # 1.8x: the mean of both is only 1.29x below it
    assert [f.rank for f in found] == [1]


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(2, 8),
    shared=st.lists(st.floats(0.5, 4.0), min_size=30, max_size=90),
    jitter=st.lists(st.floats(0.97, 1.03), min_size=8, max_size=8),
)
def test_a_slowdown_all_ranks_share_is_never_a_straggler(world: int, shared: list[float], jitter: list[float]) -> None:
    det = StragglerDetector(world_size=world, window=20, factor=1.15, confirm=2)
    for i, load in enumerate(shared):  # the whole machine gets slower and faster, together
        local = [[0.01 * load * jitter[(r + i) % 8]] for r in range(world)]
        assert all(f.kind != "compute" for f in det.add(local, [[0.004]] * world, [[0.0]] * world))


@settings(max_examples=40, deadline=None)
@given(world=st.integers(2, 8), slow=st.integers(0, 7), ratio=st.floats(1.25, 3.0))
def test_one_slow_rank_among_any_number_is_the_one_named(world: int, slow: int, ratio: float) -> None:
    slow %= world
    det = StragglerDetector(world_size=world, window=20, factor=1.2, confirm=2)
    local = [0.01 * (ratio if r == slow else 1.0) for r in range(world)]
    found = _feed(det, local, 20) + _feed(det, local, 10)
    assert {f.rank for f in found if f.kind == "compute"} == {slow}


def test_one_descheduled_step_is_capped_a_slowdown_spread_over_the_steps_counts_in_full() -> None:
    det = StragglerDetector(world_size=4, window=20, factor=1.2, confirm=1)
    rows = [[0.01] * 20 for _ in range(4)]
    rows[2][7] = 0.5  # one step of rank 2 descheduled for half a second: counts as 3 median steps
    assert det.add(rows, [[0.004] * 20] * 4, [[0.0] * 20] * 4) == []
    assert det.ratios()[2] == pytest.approx((19 * 0.01 + 0.03) / (20 * 0.01))
    # The same 0.1 s of excess spread as a 1.5x slowdown of every step is named.
    rows[2] = [0.015] * 20
    found = StragglerDetector(world_size=4, window=20, factor=1.2, confirm=1).add(
        rows, [[0.004] * 20] * 4, [[0.0] * 20] * 4
    )
    assert [(f.rank, round(f.ratio, 6)) for f in found] == [(2, 1.5)]


def test_waiting_for_a_cpu_is_not_computing_slower() -> None:
    # Rank 1 spends 4 ms of every step waiting for a CPU (other processes on its host): same busy time.
    det = StragglerDetector(world_size=2, window=10, factor=1.2, confirm=1)
    assert _feed(det, [0.010, 0.014], 10, wait=[0.0, 0.004]) == []
    assert det.ratios() == [1.0, 1.0]
    # Stopped or slowed without waiting for a CPU (a SIGSTOP, a slow device): named.
    assert [f.rank for f in _feed(det, [0.010, 0.014], 10, wait=[0.0, 0.0])] == [1]


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(2, 8),
    slow=st.integers(0, 7),
    ratio=st.floats(1.25, 3.0),
    waits=st.lists(st.floats(0.0, 0.02), min_size=8, max_size=8),
)
def test_cpu_waits_never_hide_or_fake_a_straggler(world: int, slow: int, ratio: float, waits: list[float]) -> None:
    slow %= world
    det = StragglerDetector(world_size=world, window=10, factor=1.2, confirm=1)
    busy = [0.01 * (ratio if r == slow else 1.0) for r in range(world)]
    found = _feed(det, [b + waits[r] for r, b in enumerate(busy)], 10, wait=waits[:world])
    assert {f.rank for f in found if f.kind == "compute"} == {slow}


def test_slow_communication_is_told_from_slow_compute() -> None:
    det = StragglerDetector(world_size=4, window=10, factor=1.2, confirm=2)
    _feed(det, [0.01] * 4, 10, comm=0.004)  # baseline
    _feed(det, [0.01] * 4, 10, comm=0.020)
    found = _feed(det, [0.01] * 4, 5, comm=0.020)
    assert [(f.kind, f.rank) for f in found] == [("comm", None)]
    assert found[0].reference == pytest.approx(0.004) and found[0].ratio == pytest.approx(5.0)


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_have_eta() -> None:
    out = io.StringIO()
    p = Progress(True, total=100, initial=0, stream=out)
    with console(out):
        p.update(10, {"loss": 2.5, "tokens_per_s": 12345.0, "mfu": 0.4123})
        p.update(20, {"loss": 2.0, "tokens_per_s": 12345.0, "mfu": 0.4123})
        log.warning("something odd")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step     10/100  loss 2.5000  tokens_per_s 12,345  mfu 41.2%")
    assert "eta" not in lines[0] and " eta " in lines[1]
    assert lines[2] == "warning: something odd"  # the level is the caller's, shown as a prefix


def test_progress_bar_on_a_tty_shows_fields_and_eta() -> None:
    out = _Tty()
    p = Progress(True, total=50, initial=0, stream=out)
    with console(out):
        p.update(10, {"loss": 2.5, "tokens_per_s": 999.0})
        p.update(20, {"loss": 2.0, "tokens_per_s": 999.0})
        log.info("checkpoint step 20 committed")
    p.close()
    text = out.getvalue()
    assert text.count("step     10/50") == 0  # with a bar, step lines go to the rank's file only
    assert "20/50" in text and "loss 2.0000" in text and "tokens_per_s 999" in text
    assert "<" in text  # tqdm's elapsed<remaining
    assert "checkpoint step 20 committed" in text


def test_progress_bar_after_a_resume_counts_only_this_process() -> None:
    out = _Tty()
    p = Progress(True, total=1000, initial=0, stream=out)
    p.update(900, {"loss": 1.0})  # resumed at step 890, first record at 900
    time.sleep(0.2)
    p.update(910, {"loss": 1.0})
    assert p.bar is not None and p.bar.n == 910 and p.bar.initial == 900
    rate = p.bar.format_dict["rate"] or (910 - 900) / p.bar.format_dict["elapsed"]
    assert rate < 1000  # 10 steps in >= 0.2 s, not 910
    p.close()


def test_rank_log_keeps_messages_of_a_silent_rank_and_the_traceback(tmp_path: Path) -> None:
    silent = Progress(False, total=10, initial=0, stream=io.StringIO())
    with pytest.raises(ValueError), run_logging(tmp_path, rank=7, world_size=8, hostname="node3"):
        log.warning("something odd on this rank")
        silent.update(3, {"loss": 1.0})
        raise ValueError("boom on rank 7")
    text = (tmp_path / "logs" / "rank-7.log").read_text()
    assert "rank 7 of 8 on node3" in text
    assert "rank 7 WARNING ddptrain.tests: something odd on this rank" in text
    assert "step      3/10  loss 1.0000" in text
    assert "ValueError: boom on rank 7" in text and "Traceback" in text
    log_file = str((tmp_path / "logs" / "rank-7.log").resolve())
    assert all(getattr(h, "baseFilename", None) != log_file for h in PACKAGE_LOG.handlers)  # detached afterwards


def test_tensorboard_sink(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from ddptrain.observe.trackers.tensorboard_sink import TensorBoardSink

    w = MetricsWriter(tmp_path, enabled=True, sinks=[TensorBoardSink(tmp_path)])
    w.write("train", step=1, loss=2.0, mfu=0.3)
    w.write("ranks", step=1, local_step_s=[0.1, 0.2], hosts=["a", "b"])
    w.close()
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
