"""The straggler rule, progress output and per-rank log files (no processes needed)."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest

from ddptrain.metrics import MetricsWriter, Progress
from ddptrain.runlog import RUN_LOG, rank_log
from ddptrain.stragglers import find_straggler


def test_find_straggler_names_the_slowest_rank_above_the_factor() -> None:
    found = find_straggler([0.10, 0.11, 0.10, 0.31], factor=1.5)
    assert found is not None and found.rank == 3
    assert found.median == pytest.approx(0.105) and found.ratio == pytest.approx(0.31 / 0.105)


def test_find_straggler_quiet_below_the_factor_or_alone() -> None:
    assert find_straggler([0.10, 0.14, 0.12], factor=1.5) is None
    assert find_straggler([5.0], factor=1.5) is None


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_plain_lines_have_eta() -> None:
    out = io.StringIO()
    p = Progress(True, total=100, initial=0, stream=out)
    p.update(10, {"loss": 2.5, "tokens_per_s": 12345.0, "mfu": 0.4123})
    p.update(20, {"loss": 2.0, "tokens_per_s": 12345.0, "mfu": 0.4123})
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step     10/100  loss 2.5000  tokens_per_s 12,345  mfu 41.2%")
    assert "eta" not in lines[0] and " eta " in lines[1]


def test_progress_bar_on_a_tty_shows_fields_and_eta() -> None:
    out = _Tty()
    p = Progress(True, total=50, initial=0, stream=out)
    p.update(10, {"loss": 2.5, "tokens_per_s": 999.0})
    p.update(20, {"loss": 2.0, "tokens_per_s": 999.0})
    p.message("checkpoint step 20 committed")
    p.close()
    text = out.getvalue()
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
    with pytest.raises(ValueError), rank_log(tmp_path, rank=7, world_size=8, hostname="node3"):
        silent.message("warning: something odd on this rank")
        silent.update(3, {"loss": 1.0})
        raise ValueError("boom on rank 7")
    text = (tmp_path / "logs" / "rank-7.log").read_text()
    assert "rank 7 of 8 on node3" in text
    assert "WARNING warning: something odd on this rank" in text
    assert "step      3/10  loss 1.0000" in text
    assert "ValueError: boom on rank 7" in text and "Traceback" in text
    log_file = str((tmp_path / "logs" / "rank-7.log").resolve())
    assert all(getattr(h, "baseFilename", None) != log_file for h in RUN_LOG.handlers)  # detached afterwards


def test_tensorboard_sink(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    w = MetricsWriter(tmp_path, enabled=True, tensorboard=True)
    w.write("train", step=1, loss=2.0, mfu=0.3)
    w.write("ranks", step=1, local_step_s=[0.1, 0.2], hosts=["a", "b"])
    w.close()
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2
