"""The shared load: W ranks on N nodes resume together, each node reading and verifying about 1/N of a checkpoint.

For each candidate (newest first, or the one ckpt.resume names), on the checkpoint's own process group:

1. rank 0 checks the manifest (folder, checksum, step, writer, required files; no listed file is
   opened) and sends it to every rank (one broadcast);
2. every rank reads and verifies its share: the files the format's load_plan() gives it (split by
   size over the nodes; on its node every rank reads the files it needs itself), each read once and
   decoded while hashed (verify.read_files);
3. every rank's verdict goes to every rank (one all-gather): if any share failed, every rank drops
   what it read and the next older candidate is tried, rank 0 naming the bad file (a checkpoint
   named by ckpt.resume is refused instead);
4. only after the checkpoint is chosen (exchange()), the contents a rank needs and did not read are
   sent to it by a rank of the node that read them, in bounded chunks (exchange.py). Nothing
   reaches the model or optimizer before that ends.

Files reach storage once per resume in total (once per node that reads them, and each file is read
on one node), and any world size loads any checkpoint: the split is computed for the current layout.
The ranks of one node share its page cache, so a second read there is cheaper than sending over
loopback (docs/benchmarks.md), and each rank hashes every byte it uses itself or receives it from a
rank that hashed exactly those bytes. `nodes` (checkpointer.py, by ckpt.load) is each rank's node:
by host (auto), one node (every-rank: nothing is sent) or a node per rank (shared: each rank reads
1/W). One process (no process group) verifies everything itself (verify_checkpoint), as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddptrain.checkpoint.exchange import allocate, describe, flatten, rebuild, recv_buffers, send_buffers
from ddptrain.checkpoint.manifest import Manifest
from ddptrain.checkpoint.verify import VerifiedCheckpoint, checked_manifest, read_files
from ddptrain.errors import CheckpointError, DdptrainError


class SharedLoad:
    """The shared load of one resume, by every rank of `group` together (rank, world_size: in that group;
    nodes: each rank's node in rank order, None for a node per rank)."""

    def __init__(
        self, rank: int, world_size: int, group: dist.ProcessGroup | None, nodes: Sequence[int] | None = None
    ) -> None:
        self.rank, self.world_size, self.group = rank, world_size, group
        self.nodes = tuple(range(world_size)) if nodes is None else tuple(nodes)

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
        plan = ckpt.writer.load_plan(manifest, self.world_size, self.nodes)
        failure: str | None = None
        contents: dict[str, Any] = {}
        try:
            contents = read_files(path, manifest, plan.reads(self.rank), plan.keeps(self.rank))
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
        """All ranks, once every share verified and the checkpoint is chosen: each content a rank needs and
        did not read arrives from a rank of the node that read it; the checkpoint with every content this
        rank uses. A rank lost on the way fails every other rank's resume here (DdptrainError, exit 1),
        before anything was loaded."""
        routes = ckpt.writer.load_plan(ckpt.manifest, self.world_size, self.nodes).routes()
        if not routes:
            return ckpt  # one node: every rank read what it needs
        contents = dict(ckpt.contents or {})
        mine = {n: flatten(contents[n]) for n in sorted({n for n, src, _ in routes if src == self.rank})}
        offers: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(offers, {n: (s, describe(b)) for n, (s, b) in mine.items()}, group=self.group)
            for name, src, dst in routes:
                if src == self.rank:
                    send_buffers(mine[name][1], dst, self.group)
                elif dst == self.rank:
                    structure, specs = offers[src][name]
                    buffers = allocate(specs)
                    recv_buffers(buffers, src, self.group)
                    contents[name] = rebuild(structure, buffers)
        except RuntimeError as e:  # gloo/NCCL: a peer gone or timed out
            raise DdptrainError(
                f"resuming from {ckpt.path.name} failed while the ranks exchanged its verified files "
                f"({type(e).__name__}: {str(e)[:160]}); nothing was loaded: start the job again to resume"
            ) from None
        return VerifiedCheckpoint(ckpt.path, ckpt.manifest, contents)


def load_shared(
    path: Path, rank: int, world_size: int, group: dist.ProcessGroup | None, nodes: Sequence[int] | None = None
) -> VerifiedCheckpoint:
    """Every rank of group together: the checkpoint at path, shared-loaded (each node read about 1/N of it;
    nodes as SharedLoad's); CheckpointError on every rank when it does not verify. For benchmarks and one-off loads."""
    loader = SharedLoad(rank, world_size, group, nodes)
    ckpt, failure = loader.search([path], lambda _: None, named=True)
    if ckpt is None:
        raise CheckpointError(failure or f"{path.name}: not a checkpoint")
    return loader.exchange(ckpt)
