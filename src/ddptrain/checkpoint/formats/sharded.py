"""The `sharded` checkpoint format: every rank writes and hashes its share of the tensors.

DDP keeps the model and optimizer identical on every rank, so the W ranks split the work: the
dense tensors of the shared state, in traversal order, are partitioned by size into P = 2W parts
(greedy, largest first: partition()) and rank r writes parts 2r and 2r+1; rank 0 also writes the
structure, the state with every partitioned tensor replaced by a slot. Files:

    structure.pt              rank 0: torch.save of {tree, slots [(path, id)], count}
    tensors-<p>-of-<P>.bin    rank p // 2: its tensors' raw bytes behind a JSON header (below)
    rng-rank<r>.pt            rank r: its own RNG streams (as in rank0-torch)

A part is b"DDPTPART", the header's length (8 bytes, little-endian), the header
{"part": p, "parts": P, "tensors": [[id, dtype, shape], ...]} and then each tensor's bytes in
that order. Reading allocates every tensor and reads its bytes straight into it while they are
hashed, so a load is one read of each file; a header's sizes must add up to the file's size
before anything is allocated. Any world size reads any partition: at a resume of W ranks the
files are split over the hosts by size (the default load_plan), every rank of a host reads its
host's parts, and each part reaches the other hosts' ranks from a rank that read and verified it
(shared_load.py).
"""

from __future__ import annotations

import copy
import ctypes
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

import torch

from ddptrain.checkpoint.durable import write_stream
from ddptrain.checkpoint.formats.base import SHARED_KEYS, CheckpointFormat, ReadableCheckpoint
from ddptrain.checkpoint.formats.common import local_files, local_required, read_local, to_cpu, write_all
from ddptrain.checkpoint.hashing_reader import HashingReader
from ddptrain.checkpoint.load_plan import partition
from ddptrain.checkpoint.manifest import FileEntry
from ddptrain.errors import CheckpointError

STRUCTURE = "structure.pt"
# Each rank writes its share as two files, a thread each: while one thread hashes, the other
# copies or waits for fsync, and a load hashes them on two threads too (hashlib releases the GIL).
PARTS_PER_RANK = 2
MAGIC = b"DDPTPART"
_MAX_HEADER = 64 << 20
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
Path_ = tuple[Any, ...]


def part_name(part: int, parts: int) -> str:
    """The file of part `part` of `parts`."""
    return f"tensors-{part}-of-{parts}.bin"


def _parts(world_size: int) -> int:
    return world_size * PARTS_PER_RANK


def _my_parts(rank: int) -> range:
    """Rank r writes parts r*K ... r*K+K-1 (K = PARTS_PER_RANK)."""
    return range(rank * PARTS_PER_RANK, (rank + 1) * PARTS_PER_RANK)


def _is_dense(obj: Any) -> bool:
    return (
        type(obj) in (torch.Tensor, torch.nn.Parameter)
        and obj.layout == torch.strided
        and str(obj.dtype).removeprefix("torch.") in _DTYPES
    )


_DESCEND = object()


def _map_tree(obj: Any, leaf: Callable[[Any, Path_], Any]) -> Any:
    """A copy of obj's dicts, lists and tuples with leaf(node, path) in place of each node it replaces.

    leaf returns _DESCEND to keep walking. Dicts keep their type and attributes (a state_dict's _metadata).
    """

    def walk(o: Any, path: Path_) -> Any:
        new = leaf(o, path)
        if new is not _DESCEND:
            return new
        if isinstance(o, dict):
            out = copy.copy(o)
            for k, v in o.items():
                out[k] = walk(v, (*path, k))
            return out
        if type(o) in (list, tuple):
            return type(o)(walk(v, (*path, i)) for i, v in enumerate(o))
        return o

    return walk(obj, ())


def split(obj: Any) -> tuple[Any, list[torch.Tensor], list[tuple[Path_, int]]]:
    """(tree with every dense tensor replaced by None, the tensors in traversal order, their (path, id) slots).

    Any other tensor (sparse, quantized, a subclass) stays in the tree, for torch.save.
    """
    tensors: list[torch.Tensor] = []
    slots: list[tuple[Path_, int]] = []

    def leaf(o: Any, path: Path_) -> Any:
        if not _is_dense(o):
            return _DESCEND
        slots.append((path, len(tensors)))
        tensors.append(o)
        return None

    return _map_tree(obj, leaf), tensors, slots


def join(tree: Any, slots: dict[Path_, int], tensors: dict[int, torch.Tensor]) -> Any:
    """The inverse of split: the tree with each slot's tensor put back."""
    return _map_tree(tree, lambda o, path: tensors[slots[path]] if path in slots else _DESCEND)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable: reads land in the tensor)."""
    n = _nbytes(t)
    if n == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    array.tensor = t  # type: ignore[attr-defined]  # the view keeps the tensor's memory alive
    return memoryview(array).cast("B")


def _write_part(out: IO[bytes], part: int, parts: int, tensors: list[tuple[int, torch.Tensor]]) -> None:
    cpu = [(i, t.detach().to("cpu").contiguous()) for i, t in tensors]
    header = {"part": part, "parts": parts, "tensors": [[i, str(t.dtype)[6:], list(t.shape)] for i, t in cpu]}
    blob = json.dumps(header, separators=(",", ":")).encode()
    out.write(MAGIC + len(blob).to_bytes(8, "little") + blob)
    for _, t in cpu:
        out.write(_bytes_of(t))


def _read_part(reader: HashingReader) -> dict[str, Any]:
    """{part, parts, tensors {id: tensor}} of one part file; ValueError when its header is not sound."""
    if reader.read(8) != MAGIC:
        raise ValueError("not a tensor part (bad magic)")
    length = int.from_bytes(reader.read(8), "little")
    if length > min(reader.left, _MAX_HEADER):
        raise ValueError("header longer than the file")
    header = json.loads(reader.read(length))
    specs = []
    for i, dtype, shape in header["tensors"]:
        if not isinstance(i, int) or dtype not in _DTYPES or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError("malformed tensor entry")
        specs.append((i, _DTYPES[dtype], shape))
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in specs)
    if total != reader.left:  # checked before allocating: a bad header cannot ask for more memory than the file
        raise ValueError(f"the header describes {total} bytes of tensors, the file holds {reader.left}")
    tensors: dict[int, torch.Tensor] = {}
    for i, dtype, shape in specs:
        t = torch.empty(shape, dtype=dtype)
        reader.readinto(_bytes_of(t))
        tensors[i] = t
    return {"part": header["part"], "parts": header["parts"], "tensors": tensors}


class ShardedWriter(CheckpointFormat):
    """Every rank writes its share of the shared tensors (partition()); rank 0 the structure; each rank its RNG."""

    strategies = frozenset({"ddp"})  # the full state on every rank: under FSDP/HSDP each holds only its shards

    def snapshot(
        self, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """CPU copies of this rank's part only; the other tensors become meta tensors (shape and dtype, no data)."""
        tree, tensors, slots = split(shared)
        split_ids = partition([_nbytes(t) for t in tensors], _parts(world_size))
        mine = {i for p in _my_parts(rank) for i in split_ids[p]}
        kept = {
            i: t.detach().to("cpu", copy=True) if i in mine else torch.empty(t.shape, dtype=t.dtype, device="meta")
            for i, t in enumerate(tensors)
        }
        return join(to_cpu(tree) if rank == 0 else tree, dict(slots), kept), to_cpu(local)

    def write(
        self, folder: Path, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any], algorithm: str
    ) -> dict[str, FileEntry]:
        """This rank's parts (a thread each), the structure on rank 0, and this rank's local files."""
        tree, tensors, slots = split(shared)
        split_ids = partition([_nbytes(t) for t in tensors], _parts(world_size))
        items = local_files(rank, local)
        if rank == 0:
            items[STRUCTURE] = {"tree": tree, "slots": slots, "count": len(tensors)}

        def write_part(p: int) -> FileEntry:
            chosen = [(i, tensors[i]) for i in split_ids[p]]
            parts = _parts(world_size)
            return write_stream(folder / part_name(p, parts), lambda out: _write_part(out, p, parts, chosen), algorithm)

        with ThreadPoolExecutor(max_workers=PARTS_PER_RANK) as pool:
            parts = {part_name(p, _parts(world_size)): pool.submit(write_part, p) for p in _my_parts(rank)}
            entries = write_all(folder, items, algorithm)
            entries.update({name: f.result() for name, f in parts.items()})
        return entries

    def required(self, world_size: int) -> set[str]:
        """The structure, one part per saved rank and one rng file per saved rank."""
        parts = _parts(world_size)
        return {STRUCTURE} | {part_name(p, parts) for p in range(parts)} | local_required(world_size)

    def decode(self, name: str, reader: HashingReader) -> Any:
        """A part's tensors, read straight into their memory; any other file's bytes (torch.load runs once verified)."""
        if name.startswith("tensors-") and name.endswith(".bin"):
            return _read_part(reader)
        return reader.read_all()

    def _assemble(self, ckpt: ReadableCheckpoint) -> dict[str, Any]:
        """The shared state: the structure with every part's tensors in their slots, each id exactly once."""
        where = ckpt.path.name
        structure = ckpt.load(STRUCTURE)
        parts = _parts(ckpt.manifest.world_size)
        tensors: dict[int, torch.Tensor] = {}
        for p in range(parts):
            part = ckpt.content(part_name(p, parts))
            if (part["part"], part["parts"]) != (p, parts):
                raise CheckpointError(
                    f"{where}: {part_name(p, parts)} says it is part {part['part']} of {part['parts']}"
                )
            if tensors.keys() & part["tensors"].keys():
                raise CheckpointError(f"{where}: {part_name(p, parts)} repeats a tensor of another part")
            tensors.update(part["tensors"])
        count, slots = structure["count"], dict(structure["slots"])
        if set(tensors) != set(range(count)) or sorted(slots.values()) != list(range(count)):
            raise CheckpointError(f"{where}: its parts do not hold the {count} tensors its {STRUCTURE} names")
        state: dict[str, Any] = join(structure["tree"], slots, tensors)
        return state

    def read_shared(self, ckpt: ReadableCheckpoint, key: str) -> Any:
        """One shared object, assembled from the structure and every part."""
        return _pick(ckpt, self._assemble(ckpt), key)

    def read(
        self, ckpt: ReadableCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The whole shared state (from every part, whatever world size saved it); local as rank0-torch."""
        state = self._assemble(ckpt)
        return {k: _pick(ckpt, state, k) for k in SHARED_KEYS}, read_local(ckpt, rank, world_size)


def _pick(ckpt: ReadableCheckpoint, state: dict[str, Any], key: str) -> Any:
    if key not in state:
        raise CheckpointError(f"{ckpt.path.name}: its {STRUCTURE} holds no {key!r} state")
    return state[key]
