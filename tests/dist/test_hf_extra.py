"""Without the hf extra, the commands that need it stop with exit 2 and name it."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

SOURCE = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"


def test_missing_hf_extra_is_exit_2_naming_it(tmp_path: Path) -> None:
    """With transformers unimportable, a BPE prepare stops with exit 2 and names the extra."""
    shadow = tmp_path / "shadow" / "transformers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("not installed")\n')
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddptrain",
            "prepare",
            str(SOURCE),
            "--out",
            str(tmp_path / "out"),
            "--tokenizer",
            "train:300",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path / "shadow")},
    )
    assert r.returncode == 2
    assert r.stderr.strip().endswith("install the optional extra: pip install 'ddptrain[hf]'"), r.stderr
