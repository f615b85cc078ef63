"""What the checkpoint formats share: CPU snapshots, concurrent durable writes and every rank's local files."""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ddptrain.checkpoint.durable import write_durable
from ddptrain.checkpoint.formats.base import LOCAL_KEYS, OPTIONAL_LOCAL_KEYS, ReadableCheckpoint
from ddptrain.checkpoint.manifest import FileEntry


def map_tree(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """A copy of obj's dicts, lists and tuples with leaf() applied to everything else. Dicts keep their type and
    attributes (a state_dict is an OrderedDict with _metadata)."""
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = map_tree(v, leaf)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(map_tree(v, leaf) for v in obj)
    return leaf(obj)


def to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU: the snapshot an async save writes from."""
    return map_tree(obj, lambda o: o.detach().to("cpu", copy=True) if isinstance(o, torch.Tensor) else o)


def write_all(folder: Path, items: dict[str, Any], algorithm: str) -> dict[str, FileEntry]:
    """write_durable each (name, object) into folder, one thread per file, hashed with algorithm.

    While one thread serializes (holding the GIL), another's hashing, copies and fsync run
    without it, so the files' costs overlap.
    """
    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        futures = {name: pool.submit(write_durable, folder / name, obj, algorithm) for name, obj in items.items()}
        return {name: f.result() for name, f in futures.items()}


def local_files(rank: int, local: dict[str, Any]) -> dict[str, Any]:
    """The file names of a rank's local objects: `<key>-rank<r>.pt`."""
    return {f"{k}-rank{rank}.pt": v for k, v in local.items()}


def local_required(world_size: int) -> set[str]:
    """One `<key>-rank<r>.pt` per local key and saved rank."""
    return {f"{k}-rank{r}.pt" for k in LOCAL_KEYS for r in range(world_size)}


def read_local(ckpt: ReadableCheckpoint, rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's local objects (the optional ones it holds too); None when the checkpoint was saved at another
    world size."""
    if ckpt.manifest.world_size != world_size:
        return None
    keys = [*LOCAL_KEYS, *(k for k in OPTIONAL_LOCAL_KEYS if f"{k}-rank{rank}.pt" in ckpt.manifest.files)]
    return {k: ckpt.load(f"{k}-rank{rank}.pt") for k in keys}
