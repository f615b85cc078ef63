"""On 2 local ranks (gloo): hangs are caught by the calibrated watchdog in about 3 x p99 step time plus a
margin (long before dist.timeout_s; the time itself is printed, not asserted), and `ddptrain triage` names the right rank and place for each
injected fault: a SIGSTOPped rank, a rank sleeping inside forward, a rank that skips a collective,
a rank blocked on I/O. The detection figures are printed (pytest -s shows them)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import run_ddptrain, start_ddptrain

pytestmark = pytest.mark.dist

MARGIN_S = 2.0
TIMEOUT_S = 120.0  # the collective timeout the watchdog must beat by far
HANG_STEP = 40


def _args(run_dir: Path, model_kwargs: str, data: list[str] | None = None) -> list[str]:
    return [
        "model.target=faulty:build_model",
        f"model.kwargs={model_kwargs}",
        *(data or ["data.target=toy:build_datasets", "data.kwargs={n: 4096}"]),
        "data.micro_batch_size=8",
        "train.global_batch_size=16",
        "train.max_steps=400",
        "train.eval_every=0",
        "ckpt.every_steps=0",
        "log.every_steps=5",
        "log.straggler_every=0",
        f"dist.timeout_s={TIMEOUT_S}",
        f"dist.watchdog_margin_s={MARGIN_S}",
        "dist.watchdog_warmup_steps=10",
        f"run.dir={run_dir}",
    ]


def _start(args: list[str]) -> Any:
    """`ddptrain train ARGS` on 2 local ranks (through `ddptrain launch`), its output on one text pipe."""
    return start_ddptrain(["train", *args], nproc=2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: Any, timeout: float = 150) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return out


def _reports(run_dir: Path) -> dict[int, dict]:
    return {
        int(json.loads(p.read_text())["rank"]): json.loads(p.read_text())
        for p in (run_dir / "stacks").glob("rank-*.json")
        if not p.name.endswith(".observed.json")
    }


def _check_timing(run_dir: Path, hang_started: float, what: str) -> None:
    reports = _reports(run_dir)
    assert reports, f"no rank reported the hang ({what})"
    first = min(reports.values(), key=lambda r: r["time"])
    p99 = float(re.search(r"p99 ([0-9.]+) s", first["derivation"]).group(1))  # type: ignore[union-attr]
    detected = first["time"] - hang_started
    print(
        f"\n{what}: detected {detected:.2f} s after the hang began; budget {first['budget_s']:.2f} s "
        f"({first['derivation']}); collective timeout {TIMEOUT_S:g} s"
    )
    assert first["budget_s"] <= 3 * p99 + MARGIN_S + 0.01  # p99 is printed to the millisecond
    # The figure against its budget is a measurement (printed above, in docs/observability.md), not a
    # gate: a loaded machine may add seconds. What must hold anywhere: the watchdog, not the collective
    # timeout, ended the hang (its report came before that timeout would have ended it).
    assert detected < TIMEOUT_S


def _triage(run_dir: Path) -> str:
    proc = run_ddptrain(["triage", str(run_dir)], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    return proc.stdout


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return max((json.loads(x)["step"] for x in lines if x.endswith("}") and '"kind": "train"' in x), default=0)


def _pid(run_dir: Path, rank: int) -> int:
    text = (run_dir / "logs" / f"rank-{rank}.log").read_text()
    return int(re.search(rf"rank {rank} of 2 on \S+, pid (\d+)", text).group(1))  # type: ignore[union-attr]


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # not yet a zombie
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.timeout(240)
def test_a_sigstopped_rank_is_caught_in_seconds_and_named_stopped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(_args(run_dir, "{step_sleep: 0.01}"))
    pid = None
    try:
        deadline = time.monotonic() + 120
        while _last_step(run_dir) < HANG_STEP and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pid, pid0 = _pid(run_dir, 1), _pid(run_dir, 0)
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        # Rank 0 catches the hang, observes the stopped rank and leaves; the agent would then wait out its
        # shutdown timeout (30 s) for the stopped rank before killing it: the test kills it once rank 0 is out.
        while _running(pid0) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        out = _finish(proc)
    finally:
        if pid is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    assert proc.returncode != 0 and "error: hang: rank 0" in out, out
    _check_timing(run_dir, stopped_at, "SIGSTOP of rank 1")
    verdict = _triage(run_dir)
    host = socket.gethostname()
    assert f"verdict: rank 1 on {host} wrote no report: its process {pid} is stopped (state T" in verdict


@pytest.mark.timeout(240)
def test_a_rank_sleeping_in_forward_is_named_with_its_line(tmp_path: Path) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "hang-began"
    proc = _start(_args(run_dir, f"{{hang_at: {HANG_STEP}, hang_rank: 1, hang_s: 100, hang_marker: '{marker}'}}"))
    out = _finish(proc)
    assert proc.returncode != 0 and "error: hang: rank 1" in out, out
    _check_timing(run_dir, float(marker.read_text()), "rank 1 sleeping in forward")
    verdict = _triage(run_dir)
    host = socket.gethostname()
    assert re.search(
        rf"verdict: rank 1 on {host} never entered collective #\d+ \(gloo:all_reduce on group train\), "
        rf"which rank 0 on {host} waits in",
        verdict,
    ), verdict
    assert re.search(
        rf"rank 1 on {host} is in .*FaultyRegressor.forward, at tests/faulty.py:\d+ in "
        r"FaultyRegressor.forward",
        verdict,
    ), verdict
    assert re.search(r"rank 0 on \S+: in backward", verdict), verdict


@pytest.mark.timeout(240)
def test_a_rank_that_skips_a_collective_is_named_with_the_one_it_skipped(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(_args(run_dir, f"{{sync_stat: true, skip_at: {HANG_STEP}, skip_rank: 1}}"))
    out = _finish(proc)
    assert proc.returncode != 0 and "error: hang" in out, out
    verdict = _triage(run_dir)
    host = socket.gethostname()
    assert re.search(
        rf"verdict: rank 1 on {host} never entered collective #\d+ \(gloo:all_reduce on group "
        rf"default\), which rank 0 on {host} waits in",
        verdict,
    ), verdict
    assert re.search(r"it skipped #\d+ and went on to collective #\d+ \(gloo:all_reduce on group train\)", verdict)
    assert re.search(r"rank 0 on \S+: in FaultyRegressor.forward > collective all_reduce", verdict), verdict


@pytest.mark.timeout(240)
def test_a_rank_blocked_on_io_in_the_dataloader_is_named(tmp_path: Path) -> None:
    run_dir, fifo = tmp_path / "run", tmp_path / "never-written.fifo"
    data = [
        "data.target=faulty:build_blocking_datasets",
        f"data.kwargs={{fifo: '{fifo}', block_rank: 1, block_after: {HANG_STEP * 8}}}",
    ]
    proc = _start(_args(run_dir, "{}", data))
    out = _finish(proc)
    assert proc.returncode != 0 and "error: hang" in out, out
    verdict = _triage(run_dir)
    host = socket.gethostname()
    assert re.search(
        rf"verdict: rank 1 on {host} never entered collective #\d+ \(gloo:all_reduce on group train\)", verdict
    ), verdict
    assert re.search(
        rf"rank 1 on {host} is in the DataLoader's __next__, at tests/faulty.py:\d+ in "
        r"BlockingDataset.__getitem__",
        verdict,
    ), verdict
