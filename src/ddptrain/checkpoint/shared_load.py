"""The shared load: W ranks resume together, each reading and verifying about 1/W of a checkpoint.

For each candidate (newest first, or the one ckpt.resume names), on the checkpoint's own process group:

1. rank 0 checks the manifest (folder, checksum, step, writer, required files; no listed file is
   opened) and sends it to every rank (one broadcast);
2. every rank reads and verifies its share: the files the format's load_plan() gives it (split by
   size), each read once and decoded while hashed (verify.read_files);
3. every rank's verdict goes to every rank (one all-gather): if any share failed, every rank drops
   what it read and the next older candidate is tried, rank 0 naming the bad file (a checkpoint
   named by ckpt.resume is refused instead);
4. only after the checkpoint is chosen (exchange()), each owner broadcasts the contents every rank
   needs, in bounded chunks (exchange.py). Nothing reaches the model or optimizer before that ends.

Files reach storage once per resume in total, whatever W, and any world size loads any checkpoint:
the split is computed for the current W. With `every_rank` (ckpt.load: every-rank, or auto on one host)
each rank also reads and verifies every shared file itself and nothing is exchanged: on one host the
ranks share the page cache, so reading is cheaper than sending (docs/benchmarks.md); the verdicts are
still agreed, so every rank falls back together. One process (no process group) verifies everything itself
(verify_checkpoint), as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddptrain.checkpoint.exchange import allocate, broadcast_buffers, describe, flatten, rebuild
from ddptrain.checkpoint.manifest import Manifest
from ddptrain.checkpoint.verify import VerifiedCheckpoint, checked_manifest, read_files
from ddptrain.errors import CheckpointError, DdptrainError


class SharedLoad:
    """The shared load of one resume, by every rank of `group` together (rank, world_size: in that group)."""

    def __init__(self, rank: int, world_size: int, group: dist.ProcessGroup | None, every_rank: bool = False) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.every_rank = every_rank  # each rank reads every shared file itself: no exchange

    def search(
        self, candidates: list[Path], warn: Callable[[str], None], named: bool
    ) -> tuple[VerifiedCheckpoint | None, str | None]:
        """All ranks: the first of rank 0's candidates whose every share verified, holding this rank's share.

        candidates matter on rank 0 only. (None, reason) when none verified; reason is None when every
        candidate was rejected (each reported to warn on rank 0) or there was none. named: the
        candidate was named by the user: its rejection is the reason, not a warning.
        """
        pending = iter(candidates)
        while True:
            path, manifest, error = self._offer(pending, warn, named)
            if path is None or manifest is None:
                return None, error
            ckpt, failure = self.verify(path, manifest)
            if failure is None:
                return ckpt, None
            if named:
                return None, failure
            if self.rank == 0:
                warn(f"warning: checkpoint rejected: {failure}; trying an older one")

    def _offer(
        self, pending: Iterator[Path], warn: Callable[[str], None], named: bool
    ) -> tuple[Path | None, Manifest | None, str | None]:
        """Rank 0 finds the next candidate with a sound manifest; every rank receives (path, manifest, error)."""
        offer: tuple[str | None, Manifest | None, str | None] = (None, None, None)
        if self.rank == 0:
            for candidate in pending:
                try:
                    offer = (str(candidate), checked_manifest(candidate), None)
                    break
                except CheckpointError as e:
                    if named:
                        offer = (None, None, str(e))
                        break
                    warn(f"warning: checkpoint rejected: {e}; trying an older one")
        box = [offer]
        dist.broadcast_object_list(box, src=0, group=self.group)
        chosen, manifest, error = box[0]
        return (Path(chosen) if chosen is not None else None), manifest, error

    def verify(self, path: Path, manifest: Manifest) -> tuple[VerifiedCheckpoint | None, str | None]:
        """All ranks: read and verify this rank's share, then agree; (checkpoint with this rank's share, None)
        when every share verified, else (None, the first failure in name order, the same on every rank)."""
        ckpt = VerifiedCheckpoint(path, manifest)
        plan = ckpt.writer.load_plan(manifest, self.world_size)
        failure: str | None = None
        contents: dict[str, Any] = {}
        reads, keeps = plan.reads(self.rank), plan.keeps(self.rank)
        if self.every_rank:  # the shared files too, besides this rank's share of the rest
            reads, keeps = sorted(set(reads) | plan.shared), keeps | plan.shared
        try:
            contents = read_files(path, manifest, reads, keeps)
        except CheckpointError as e:
            failure = str(e)
        except OSError as e:  # an I/O error mid-file rejects the checkpoint like a bad digest
            failure = f"{path.name}: a file could not be read ({e.strerror or e})"
        verdicts: list[str | None] = [None] * self.world_size
        dist.all_gather_object(verdicts, failure, group=self.group)
        failed = sorted(v for v in verdicts if v is not None)
        if failed:
            return None, failed[0]
        return VerifiedCheckpoint(path, manifest, contents), None

    def exchange(self, ckpt: VerifiedCheckpoint) -> VerifiedCheckpoint:
        """All ranks, once every share verified and the checkpoint is chosen: each owner sends what every
        rank needs; the checkpoint with every content this rank uses. A rank lost on the way fails every
        other rank's resume here (DdptrainError, exit 1), before anything was loaded."""
        if self.every_rank:
            return ckpt  # every rank read what it needs
        plan = ckpt.writer.load_plan(ckpt.manifest, self.world_size)
        contents = dict(ckpt.contents or {})
        mine = {n: flatten(contents[n]) for n in plan.reads(self.rank) if n in plan.shared}
        offers: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(offers, {n: (s, describe(b)) for n, (s, b) in mine.items()}, group=self.group)
            for owner, offered in enumerate(offers):
                for name in sorted(offered):
                    structure, specs = offered[name]
                    buffers = mine[name][1] if owner == self.rank else allocate(specs)
                    broadcast_buffers(buffers, owner, self.rank, self.group)
                    if owner != self.rank:
                        contents[name] = rebuild(structure, buffers)
        except RuntimeError as e:  # gloo/NCCL: a peer gone or timed out
            raise DdptrainError(
                f"resuming from {ckpt.path.name} failed while the ranks exchanged its verified files "
                f"({type(e).__name__}: {str(e)[:160]}); nothing was loaded: start the job again to resume"
            ) from None
        return VerifiedCheckpoint(ckpt.path, ckpt.manifest, contents)


def load_shared(path: Path, rank: int, world_size: int, group: dist.ProcessGroup | None) -> VerifiedCheckpoint:
    """Every rank of group together: the checkpoint at path, shared-loaded (each rank read about 1/W of it);
    CheckpointError on every rank when it does not verify. For benchmarks and one-off loads."""
    loader = SharedLoad(rank, world_size, group)
    ckpt, failure = loader.search([path], lambda _: None, named=True)
    if ckpt is None:
        raise CheckpointError(failure or f"{path.name}: not a checkpoint")
    return loader.exchange(ckpt)
