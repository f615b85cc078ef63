"""How a checkpoint's state becomes files and back: the seam for other formats.

A CheckpointWriter turns (shared, local) state into this rank's files of one checkpoint and
back. The commit protocol around it (temp folder, agreement, manifest, rename) and verification
stay in Checkpointer and verify.py, so a new format (e.g. one shard per rank) is a new writer
class and nothing else: the Trainer only hands over `shared` (identical on every rank) and
`local` (this rank's own, e.g. RNG streams) state and gets the same back.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddptrain.checkpoint.durable import write_durable
from ddptrain.checkpoint.manifest import FileEntry

if TYPE_CHECKING:  # verify.py asks the writers which files are required: no import cycle at run time
    from ddptrain.checkpoint.verify import VerifiedCheckpoint


class CheckpointWriter(Protocol):
    """Serialization of one checkpoint; `name` is recorded in the manifest and picks the reader."""

    name: str

    def write(self, folder: Path, rank: int, shared: dict[str, Any], local: dict[str, Any]) -> dict[str, FileEntry]:
        """Write this rank's files into folder (new files only); their manifest entries."""
        ...

    def required(self, world_size: int) -> set[str]:
        """The files a checkpoint saved at world_size must list, or it is rejected."""
        ...

    def read(
        self, ckpt: VerifiedCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(shared, local) state for this rank; local is None when it was saved at another world size."""
        ...


class RankZeroTorchWriter:
    """Rank 0 writes each shared object as `<key>.pt`; every rank writes its local ones as `<key>-rank<r>.pt`.

    DDP keeps model and optimizer identical on every rank, so rank 0's copy is the state.
    """

    name = "rank0-torch"
    shared_keys = ("model", "optimizer", "trainer")
    local_keys = ("rng",)

    def write(self, folder: Path, rank: int, shared: dict[str, Any], local: dict[str, Any]) -> dict[str, FileEntry]:
        """torch.save each object into its own durable file, concurrently."""
        items = {f"{k}.pt": v for k, v in shared.items()} | {f"{k}-rank{rank}.pt": v for k, v in local.items()}
        if not items:
            return {}
        # One thread per file: while one thread serializes (holding the GIL), another's
        # SHA-256 and fsync run without it, so the files' costs overlap.
        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            futures = {name: pool.submit(write_durable, folder / name, obj) for name, obj in items.items()}
            return {name: f.result() for name, f in futures.items()}

    def required(self, world_size: int) -> set[str]:
        """model/optimizer/trainer.pt and one rng file per rank."""
        return {f"{k}.pt" for k in self.shared_keys} | {
            f"{k}-rank{r}.pt" for k in self.local_keys for r in range(world_size)
        }

    def read(
        self, ckpt: VerifiedCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Every shared file; this rank's local files when the world size is the one saved."""
        shared = {k: ckpt.load(f"{k}.pt") for k in self.shared_keys}
        if ckpt.manifest.world_size != world_size:
            return shared, None
        return shared, {k: ckpt.load(f"{k}-rank{rank}.pt") for k in self.local_keys}


WRITERS: dict[str, CheckpointWriter] = {RankZeroTorchWriter.name: RankZeroTorchWriter()}
