"""Under torchrun (gloo): a straggler made on purpose is named; doctor passes with 2 ranks and fails
fast, with a clear verdict, when the rendezvous endpoint cannot be reached."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers import read_metrics, run_ddptrain

pytestmark = pytest.mark.dist


@pytest.mark.timeout(180)
def test_straggler_is_named_in_the_warning_the_metrics_and_its_own_log(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = [
        "train",
        "model.target=observe_toy:build_slow_model",
        "model.kwargs={slow_rank: 1, sleep_s: 0.04}",
        "data.target=toy:build_datasets",
        "data.micro_batch_size=4",
        "train.global_batch_size=16",
        "train.max_steps=16",
        "train.eval_every=0",
        "ckpt.every_steps=0",
        "log.every_steps=2",
        "log.straggler_every=4",
        "log.straggler_window=4",
        f"run.dir={run_dir}",
    ]
    proc = run_ddptrain(args, nproc=2, timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    host = socket.gethostname()
    checks = read_metrics(run_dir, "ranks")
    assert [c["step"] for c in checks] == [4, 8, 12, 16]
    for c in checks:
        assert c["hosts"] == [host, host] and len(c["local_step_s"]) == 2
    named = [c.get("straggler_rank") for c in checks]
    # The window is full at step 4: a first strike is never named; a later check confirms it. Which check
    # confirms it depends on the machine's load (rank 0 may be slowed too), so only the order is asserted.
    assert named[0] is None and 1 in named and set(named) <= {None, 1}, checks
    first = checks[named.index(1)]
    assert first["straggler_host"] == host and first["ratios"][1] > 1.15  # named above log.straggler_factor
    step = first["step"]
    assert f"warning: straggler at step {step}: rank 1 on {host} computes" in proc.stderr  # a warning: stderr
    assert proc.stderr.count("warning: straggler") == 1  # warned once for the episode
    train = read_metrics(run_dir)
    # grad accumulation 2: rank 0 waits for rank 1 in the all-reduce of the last micro-batch
    assert all(r["exposed_comm_s"] > 0 for r in train)
    assert all(r["comm_wait_s"] >= 0 for r in train)  # the comm hook measured the last backward's wait
    assert (
        f"rank 1 WARNING ddptrain.observe.stragglers: straggler at step {step}"
        in (run_dir / "logs" / "rank-1.log").read_text()
    )
    assert "rank 1 of 2" in (run_dir / "logs" / "rank-1.log").read_text()


@pytest.mark.timeout(180)
def test_doctor_with_two_ranks_passes_and_reports_bus_bandwidth(tmp_path: Path) -> None:
    proc = run_ddptrain(
        ["doctor", "--max-mb", "0.25", "--timeout", "60", "--params", "1e5", "--step-s", "1000"], nproc=2, timeout=150
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for check in ("launch env", "backend", "device", "interface", "rendezvous", "versions", "all-reduce", "bandwidth"):
        assert f"PASS  {check}" in out, check
    assert "verdict: PASS" in out and "all 2 ranks joined" in out
    # The advice for a small model with much compute per step: the link is not its bottleneck.
    assert "link advice for 0.1M parameters (0.3815 MiB of fp32 gradients), 1000 s of compute per step:" in out
    assert "choose: synchronous, fp32 gradients every step (the default): the link adds <= 10%" in out
    rows = [line.split() for line in out.splitlines() if line.strip().endswith(tuple("0123456789")) and "KiB" in line]
    assert [r[0] + " " + r[1] for r in rows] == ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB"]
    for size, _unit, _iters, us, algbw, busbw in rows:
        # 2 ranks: busbw = algbw * 2 * (2 - 1) / 2 = algbw; algbw = bytes / time
        assert float(busbw) == pytest.approx(float(algbw), abs=0.0011)
        assert float(algbw) == pytest.approx(float(size) * 1024 / (float(us) * 1e-6) / 1e9, rel=0.02, abs=0.0011)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("rank", "expected"),
    [
        (1, "cannot reach the rendezvous store at 127.0.0.1:{port} within 3s (connection refused"),
        (0, "did not all join within 3s (rank 0 hosts the store on port {port})"),
    ],
)
@pytest.mark.timeout(90)
def test_doctor_fails_fast_on_an_unreachable_rendezvous(rank: int, expected: str) -> None:
    port = _closed_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2"}
    proc = run_ddptrain(["doctor", "--timeout", "3"], env={**env, "LOCAL_RANK": str(rank)}, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "FAIL  rendezvous" in out and expected.format(port=port) in out
    # "within 3s" above is doctor's own bound; timeout=60 fails the test if it waited for torch's 30 min default.
    assert out.rstrip().endswith("verdict: FAIL (rendezvous)") and "Traceback" not in out
