"""Sending verified file contents from a rank that read them to a rank of another node, in bounded chunks.

A content (what a format's decode() returned: bytes, or dicts and lists holding tensors) travels as
a small description (its structure with every tensor and bytes object replaced by a Slot, and each
one's dtype and shape) and then its buffers' raw bytes, sent point to point (gloo send/recv) from a
reader to each rank that needs it. Receivers allocate every buffer once, at its final size, and the
bytes land in it: a buffer of CHUNK bytes or more is received straight into its memory, slice by
slice; smaller ones travel packed together into one CHUNK-sized staging buffer. So a rank holds the
state once, plus at most one CHUNK in flight.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CHUNK = 16 << 20
Buffer = torch.Tensor | bytes | bytearray


@dataclass(frozen=True)
class Slot:
    """Where buffer `index` of a content goes back."""

    index: int


def flatten(content: Any) -> tuple[Any, list[Buffer]]:
    """(content with each CPU tensor and bytes object replaced by a Slot, those buffers in order).

    Dicts keep their type and attributes; anything else stays in the structure (pickled with it).
    """
    buffers: list[Buffer] = []

    def walk(o: Any) -> Any:
        if isinstance(o, bytes) or (type(o) is torch.Tensor and o.device.type == "cpu" and o.is_contiguous()):
            buffers.append(o)
            return Slot(len(buffers) - 1)
        if isinstance(o, dict):
            out = copy.copy(o)
            for k, v in o.items():
                out[k] = walk(v)
            return out
        if type(o) in (list, tuple):
            return type(o)(walk(v) for v in o)
        return o

    return walk(content), buffers


def describe(buffers: list[Buffer]) -> list[tuple[str, list[int]]]:
    """Each buffer's (dtype, shape); ("bytes", [length]) for bytes."""
    return [(str(b.dtype), list(b.shape)) if isinstance(b, torch.Tensor) else ("bytes", [len(b)]) for b in buffers]


def allocate(specs: list[tuple[str, list[int]]]) -> list[Buffer]:
    """Empty buffers to receive into, as describe() described them."""
    dtypes = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return [
        bytearray(shape[0]) if dtype == "bytes" else torch.empty(shape, dtype=dtypes[dtype]) for dtype, shape in specs
    ]


def rebuild(structure: Any, buffers: list[Buffer]) -> Any:
    """The content again: each Slot replaced by its buffer (a received bytearray becomes bytes)."""
    if isinstance(structure, Slot):
        b = buffers[structure.index]
        return bytes(b) if isinstance(b, bytearray) else b
    if isinstance(structure, dict):
        out = copy.copy(structure)
        for k, v in structure.items():
            out[k] = rebuild(v, buffers)
        return out
    if type(structure) in (list, tuple):
        return type(structure)(rebuild(v, buffers) for v in structure)
    return structure


def _raw(b: Buffer) -> torch.Tensor:
    """The bytes of a buffer as a flat uint8 tensor sharing its memory."""
    if isinstance(b, torch.Tensor):
        return b.reshape(-1).view(torch.uint8)
    if len(b) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a sender's bytes are only read (the broadcast's source)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(b, dtype=torch.uint8)


def _pieces(views: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The messages that carry these buffers: a slice of at most CHUNK bytes of a big one, or several
    small ones packed together (a list of more than one view); the same on sender and receiver."""
    out: list[list[torch.Tensor]] = []
    pending: list[torch.Tensor] = []  # small buffers waiting to travel together
    packed = 0
    for view in views:
        n = view.numel()
        if n >= CHUNK or (pending and packed + n > CHUNK):
            if pending:
                out.append(pending)
            pending, packed = [], 0
        if n >= CHUNK:
            out.extend([view[start : start + CHUNK]] for start in range(0, n, CHUNK))
        elif n:
            pending.append(view)
            packed += n
    if pending:
        out.append(pending)
    return out


def send_buffers(buffers: list[Buffer], dst: int, group: dist.ProcessGroup | None) -> None:
    """Send the buffers' bytes to rank dst of group (which runs recv_buffers on buffers of the same sizes)."""
    for piece in _pieces([_raw(b) for b in buffers]):
        dist.send(piece[0] if len(piece) == 1 else torch.cat(piece), group=group, group_dst=dst)


def recv_buffers(buffers: list[Buffer], src: int, group: dist.ProcessGroup | None) -> None:
    """Receive into the buffers the bytes rank src of group sends with send_buffers."""
    for piece in _pieces([_raw(b) for b in buffers]):
        if len(piece) == 1:  # nothing packed with it: straight into its memory
            dist.recv(piece[0], group=group, group_src=src)
        else:
            staging = torch.empty(sum(v.numel() for v in piece), dtype=torch.uint8)
            dist.recv(staging, group=group, group_src=src)
            _unpack(staging, piece)


def _unpack(staging: torch.Tensor, views: list[torch.Tensor]) -> None:
    """Copy a received staging buffer's bytes out into the views it packs, in order."""
    offset = 0
    for v in views:
        v.copy_(staging[offset : offset + v.numel()])
        offset += v.numel()
