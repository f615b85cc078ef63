"""How a checkpoint's state becomes files and back: the seam for other formats.

A CheckpointWriter turns (shared, local) state into this rank's files of one checkpoint and
back. The commit protocol around it (temp folder, agreement, manifest, rename) and verification
stay in Checkpointer and verify.py, so a new format is a new writer class and nothing else: the
Trainer hands every rank `shared` (identical on every rank: model, optimizer, trainer) and
`local` (this rank's own, e.g. RNG streams) state and gets the same back. Reading is in two
steps: verify.py reads every listed file once, hashing it while the writer's decode() turns its
bytes into objects; only when every hash matched does read() assemble the state from them.

Writers: `sharded` (sharded.py, the default: every rank writes its share of the tensors), `dcp`
(dcp_writer.py: FSDP/HSDP runs, torch.distributed.checkpoint's shards) and `rank0-torch` (below:
rank 0 writes everything; older checkpoints, still read).
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ddptrain.checkpoint.durable import write_durable
from ddptrain.checkpoint.manifest import FileEntry

if TYPE_CHECKING:  # verify.py asks the writers which files are required: no import cycle at run time
    from ddptrain.checkpoint.verify import HashingReader, VerifiedCheckpoint

SHARED_KEYS = ("model", "optimizer", "trainer")
LOCAL_KEYS = ("rng",)


class CheckpointWriter(Protocol):
    """Serialization of one checkpoint; `name` is recorded in the manifest and picks the reader."""

    name: str

    def snapshot(
        self, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """CPU copies of what this rank will write, for an async save (the loop may go on changing the state)."""
        ...

    def write(
        self, folder: Path, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any], algorithm: str
    ) -> dict[str, FileEntry]:
        """Write this rank's files into folder (new files only); their manifest entries, digests of `algorithm`
        (digests.py) computed from the bytes as they were written."""
        ...

    def required(self, world_size: int) -> set[str]:
        """The files a checkpoint saved at world_size must list, or it is rejected."""
        ...

    def decode(self, name: str, reader: HashingReader) -> Any:
        """One listed file's content from its bytes as they are read (and hashed); kept only if the hash matches."""
        ...

    def read_shared(self, ckpt: VerifiedCheckpoint, key: str) -> Any:
        """One shared object ('model', 'optimizer', 'trainer') of a verified checkpoint."""
        ...

    def read(
        self, ckpt: VerifiedCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(shared, local) state for this rank; local is None when it was saved at another world size."""
        ...


def to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor on the CPU: the snapshot an async save writes from.

    Dicts keep their type and attributes (a state_dict is an OrderedDict with _metadata).
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = to_cpu(v)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


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


class RankZeroTorchWriter:
    """Rank 0 writes each shared object as `<key>.pt`; every rank writes its local ones as `<key>-rank<r>.pt`.

    DDP keeps model and optimizer identical on every rank, so rank 0's copy is the state.
    """

    name = "rank0-torch"

    def snapshot(
        self, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Rank 0 copies the shared state; every rank its local state."""
        return (to_cpu(shared) if rank == 0 else {}), to_cpu(local)

    def write(
        self, folder: Path, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any], algorithm: str
    ) -> dict[str, FileEntry]:
        """torch.save each object into its own durable file, concurrently."""
        items = {f"{k}.pt": v for k, v in shared.items()} if rank == 0 else {}
        return write_all(folder, items | local_files(rank, local), algorithm)

    def required(self, world_size: int) -> set[str]:
        """model/optimizer/trainer.pt and one rng file per rank."""
        return {f"{k}.pt" for k in SHARED_KEYS} | local_required(world_size)

    def decode(self, name: str, reader: HashingReader) -> Any:
        """The file's bytes: torch.load runs on them only after they were verified."""
        return reader.read_all()

    def read_shared(self, ckpt: VerifiedCheckpoint, key: str) -> Any:
        """torch.load of `<key>.pt`."""
        return ckpt.load(f"{key}.pt")

    def read(
        self, ckpt: VerifiedCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Every shared file; this rank's local files when the world size is the one saved."""
        return {k: self.read_shared(ckpt, k) for k in SHARED_KEYS}, read_local(ckpt, rank, world_size)


def local_files(rank: int, local: dict[str, Any]) -> dict[str, Any]:
    """The file names of a rank's local objects: `<key>-rank<r>.pt`."""
    return {f"{k}-rank{rank}.pt": v for k, v in local.items()}


def local_required(world_size: int) -> set[str]:
    """One `<key>-rank<r>.pt` per local key and saved rank."""
    return {f"{k}-rank{r}.pt" for k in LOCAL_KEYS for r in range(world_size)}


def read_local(ckpt: VerifiedCheckpoint, rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's local objects; None when the checkpoint was saved at another world size."""
    if ckpt.manifest.world_size != world_size:
        return None
    return {k: ckpt.load(f"{k}-rank{rank}.pt") for k in LOCAL_KEYS}


# The sharded and dcp writers build on the helpers above, so they are imported after them.
from ddptrain.checkpoint.formats.dcp import DcpWriter as DcpWriter  # noqa: E402
from ddptrain.checkpoint.formats.sharded import ShardedWriter  # noqa: E402

WRITERS: dict[str, CheckpointWriter] = {w.name: w for w in (RankZeroTorchWriter(), ShardedWriter(), DcpWriter())}
DEFAULT_WRITER = ShardedWriter.name
