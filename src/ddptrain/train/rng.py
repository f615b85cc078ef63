"""Seeding and capturing every random stream (Python, NumPy, torch CPU and CUDA) of a rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) from one integer."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """This process's RNG states, in types torch.load(weights_only=True) accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert not isinstance(keys, str)  # the legacy form: (name, uint32 key array, ...)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def load_rng_state(state: dict[str, Any]) -> None:
    """Restore the streams captured by rng_state()."""
    random.setstate(tuple(state["python"][0:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
