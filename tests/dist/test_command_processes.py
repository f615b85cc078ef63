"""The CLI as a shell sees it, one real `python -m ddptrain` process per case: its exit code and its whole
stderr. The in-process checks of the same refusals are in tests/unit (test_store_errors.py,
test_usage_errors.py, test_torch_support.py); these prove nothing else reaches the terminal.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddptrain.dist import BIND_ADDR_ENV

pytestmark = pytest.mark.dist

# The variables torchrun's agent sets: a hand-set environment has none of them.
AGENT_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", BIND_ADDR_ENV, "LOCAL_WORLD_SIZE")


def test_an_unreachable_store_is_one_line_and_exit_2(closed_port: int, tmp_path: Path) -> None:
    """The reported case as a shell sees it: torch's client would log ~80 lines of C++ frames."""
    env = {k: v for k, v in os.environ.items() if k not in AGENT_VARS}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(closed_port), RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")
    argv = [sys.executable, "-m", "ddptrain", "train", f"run.dir={tmp_path / 'run'}", "dist.startup_timeout_s=1"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc
    assert proc.stderr == (
        f"[rank 1] ddptrain train: error: rank 1 cannot reach the job's store at 127.0.0.1:{closed_port} "
        "(MASTER_ADDR:MASTER_PORT) within 1 s (connection refused: nothing listens there); is rank 0 (or the "
        "launcher on that host) running, and is the port open from here?\n"
    )


def test_a_bad_launch_argument_is_one_line_and_exit_2() -> None:
    """As a shell sees it: the process's exit code and its whole stderr."""
    argv = [sys.executable, "-m", "ddptrain", "launch", "--nnodes", "2", "--max-restarts", "abc", "--", "train"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": ""})
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr == (
        "ddptrain launch: error: argument --max-restarts: invalid int value: 'abc' (see ddptrain launch --help)\n"
    )


def test_launch_with_an_unsupported_torch_exits_2_with_one_line(tmp_path: Path) -> None:
    """The real CLI, in a process whose torch reports an older version."""
    code = (
        "import sys, torch; torch.__version__ = '2.4.1'; from ddptrain.cli import main; "
        "sys.exit(main(['launch', '--', 'train']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    lines = [line for line in proc.stderr.splitlines() if "ddptrain launch" in line or "Traceback" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "torch 2.4.1 is not supported" in lines[0], proc.stderr
    assert torch.__version__ != "2.4.1"
