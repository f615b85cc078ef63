"""Exit codes are a contract: bad input exits 2 under every launcher, every time, with no restarts.

Also: ranks handed different data stop before the first step (exit 2, naming hosts and what
differs), and a few generated configs train for real or exit 2 in one line.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers import TESTS_DIR, TINY, env_for_subprocess, prepare_tiny_corpus, run_ddptrain
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddptrain.cli import main

pytestmark = pytest.mark.dist


def launch(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m ddptrain launch ARGS` (forked from the test zygote, as run_ddptrain's commands are)."""
    return run_ddptrain(["launch", *args], timeout=timeout)


@pytest.mark.timeout(300)
def test_launch_with_a_bad_config_exits_2_four_times_out_of_four() -> None:
    argv = ["--nproc-per-node", "2", "--rdzv-timeout", "20", "--", "train", "train.bogus=1"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: launch(argv), range(4)))
    codes = [r.returncode for r in results]
    assert codes == [2] * 4, [(r.returncode, r.stderr[-500:]) for r in results if r.returncode != 2]
    for r in results:
        assert r.stderr.strip() == "ddptrain launch: error: invalid config: unknown key 'train.bogus'"


@pytest.mark.timeout(300)
def test_workers_exiting_2_end_the_launch_with_2_and_no_restart(tmp_path: Path) -> None:
    """Bad input only the workers can see (a missing corpus): one rank exits 2, the agent stops the
    other; whatever that one exits with, the job exits 2 and says nothing about restarts."""
    argv = [
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "3",
        "--shutdown-timeout",
        "5",
        "--",
        "train",
        *TINY,
        f"data.dir={tmp_path / 'absent'}",
        f"run.dir={tmp_path / 'run'}",
    ]
    for attempt in range(2):
        r = launch(argv)
        assert r.returncode == 2, (attempt, r.stderr[-2000:])
        assert "no prepared corpus in" in r.stderr and "Traceback" not in r.stderr
        assert "restart(s)" not in r.stderr and "bad input (a worker exited 2; not restarted)" in r.stderr
        # One line per event: none of torchelastic's per-process W/E log lines beside the launcher's.
        assert not re.search(r"^[WE]\d{4} \d\d:\d\d:\d\d", r.stderr, re.MULTILINE), r.stderr[-2000:]


@pytest.mark.timeout(180)
def test_ranks_with_different_data_stop_before_the_first_step(corpus_dir: Path, tmp_path: Path) -> None:
    other = prepare_tiny_corpus_variant(tmp_path / "other")
    run_dir = tmp_path / "run"
    script = [str(TESTS_DIR / "per_rank_data.py"), "train", *TINY, f"run.dir={run_dir}"]
    r = run_ddptrain(script, nproc=2, launcher="launch", timeout=150, env={"DATA_DIRS": f"{corpus_dir}:{other}"})
    errors = [line for line in r.stderr.splitlines() if "ddptrain train: error:" in line]
    assert len(errors) == 2, r.stderr[-3000:]  # every rank, one line each
    for line in errors:
        assert "ranks see different training data" in line and "sha256" in line and "train_tokens" in line
        assert "on rank 0 (" in line and "on rank 1 (" in line  # the hosts
    assert r.returncode == 2, r.stderr[-3000:]  # `ddptrain launch` exits with its workers' 2
    metrics = run_dir / "metrics.jsonl"
    assert not metrics.exists() or '"kind": "train"' not in metrics.read_text()  # no step was taken


@pytest.mark.timeout(180)
def test_ranks_given_different_shard_bytes_under_one_meta_json_stop_before_the_first_step(
    corpus_dir: Path, tmp_path: Path
) -> None:
    """Before: the identity check compared meta.json only, and both ranks trained (exit 0) on different data."""
    other = Path(shutil.copytree(corpus_dir, tmp_path / "same-meta"))
    shard = other / "train-00000.bin"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 0x20  # same size, same meta.json, one byte different
    shard.write_bytes(bytes(data))
    run_dir = tmp_path / "run"
    script = [str(TESTS_DIR / "per_rank_data.py"), "train", *TINY, f"run.dir={run_dir}"]
    r = run_ddptrain(script, nproc=2, launcher="launch", timeout=150, env={"DATA_DIRS": f"{corpus_dir}:{other}"})
    errors = [line for line in r.stderr.splitlines() if "ddptrain train: error:" in line]
    assert len(errors) == 2, r.stderr[-3000:]  # every rank, one line each, naming the rank, host and shard
    for line in errors:
        assert "rank 1 (" in line and f"{shard}: its bytes do not match meta.json" in line, line
    assert r.returncode == 2, r.stderr[-3000:]  # `ddptrain launch` exits with its workers' 2
    assert not (run_dir / "metrics.jsonl").exists() or '"kind": "train"' not in (run_dir / "metrics.jsonl").read_text()


@pytest.mark.timeout(180)
def test_a_bad_meta_json_under_launch_is_one_attempt_and_exit_2(corpus_dir: Path, tmp_path: Path) -> None:
    """Before: vocab_size 10**12 was a traceback (exit 1), and `--max-restarts 2` ran the job three times."""
    bad = Path(shutil.copytree(corpus_dir, tmp_path / "bad"))
    meta = json.loads((bad / "meta.json").read_text())
    (bad / "meta.json").write_text(json.dumps({**meta, "vocab_size": 10**12}))
    r = launch(
        [
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "2",
            "--shutdown-timeout",
            "5",
            "--",
            "train",
            *TINY,
            f"data.dir={bad}",
            f"run.dir={tmp_path / 'run'}",
        ]
    )
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if "ddptrain train: error:" in line]
    assert len(errors) == 1 and "vocab_size: Input should be less than or equal to 16777216" in errors[0], r.stderr
    assert "restart(s)" not in r.stderr and "bad input (a worker exited 2; not restarted)" in r.stderr
    assert "Traceback" not in r.stderr


def prepare_tiny_corpus_variant(out: Path) -> Path:
    """A corpus like the tiny one from other files (other bytes and size)."""
    import sysconfig

    from ddptrain.data.corpus import prepare_corpus

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prepare_corpus([stdlib / name for name in ("typing.py", "inspect.py", "dataclasses.py")], out, val_fraction=0.1)
    return out


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return prepare_tiny_corpus(tmp_path_factory.mktemp("corpus"))


# Keys that change what a short run does, with values good and bad.
TRAINING_OVERRIDES = st.sampled_from(
    [
        "train.lr=0.01",
        "train.lr=.inf",
        "train.lr=-1",
        "train.betas=[0.5, 0.6]",
        "train.betas=[1, 1]",
        "train.warmup_steps=0",
        "train.warmup_steps=true",
        "train.grad_clip=0",
        "train.grad_clip=.nan",
        "data.micro_batch_size=2",
        "data.micro_batch_size=3",
        "train.global_batch_size=4",
        "train.global_batch_size=6",
        "train.precision=bf16",
        "train.precision=fp8",
        "model.dropout=0.2",
        "model.dropout=1.5",
        "run.seed=0",
        "run.seed=4294967296",
        "train.on_nonfinite=stop",
        "model.n_head=4",
        "model.n_head=3",
        "model.vocab_size=128",
        "train.eval_every=1",
        "ckpt.every_steps=1",
        "ckpt.keep=0",
        "train.max_steps=true",
        "ckpt.async=true",
    ]
)


@pytest.mark.timeout(300)
@given(st.lists(TRAINING_OVERRIDES, max_size=4))
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
def test_generated_training_configs_train_or_exit_2_in_one_line(
    tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory, capfd: pytest.CaptureFixture[str], items: list[str]
) -> None:
    run_dir = tmp_path_factory.mktemp("prop")
    rc = main(["train", *TINY, f"data.dir={tiny_corpus}", f"run.dir={run_dir}", *items, "train.max_steps=2"])
    out, err = capfd.readouterr()
    assert rc in (0, 2), (items, rc, err)
    if rc == 2:
        assert re.fullmatch(r"ddptrain train: error: [^\n]+\n", err), (items, err)
    else:
        assert "done: 2 steps" in out, (items, out, err)


@pytest.mark.timeout(300)
@given(st.lists(TRAINING_OVERRIDES, min_size=1, max_size=3))
@settings(
    max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
def test_generated_configs_as_real_commands(
    tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory, items: list[str]
) -> None:
    run_dir = tmp_path_factory.mktemp("prop-cli")
    r = run_ddptrain(["train", *TINY, f"data.dir={tiny_corpus}", f"run.dir={run_dir}", *items, "train.max_steps=2"])
    assert r.returncode in (0, 2), (items, r.returncode, r.stderr[-2000:])
    if r.returncode == 2:
        assert re.fullmatch(r"ddptrain train: error: [^\n]+\n", r.stderr), (items, r.stderr)


@pytest.mark.parametrize("decided", [True, False])
def test_a_process_whose_exit_was_decided_leaves_with_its_code_without_teardown(decided: bool) -> None:
    """cli.exit_with: after leave_without_teardown() (a launcher whose workers stopped on a signal) the process exits
    with the code at once, its output flushed, and runs no teardown (an atexit handler stands for it); otherwise the
    interpreter tears down as usual."""
    script = (
        "import atexit, sys\n"
        "from ddptrain.cli import exit_with\n"
        "from ddptrain.train.preemption import leave_without_teardown\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "print('said before leaving')\n"
        f"{'leave_without_teardown()' if decided else 'pass'}\n"
        "exit_with(75)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env_for_subprocess(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 75, proc.stderr
    assert proc.stdout.splitlines() == (["said before leaving"] if decided else ["said before leaving", "teardown ran"])
