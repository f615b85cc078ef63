"""`ddptrain verify-resume`: a real 2-rank run, replayed from its checkpoint at the same world size
(bit-identical), at another world size (same samples, losses within tolerance), against a tampered
certificate (the first differing step and tensor are named), and bad input (exit 2, one line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import folder_bytes, run_ddptrain

from ddptrain.checkpoint.lease import RunLease, read_owner
from ddptrain.run_folder import LEASE

pytestmark = pytest.mark.dist

ARGS = [
    "model.target=toy:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=8",
    "train.global_batch_size=32",
    "train.max_steps=40",
    "train.eval_every=0",
    "ckpt.every_steps=20",
    "log.every_steps=5",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("verify") / "run"
    proc = run_ddptrain(["train", *ARGS, f"run.dir={run_dir}"], nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


@pytest.mark.timeout(300)
def test_replay_at_the_same_world_size_is_bit_identical(trained: Path) -> None:
    proc = run_ddptrain(["verify-resume", str(trained), "--from", "20", "--steps", "10"], nproc=2, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replayed steps 21..30 from" in proc.stdout and "at world size 2" in proc.stdout
    # The checkpoint is named by its path, not by a repr of its contents (once 3.6 KB on one line).
    assert "step-00000020 (saved at world size 2)" in proc.stdout and "VerifiedCheckpoint(" not in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) < 500, proc.stdout
    assert (
        "identical: logged steps 25, 30: sample ids, 4 parameter and 12 optimizer-state digests and losses are "
        "bit-identical" in proc.stdout
    ), proc.stdout
    # The run's records hold every committed step's samples once (8 windows of 5 steps x 32 samples).
    assert "samples: the run's 8 logged steps hold the samples of steps 1..40 exactly once each (1280 samples" in (
        proc.stdout
    )
    print(proc.stdout)


@pytest.mark.timeout(300)
def test_a_refused_resume_leaves_the_run_verifiable(trained: Path) -> None:
    before = folder_bytes(trained)
    refused = run_ddptrain(["train", *ARGS, f"run.dir={trained}", "train.global_batch_size=64"], timeout=120)
    assert refused.returncode == 2 and "train.global_batch_size (32 -> 64)" in refused.stderr, refused.stderr
    assert folder_bytes(trained) == before  # config.yaml included: it still describes the checkpoints
    proc = run_ddptrain(["verify-resume", str(trained), "--from", "20", "--steps", "5"], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_replay_at_another_world_size_has_the_same_samples_and_close_losses(trained: Path) -> None:
    proc = run_ddptrain(["verify-resume", str(trained), "--steps", "15"], timeout=240)  # newest checkpoint: step 20
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replayed steps 21..35" in proc.stdout and "at world size 1" in proc.stdout
    assert "consistent (world size 2 -> 1): logged steps 25, 30, 35: same sample ids; losses within" in proc.stdout
    print(proc.stdout)


@pytest.mark.timeout(300)
def test_a_certificate_that_does_not_match_names_the_first_step_and_tensor(trained: Path, tmp_path: Path) -> None:
    lines = (trained / "certificate.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    at30 = next(r for r in records if r["step"] == 30)
    name = sorted(k for k in at30["digest"] if k.startswith("optim:"))[0]
    at30["digest"][name][1] ^= 8  # one bit of the exact digest: what a resume that lost a bit of optimizer state logs
    original = (trained / "certificate.jsonl").read_text()
    try:
        (trained / "certificate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        proc = run_ddptrain(["verify-resume", str(trained), "--from", "20", "--steps", "10"], nproc=2, timeout=240)
    finally:
        (trained / "certificate.jsonl").write_text(original)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"differs: first at step 30: tensor {name}: logged [sum, digest]" in proc.stdout, proc.stdout


@pytest.mark.timeout(300)
def test_a_replay_leases_its_scratch_folder_and_leaves_the_runs_lease_alone(trained: Path) -> None:
    run_lease = RunLease(trained).acquire()  # the run is still training (another job holds its folder)
    try:
        proc = run_ddptrain(["verify-resume", str(trained), "--from", "20", "--steps", "5"], timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "consistent (world size 2 -> 1): logged steps 25:" in proc.stdout, proc.stdout
        owner = read_owner(trained / LEASE)
        assert owner is not None and owner.token == run_lease.owner.token  # untouched by the replay
        scratch = trained / "verify-resume" / "from-20"
        assert not (scratch / LEASE).exists()  # the replay released its own lease
        scratch_lease = RunLease(scratch).acquire()  # another replay of the same checkpoint is running
        try:
            proc = run_ddptrain(["verify-resume", str(trained), "--from", "20", "--steps", "5"], timeout=120)
        finally:
            scratch_lease.release()
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "is in use by another run" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    finally:
        run_lease.release()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--from", "7"], "no checkpoint for step 7 in"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
@pytest.mark.timeout(120)
def test_bad_input_is_exit_2_with_one_line(trained: Path, args: list[str], expected: str) -> None:
    proc = run_ddptrain(["verify-resume", str(trained), *args], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.timeout(120)
def test_a_run_without_a_certificate_is_exit_2(tmp_path: Path) -> None:
    proc = run_ddptrain(["verify-resume", str(tmp_path)], timeout=60)
    assert proc.returncode == 2 and "certificate.jsonl not found" in proc.stderr, proc.stderr


@pytest.mark.timeout(240)
def test_a_run_trained_without_the_certificate_is_exit_2_saying_so(tmp_path: Path) -> None:
    """log.certificate=false: no digest and no certificate.jsonl; verify-resume refuses the run in one line and
    leaves its folder as it was."""
    run_dir = tmp_path / "run"
    args = [*ARGS, "train.max_steps=10", "ckpt.every_steps=5", "log.certificate=false", f"run.dir={run_dir}"]
    trained = run_ddptrain(["train", *args], timeout=180)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert not (run_dir / "certificate.jsonl").exists()
    before = folder_bytes(run_dir)
    proc = run_ddptrain(["verify-resume", str(run_dir)], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "trained with log.certificate=false" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert folder_bytes(run_dir) == before
