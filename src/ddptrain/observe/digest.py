"""One definition of "the same state": an exact integer digest of every parameter and optimizer-state tensor.

Each tensor's bytes are read as 32-bit words (bytes when its size is not a multiple of 4) and
summed with odd position-dependent multipliers in int64 arithmetic, which wraps modulo 2**64:

    digest(t) = sum_i w_i * m_(i mod CHUNK) * c_(i div CHUNK)   (mod 2**64; m and c odd)

Integer sums do not depend on the order of addition, so the digest is the same on any device, any
reduction order and any thread count. A flipped bit k of word i changes the digest by
+-2**k * m * c, with m * c odd and k < 32: never a multiple of 2**64, so any single bit flip in any
tensor changes that tensor's digest (tests/unit/test_replicas.py checks it on random states).
Everything runs on the tensors' device; only the digests (one int64 each) are ever read back.
The replica check (train/replicas.py) and the resume certificate (certificate.py, read by
`ddptrain verify-resume`) both digest state here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

CHUNK = 1 << 20  # words per multiplier table: bounds the int64 temporaries to 8 MB per chunk
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_tables: dict[torch.device, torch.Tensor] = {}


def _odd_mix(x: torch.Tensor) -> torch.Tensor:
    """Pseudo-random odd int64 numbers from positions (a multiply and an xor-shift, wrapping)."""
    x = x * _GOLDEN
    return (x ^ (x >> 29)) | 1


def _table(device: torch.device) -> torch.Tensor:
    if device not in _tables:
        _tables[device] = _odd_mix(torch.arange(CHUNK, dtype=torch.int64, device=device))
    return _tables[device]


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat int32 (or, for sizes not a multiple of 4, uint8) tensor: a view, no copy."""
    local = t.to_local() if isinstance(t, DTensor) else t  # a shard: its own bytes
    flat = local.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if (flat.numel() * flat.element_size()) % 4 == 0:
        try:
            return flat.view(torch.int32)
        except RuntimeError:  # a storage offset that is not 4-byte aligned
            return flat.view(torch.uint8)
    return flat.view(torch.uint8)


def tensor_digest(t: torch.Tensor) -> torch.Tensor:
    """The exact digest of one tensor's bytes: an int64 scalar on the tensor's device."""
    words = _words(t)
    table = _table(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for chunk, start in enumerate(range(0, words.numel(), CHUNK)):
        part = words[start : start + CHUNK]
        partial = (part * table[: part.numel()]).sum()  # int32 x int64 -> int64, wrapping
        total += partial * _chunk_weight(chunk)
    return total


def _chunk_weight(chunk: int) -> int:
    """An odd int64 (as a Python int: no tensor, no read from the device) for the chunk's position."""
    x = (chunk * 0x9E3779B97F4A7C15) % 2**64 | 1
    return x - 2**64 if x >= 2**63 else x


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Every parameter ("param:NAME") and optimizer-state tensor ("optim:NAME.KEY"), in a fixed order."""
    out: list[tuple[str, torch.Tensor]] = [(f"param:{n}", p) for n, p in model.named_parameters()]
    by_id = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in sorted(optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"optim:{by_id.get(id(p), '?')}.{key}", value))
    return out


def state_digests(tensors: list[tuple[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """Every tensor's digest, stacked on `device` (int64, one per tensor, in order)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.int64, device=device)
    return torch.stack([tensor_digest(t).to(device) for _, t in tensors])


def combine(digests: torch.Tensor) -> torch.Tensor:
    """One int64 for a stack of digests (each weighted by an odd number of its position): a changed one changes it."""
    weights = _odd_mix(torch.arange(1, digests.numel() + 1, dtype=torch.int64, device=digests.device))
    return (digests * weights).sum().reshape(1)
