"""`ddptrain report` and `ddptrain generate` on real runs: finished, killed mid-way, and bad metrics files."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import matplotlib.image
import pytest
from helpers import TINY, read_metrics
from PIL import Image

from ddptrain.cli import main

PNGS = ("loss.png", "lr.png", "throughput.png", "step_time.png", "goodput.png")


def ddptrain(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`ddptrain ARGS` in this process (the report and generate commands need no launcher): rc, stdout, stderr."""
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def finished_run(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    args = ["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={run_dir}", "train.eval_every=3"]
    assert main(args) == 0  # in this process: the run's folder is what the tests read
    return run_dir


def assert_valid_pngs(folder: Path) -> None:
    for name in PNGS:
        path = folder / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        with Image.open(path) as img:
            img.verify()
        pixels = matplotlib.image.imread(path)
        assert pixels.ndim == 3 and pixels.shape[0] >= 300 and pixels.shape[1] >= 1000, name  # readable size
        assert pixels.std() > 0, f"{name} is blank"


@pytest.mark.timeout(120)
def test_train_records_throughput_fields(finished_run: Path) -> None:
    rec = read_metrics(finished_run)[-1]
    for key in (
        "samples_per_s",
        "tokens_per_s",
        "tokens_per_s_per_rank",
        "flops_per_token",
        "flops_per_s_per_device",
        "peak_mem_mb",
        "data_wait_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
    ):
        assert isinstance(rec[key], (int, float)) and rec[key] > 0, key
    assert "mfu" not in rec  # a CPU has no peak in the table
    assert "exposed_comm_s" not in rec  # one process: no gradient all-reduce to measure
    assert rec["tokens_per_s"] == pytest.approx(rec["samples_per_s"] * 32)  # block_size 32 tokens/sample
    assert (finished_run / "logs" / "rank-0.log").read_text().count("step ") >= 6


@pytest.mark.timeout(120)
def test_report_on_a_finished_run(finished_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = ddptrain(capsys, "report", str(finished_run))
    assert rc == 0, err
    assert "status: finished (6 steps)" in out
    assert "best val loss:" in out and "world size 1, steps 1-6: " in out and "mean over 5 log windows" in out
    assert "MFU: n/a (device peak unknown); achieved" in out
    assert "checkpoints: 2 committed during the run; on disk now: step-00000006, step-00000003" in out
    assert "1 attempt(s)" in out and "events: 1" in out and "goodput: " in out
    assert "attempts: completed" in out and "completed: attempt 1 completed at step 6 (exit 0)" in out
    assert_valid_pngs(finished_run / "report")
    assert (finished_run / "report" / "summary.txt").read_text().strip() == out.split("\nwrote ")[0].strip()


@pytest.mark.timeout(120)
def test_report_on_a_run_killed_mid_way(
    tiny_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    # A forked copy of this process trains (no interpreter to start, torch already imported) until SIGKILLed.
    argv = ["train", *tiny_args, "train.max_steps=100000", "train.eval_every=4"]
    trainer = mp.get_context("fork").Process(target=main, args=(argv,))
    trainer.start()
    metrics = run_dir / "metrics.jsonl"
    try:
        while trainer.is_alive():
            if metrics.is_file() and metrics.read_text().count('"kind": "train"') >= 8:
                break
            time.sleep(0.2)
        assert trainer.is_alive(), f"training ended with exit code {trainer.exitcode} before it was killed"
        os.kill(trainer.pid or 0, signal.SIGKILL)
    finally:
        trainer.kill()
        trainer.join()
    with open(metrics, "a") as f:
        f.write('{"kind": "train", "step": 99, "loss": 1.2')  # what a kill during a write leaves
    rc, out, err = ddptrain(capsys, "report", str(run_dir))
    assert rc == 0, err
    assert "status: incomplete: still running or crashed" in out
    assert "the last line was cut off mid-write" in out
    assert_valid_pngs(run_dir / "report")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty: nothing to report"),
        (
            '{"kind": "train", "step": 1, "loss": 2.0, "step_time_s": 0.1, "samples_per_s": 9.0}\nnot json at all\n'
            '{"kind": "train", "step": 2, "loss": 1.0, "step_time_s": 0.1, "samples_per_s": 9.0}\n',
            "line 2 is malformed",
        ),
        ('{"kind": "event", "event": "start", "step": 0}\n', "has no training records yet"),
        (None, "no metrics file at"),
    ],
)
@pytest.mark.timeout(60)
def test_report_on_bad_metrics_exits_2_with_one_message(
    tmp_path: Path, content: str | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    rc, out, err = ddptrain(capsys, "report", str(tmp_path))
    assert rc == 2 and out == ""
    assert message in err and err.startswith("ddptrain report: error:") and err.count("\n") == 1


@pytest.mark.timeout(120)
def test_generate_continues_the_prompt(finished_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = ddptrain(capsys, "generate", str(finished_run), "--prompt", "def ", "--max-new-tokens", "40")
    assert rc == 0, err
    assert out.startswith("def ") and len(out.rstrip("\n")) > len("def ")
    assert "step-00000006" in err
    assert (
        ddptrain(capsys, "generate", str(finished_run), "--prompt", "def ", "--max-new-tokens", "40")[1] == out
    )  # seeded


@pytest.mark.timeout(60)
def test_generate_without_checkpoint_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = ddptrain(capsys, "generate", str(tmp_path), "--prompt", "x")
    assert rc == 2 and "no committed checkpoint" in err and err.count("\n") == 1


@pytest.mark.timeout(120)
def test_report_summarizes_restarts_stragglers_mfu_and_a_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A metrics file in the trainer's format covering what a CPU test run cannot produce: MFU,
    # a resume, straggler checks and a stop.
    def train(step: int, mfu: float) -> dict:
        return {
            "kind": "train",
            "step": step,
            "loss": 3.0 - 0.1 * step,
            "lr": 1e-3,
            "step_time_s": 0.5,
            "samples_per_s": 64.0,
            "tokens_per_s": 8192.0,
            "mfu": mfu,
            "data_wait_s": 0.01,
            "forward_s": 0.1,
            "backward_s": 0.3,
            "optimizer_s": 0.05,
            "exposed_comm_s": 0.02,
            "world_size": 2,
        }

    records = [
        {"kind": "event", "event": "start", "step": 0},
        train(2, 0.9),
        train(4, 0.30),
        {"kind": "ranks", "step": 4, "local_step_s": [0.1, 0.1], "hosts": ["a", "b"], "median_s": 0.1, "factor": 1.5},
        {"kind": "event", "event": "resume", "step": 4},
        train(6, 0.40),
        {
            "kind": "ranks",
            "step": 6,
            "local_step_s": [0.1, 0.3],
            "hosts": ["a", "b"],
            "median_s": 0.2,
            "factor": 1.5,
            "straggler_rank": 1,
            "straggler_host": "b",
            "ratio": 1.5,
        },
        {"kind": "event", "event": "stopped", "step": 6, "reason": "non-finite gradient norm (nan) at step 7"},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    rc, out, err = ddptrain(capsys, "report", str(tmp_path))
    assert rc == 0, err
    assert "status: stopped at step 6: non-finite gradient norm (nan) at step 7" in out
    assert "MFU: 35.0% mean" in out  # (0.30 + 0.40) / 2: the first window is left out
    assert "step      4  resume: attempt 2 resumed from step 4 at world size 2" in out
    assert "stragglers: flagged in 1 of 2 checks (rank 1 on b)" in out
    assert "exposed_comm 20.0 ms" in out
    assert_valid_pngs(tmp_path / "report")
