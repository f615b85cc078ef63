"""The test zygote (tests/zygote.py) gives what a fresh `python -m ddptrain` gives: the same output, exit
codes, working directory, environment and module path, killed at its timeout and signalled like a process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_for_subprocess, run_ddptrain, start_ddptrain, use_zygote
from toys import TINY

pytestmark = pytest.mark.dist
zygote_only = pytest.mark.skipif(not use_zygote(), reason="DDPTRAIN_TEST_ZYGOTE=0: the commands start as interpreters")


def fresh(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The same command in a new interpreter."""
    cmd = [sys.executable, "-m", "ddptrain", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env_for_subprocess(env), timeout=60)


@zygote_only
@pytest.mark.timeout(300)
def test_a_forked_command_prints_and_exits_as_a_fresh_interpreter(tmp_path: Path) -> None:
    # A refused config, named relative to the working directory, and a user module found from it (as
    # `python -m` puts the working directory first): the zygote's own directory must not leak in.
    (tmp_path / "mine.py").write_text("import torch\n\ndef model(cfg):\n    return torch.nn.Linear(2, 2)\n")
    for args in (
        ["--help"],
        ["train", *TINY, "data.dir=no-such-corpus", "run.dir=run"],
        ["train", *TINY, "model.name=mine:model", "data.dir=no-such-corpus", "run.dir=run"],
        ["train", "--config", "nowhere.yaml"],
    ):
        expected, got = fresh(args, tmp_path), run_ddptrain(args, cwd=tmp_path)
        assert (got.returncode, got.stdout, got.stderr) == (expected.returncode, expected.stdout, expected.stderr)
    # The environment is the request's: argparse wraps the help at COLUMNS, set for one command only.
    narrow = run_ddptrain(["--help"], env={"COLUMNS": "40"}).stdout
    assert narrow == fresh(["--help"], tmp_path, {"COLUMNS": "40"}).stdout != run_ddptrain(["--help"]).stdout


@zygote_only
@pytest.mark.timeout(120)
def test_a_forked_command_is_killed_at_its_timeout_and_takes_signals(tmp_path: Path, corpus_dir: Path) -> None:
    args = ["train", *TINY, f"data.dir={corpus_dir}", f"run.dir={tmp_path / 'run'}", "train.max_steps=100000"]
    with pytest.raises(subprocess.TimeoutExpired):
        run_ddptrain(args, timeout=3)
    proc = start_ddptrain(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
