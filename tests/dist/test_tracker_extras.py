"""A tracker whose package is missing stops `ddptrain train` before anything starts: exit 2, one line
naming the extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import env_for_subprocess

pytestmark = pytest.mark.dist


def test_the_command_exits_2_on_a_missing_tracker_package(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['wandb'] = None; from ddptrain.cli import main; "
        f"sys.exit(main(['train', 'run.dir={tmp_path / 'run'}', 'log.trackers=[wandb]']))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env_for_subprocess()
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pip install 'ddptrain[wandb]'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "run" / "trackers.json").exists()
