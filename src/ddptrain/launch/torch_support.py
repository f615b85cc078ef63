"""The torch versions `ddptrain launch` is tested with.

The launcher passes torchrun options (`--shutdown-timeout`, `--signals-to-handle`) that older
releases lack and overrides private methods of torchelastic's LocalElasticAgent whose names and
signatures change between releases (tests/unit/test_torch_support.py pins them). Outside the
tested range it refuses to start rather than fail half-way through a job on a cluster.
"""

from __future__ import annotations

import re

import torch

from ddptrain.errors import LaunchError

# [lowest, first unsupported): keep in step with pyproject.toml's torch requirement.
SUPPORTED_TORCH = ((2, 13), (2, 14))


def torch_version(text: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as 2.13.0+cpu."""
    m = re.match(r"^(\d+)\.(\d+)", text)
    if not m:
        raise LaunchError(f"cannot read the torch version {text!r}")
    return int(m.group(1)), int(m.group(2))


def check_torch(version: str | None = None) -> None:
    """Exit 2 with one line when the installed torch is outside the tested range."""
    text = version or torch.__version__
    lo, hi = SUPPORTED_TORCH
    if not lo <= torch_version(text) < hi:
        raise LaunchError(
            f"torch {text} is not supported by ddptrain launch (tested: >={lo[0]}.{lo[1]},<{hi[0]}.{hi[1]}); "
            "install a supported torch (docs/install.md)"
        )
