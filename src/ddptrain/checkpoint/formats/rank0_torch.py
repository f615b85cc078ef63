"""The `rank0-torch` checkpoint format: rank 0 writes each shared object as one torch.save file.

Files: `model.pt`, `optimizer.pt`, `trainer.pt` (rank 0) and `rng-rank<r>.pt` (rank r). The format
of the first ddptrain checkpoints; they still load, and ckpt.format=rank0-torch still writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddptrain.checkpoint.formats.base import SHARED_KEYS, CheckpointFormat, ReadableCheckpoint
from ddptrain.checkpoint.formats.common import local_files, local_required, read_local, to_cpu, write_all
from ddptrain.checkpoint.manifest import FileEntry


class RankZeroTorchWriter(CheckpointFormat):
    """Rank 0 writes each shared object as `<key>.pt`; every rank writes its local ones as `<key>-rank<r>.pt`.

    DDP keeps model and optimizer identical on every rank, so rank 0's copy is the state.
    """

    strategies = frozenset({"ddp"})  # under FSDP/HSDP rank 0 holds only its shard

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

    def read_shared(self, ckpt: ReadableCheckpoint, key: str) -> Any:
        """torch.load of `<key>.pt`."""
        return ckpt.load(f"{key}.pt")

    def read(
        self, ckpt: ReadableCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Every shared file; this rank's local files when the world size is the one saved."""
        return {k: self.read_shared(ckpt, k) for k in SHARED_KEYS}, read_local(ckpt, rank, world_size)
