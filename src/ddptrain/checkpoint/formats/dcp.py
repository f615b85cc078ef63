"""The `dcp` checkpoint format: every rank saves its shards of the state with torch.distributed.checkpoint.

FSDP/HSDP runs save with it (ckpt.format=auto); a DDP run does when ckpt.format=dcp (DCP spreads the
replicated tensors over the ranks).

Files of one checkpoint (all in the same `.tmp-step-N/` folder, committed by the usual protocol):

    __<r>_0.distcp         rank r: its shards of the model and optimizer (DCP's FileSystemWriter)
    .metadata              rank 0 (DCP's coordinator): which shard lies where; listed in the
                           manifest as `dcp.metadata` (manifest names are never hidden names)
    trainer.pt             rank 0: step, scheduler, scaler, sampler (identical on every rank)
    rng-rank<r>.pt         rank r: its own RNG streams

DCP itself checksums nothing and takes `.metadata` as its commit marker; here every rank hashes
the DCP files it writes as DCP writes them (HashingFiles: DCP's file system, through which it
creates every file, so nothing is read back), the manifest lists them all, and rank 0 commits
only after every rank agreed (checkpointer.py). DCP's collectives run on the checkpointer's own
gloo group, also in an async save's background thread.

Loading never reads a byte that was not verified: verify.py reads and hashes every listed file
once and keeps its bytes; DCP's reader is then served those bytes (VerifiedFiles), not the files
on disk, so a file changed after verification is never seen and an unlisted one is refused.
DCP reshards on load: the state to fill (sharded DTensors under FSDP, plain tensors under DDP or
export) decides which slices each rank takes.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ddptrain.checkpoint.durable import new_hashed_file
from ddptrain.checkpoint.formats.base import CheckpointFormat, ReadableCheckpoint
from ddptrain.checkpoint.formats.common import local_files, local_required, read_local, to_cpu, write_all
from ddptrain.checkpoint.manifest import DCP_METADATA, FileEntry, disk_name
from ddptrain.errors import CheckpointError

TRAINER = "trainer.pt"
SHARDED_KEYS = ("model", "optimizer")


@contextmanager
def _one_process_is_meant() -> Iterator[None]:
    """DCP warns when it saves or loads without a process group: in one process that is what is asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


class _CachedSavePlans(DefaultSavePlanner):
    """DCP's default save planner with its plans cached: a run saves the same shapes every time, so from the
    second save on the ranks send the coordinator empty plans and reuse the global plan (a changed state is
    planned again). torch keys the cache by the planner's class name: this class keeps ddptrain's apart."""


class HashingFiles(FileSystem):
    """DCP's file system for one save: every file is created new (never through an existing name or
    link) and hashed as DCP writes it; opening one for reading is refused (a save never reads back)."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm
        self.written: dict[str, FileEntry] = {}  # by file name, once DCP closed the file

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        """A new file for DCP to write; its entry is recorded when DCP is done with it."""
        if mode != "wb":
            raise CheckpointError(f"DCP asked to open {Path(path).name} with mode {mode!r} during a save")
        with new_hashed_file(Path(path), self.algorithm) as out:
            # DCP uses write, tell (offsets), flush, fileno (fsync) and close: HashingWriter has them.
            yield cast(io.IOBase, out)
            self.written[Path(path).name] = out.entry()

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """DCP writes `.metadata.tmp` and renames it `.metadata`: the entry follows the name."""
        super().rename(path, new_path)
        self.written[Path(new_path).name] = self.written.pop(Path(path).name)

    def entry(self, name: str) -> FileEntry:
        """The entry of a file DCP wrote through this file system; CheckpointError for any other."""
        if name not in self.written:
            raise CheckpointError(f"DCP wrote {name} without hashing it (not through ddptrain's file system)")
        return self.written[name]


class VerifiedFiles(FileSystem):
    """DCP's file system, read-only, over a verified checkpoint's kept bytes: nothing comes from disk."""

    def __init__(self, ckpt: ReadableCheckpoint) -> None:
        super().__init__()
        self.ckpt = ckpt

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        """The verified bytes of the listed file named by path (content() refuses an unlisted one)."""
        if mode != "rb":
            raise CheckpointError(f"{self.ckpt.path.name}: DCP asked to open {Path(path).name} for writing")
        name = Path(path).name
        data = self.ckpt.content(DCP_METADATA if name == disk_name(DCP_METADATA) else name)
        if not isinstance(data, bytes):
            raise CheckpointError(f"{self.ckpt.path.name}: {name} was not kept as bytes")
        yield io.BytesIO(data)


def verified_reader(ckpt: ReadableCheckpoint) -> FileSystemReader:
    """A DCP reader of ckpt whose every read is served from verified bytes."""
    reader = FileSystemReader(ckpt.path)
    # FileSystemReader reads the metadata and every shard through `self.fs`: replacing it keeps
    # DCP's own decoding (offsets, transforms) while the bytes are those verify.py hashed. Should a
    # torch release stop reading through `fs`, tests/unit/test_checkpoint_dcp.py fails: it changes a
    # shard file after verification and requires the load to still see the verified bytes.
    reader.fs = VerifiedFiles(ckpt)
    return reader


def load_sharded(ckpt: ReadableCheckpoint, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    """Fill `state` ({"model": ..., "optimizer": ...} in get_state_dict's form) in place from a dcp checkpoint.

    All ranks together (DCP plans the load on `group`); group None loads in this process alone.
    """
    try:
        with _one_process_is_meant():
            dcp_load(state, storage_reader=verified_reader(ckpt), process_group=group, no_dist=group is None)
    except CheckpointError:
        raise
    except Exception as e:  # verified bytes DCP cannot fit into this model: a format or shape problem
        raise CheckpointError(f"{ckpt.path.name}: DCP cannot load it ({type(e).__name__}: {str(e)[:160]})") from None


def model_template(metadata: Metadata) -> dict[str, torch.Tensor]:
    """Empty full-size tensors for every `model.*` entry of a DCP checkpoint (what export fills)."""
    prefix = "model."
    return {
        key[len(prefix) :]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


class DcpWriter(CheckpointFormat):
    """Model and optimizer through DCP (every rank its shards), trainer state by rank 0, RNG by every rank."""

    strategies = frozenset({"ddp", "fsdp", "hsdp"})  # DCP saves shards and whole replicas alike

    def __init__(self) -> None:
        self.group: dist.ProcessGroup | None = None  # the checkpointer's own gloo group (bind)

    def bind(self, group: dist.ProcessGroup | None) -> None:
        """The group DCP's collectives run on: the checkpointer's, never the training loop's."""
        self.group = group

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's shards (DTensors under FSDP, whole tensors otherwise), keyed by name: get_state_dict's form."""
        return get_state_dict(model, optimizer)

    def snapshot(
        self, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """CPU copies of this rank's shards (a DTensor copies its local shard) and of the rest."""
        return to_cpu(shared), to_cpu(local)

    def write(
        self, folder: Path, rank: int, world_size: int, shared: dict[str, Any], local: dict[str, Any], algorithm: str
    ) -> dict[str, FileEntry]:
        """dcp.save of model and optimizer (a collective), then this rank's other files; every file hashed as written."""
        # One file per rank (one writer thread): `__<rank>_0.distcp`, which required() names.
        writer = FileSystemWriter(folder, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
        # FileSystemWriter creates every file through `self.fs` (as the reader reads through it,
        # verified_reader): replacing it hashes the bytes on their way out. Should a torch release
        # write some other way, entry() below refuses the save (tests/unit/test_checkpoint_dcp.py).
        files = HashingFiles(algorithm)
        writer.fs = files
        sharded = {k: shared[k] for k in SHARDED_KEYS}
        with _one_process_is_meant():
            metadata = dcp_save(
                sharded,
                storage_writer=writer,
                planner=_CachedSavePlans(enable_plan_caching=True),
                process_group=self.group,
                no_dist=self.group is None,
            )
        # The files DCP says this rank wrote (`__<rank>_*`), hashed while DCP wrote (and fsynced) them.
        written = {info.relative_path for info in metadata.storage_data.values()}
        mine = sorted(n for n in written if n.startswith(f"__{rank}_"))
        entries = {n: files.entry(n) for n in mine}
        items = local_files(rank, local)
        if rank == 0:
            entries[DCP_METADATA] = files.entry(disk_name(DCP_METADATA))
            items[TRAINER] = shared["trainer"]
        entries.update(write_all(folder, items, algorithm))
        return entries

    def required(self, world_size: int) -> set[str]:
        """DCP's metadata, every rank's shard file (one each: one writer thread), the trainer state, the rng files.

        Listing every shard file here rejects a manifest that lost one at verification (and falls back),
        instead of failing later inside DCP's load.
        """
        shards = {f"__{r}_0.distcp" for r in range(world_size)}
        return {DCP_METADATA, TRAINER} | shards | local_required(world_size)

    def metadata(self, ckpt: ReadableCheckpoint) -> Metadata:
        """DCP's metadata of ckpt, from its verified bytes."""
        metadata: Metadata = verified_reader(ckpt).read_metadata()
        return metadata

    def read_shared(self, ckpt: ReadableCheckpoint, key: str) -> Any:
        """'trainer'; or 'model' consolidated into full tensors in this process (export, generate)."""
        if key == "trainer":
            return ckpt.load(TRAINER)
        if key != "model":
            raise CheckpointError(f"{ckpt.path.name}: a dcp checkpoint's {key!r} state loads into a live run only")
        state = {"model": model_template(self.metadata(ckpt))}
        load_sharded(ckpt, state, None)
        return state["model"]

    def read(
        self, ckpt: ReadableCheckpoint, rank: int, world_size: int
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The trainer state and this rank's local state; model and optimizer come through restore()."""
        return {"trainer": ckpt.load(TRAINER)}, read_local(ckpt, rank, world_size)

    def restore(self, ckpt: ReadableCheckpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """All ranks: model and optimizer in this run's form; DCP reads the slices each rank needs, on the bound group.

        The template is get_state_dict's: it initialises a fresh optimizer's state, so every key exists to be filled.
        """
        model_state, optim_state = get_state_dict(model, optimizer)
        load_sharded(ckpt, {"model": model_state, "optimizer": optim_state}, self.group)  # fills them in place
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
