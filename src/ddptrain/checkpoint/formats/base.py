"""The interface of a checkpoint format: how a run's state becomes the files of one checkpoint and back.

A format turns (shared, local) state into this rank's files of one checkpoint and back. The commit
protocol around it (temp folder, agreement, manifest, rename) and verification stay in
checkpointer.py and verify.py, so a new format is a new subclass of CheckpointFormat in its own
module, plus its line in registry.py. The Trainer hands every rank `shared` (model, optimizer,
trainer) and `local` (this rank's own, e.g. RNG streams) state and gets the same back; what a
format needs of the model and optimizer goes through capture() and restore(), so the Trainer never
asks which format it is. Reading is in two steps: verify.py reads every listed file once, hashing
it while the format's decode() turns its bytes into objects; only when every hash matched does
read() assemble the state from them. At a resume of several ranks, load_plan() says which ranks
read and verify each file and which contents every rank needs (shared_load.py sends them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from ddptrain.checkpoint.hashing_reader import HashingReader
from ddptrain.checkpoint.load_plan import LoadPlan, plan_by_size
from ddptrain.checkpoint.manifest import FileEntry, Manifest
from ddptrain.config.kinds import FORMATS

SHARED_KEYS = ("model", "optimizer", "trainer")
LOCAL_KEYS = ("rng",)  # every rank's own objects (`<key>-rank<r>.pt`), in every checkpoint
COMPRESSION_STATE = "grad_compression"  # PowerSGD's per-rank state (train/compression.py), in its runs' only
DILOCO_STATE = "diloco"  # a DiLoCo rank's own weights, inner optimizer and loss scale (train/sync/diloco.py)
OPTIONAL_LOCAL_KEYS = (COMPRESSION_STATE, DILOCO_STATE)  # a rank's own objects a checkpoint may hold


class ReadableCheckpoint(Protocol):
    """A verified checkpoint as a format reads it (verify.VerifiedCheckpoint): every content was hash-checked."""

    @property
    def path(self) -> Path:
        """The checkpoint's folder."""
        ...

    @property
    def manifest(self) -> Manifest:
        """Its verified manifest."""
        ...

    def content(self, name: str) -> Any:
        """The decoded content of one listed file, as the format's decode() returned it."""
        ...

    def load(self, name: str) -> Any:
        """One listed torch.save file as objects on the CPU, from verified bytes."""
        ...


class CheckpointFormat(ABC):
    """Serialization of one checkpoint; `name` is recorded in the manifest (`writer`) and picks the reader.

    `strategies` are the dist.strategy values whose state the format can save (any format's
    checkpoints load under any strategy). The defaults below fit a format that saves the full,
    rank-independent state (DDP keeps it identical on every rank) and runs no collective of its own.
    """

    strategies: ClassVar[frozenset[str]]

    @property
    def name(self) -> str:
        """The format's name in config/kinds.py's FORMATS: what its manifests record (`writer`)."""
        return FORMATS.name_of(f"{type(self).__module__}:{type(self).__qualname__}")

    def bind(self, group: dist.ProcessGroup | None) -> None:
        """The process group the format's own collectives run on: the checkpointer's (None: one process)."""
        return None  # by default a format runs no collective of its own

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model, optimizer) state as this format saves it: by default the full state dicts."""
        return model.state_dict(), optimizer.state_dict()

    @abstractmethod
    def snapshot(
        self, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """CPU copies of what this rank will write, for an async save (the loop may go on changing the state)."""

    @abstractmethod
    def write(
        self, folder: Path, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any], algorithm: str
    ) -> dict[str, FileEntry]:
        """Write this rank's files into folder (new files only); their manifest entries, digests of `algorithm`
        (digests.py) computed from the bytes as they were written."""

    @abstractmethod
    def required(self, world_size: int) -> set[str]:
        """The files a checkpoint saved at world_size must list, or it is rejected."""

    def decode(self, name: str, reader: HashingReader) -> Any:
        """One listed file's content from its bytes as they are read (and hashed); kept only if the hash matches.

        By default the bytes themselves: torch.load runs on them only after they were verified."""
        return reader.read_all()

    def load_plan(self, manifest: Manifest, world_size: int, nodes: Sequence[int] | None = None) -> LoadPlan:
        """Who reads and verifies each listed file when world_size ranks resume together, and who needs it.

        nodes: each rank's node (ranks of one node share its page cache); None: every rank a node of
        its own. By default each rank's own local files (`<key>-rank<r>.pt`, at the saved world size)
        go to that rank alone; every other file is needed by every rank, and the files are split by
        size over the nodes so that each node reads about 1/N of the bytes (load_plan.py). At another
        world size no rank resumes the saved local files: they are verified (split like the rest) and dropped.
        """
        keys = (*LOCAL_KEYS, *OPTIONAL_LOCAL_KEYS)
        local = {f"{k}-rank{r}.pt": r for k in keys for r in range(manifest.world_size)}
        local = {name: r for name, r in local.items() if name in manifest.files}
        same = manifest.world_size == world_size
        sizes = {name: entry.size for name, entry in manifest.files.items()}
        layout = range(world_size) if nodes is None else nodes
        return plan_by_size(sizes, local if same else {}, set() if same else set(local), layout)

    @abstractmethod
    def read_shared(self, ckpt: ReadableCheckpoint, key: str) -> Any:
        """One shared object ('model', 'optimizer', 'trainer') of a verified checkpoint."""

    @abstractmethod
    def read(
        self, ckpt: ReadableCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(shared, local) state for this rank; local is None when it was saved at another world size."""

    def restore(self, ckpt: ReadableCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """All ranks, before read(): load into model and optimizer, in place, the state read() leaves out.

        Nothing by default: read() returns the full state, which the Trainer loads."""
        return None
