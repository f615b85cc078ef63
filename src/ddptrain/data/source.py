"""One object per kind of data a run trains on; everything else asks it and never which kind it is.

`data_source(cfg.data, live)` (data/kinds.py) picks the kind (KINDS, first claim wins):

  LiveDatasets     datasets passed to `ddptrain.train()` (config.yaml records them as data.live; a
                   command reading that config can rebuild nothing and says what to pass instead)
  UserFactory      data.target: `pkg.module:factory(**data.kwargs)` returning (train, val)
  DefaultCorpus    the embedded default corpus in data/stdlib, prepared on first use
  PreparedCorpus   a corpus `ddptrain prepare` wrote into data.dir (meta.json and token shards)

Each answers: prepare(ctx) (every rank, before the datasets; local rank 0 prepares what needs it),
datasets(sampling) and split(name, sampling), vocab_size(), tokenizer() and tokenizer_dir(),
pad_id(), verify(), identity(train, val) (what every rank compares at start, data/identity.py),
resume_identity() (what a checkpoint records and a resume compares, checkpoint/compat.py) and
describe() (how messages name it). A corpus's meta.json is read once per source.

A new kind of data is a subclass with its `claims` rule (in a module of its own), and one line in
data/kinds.py's KINDS. A mixture (data/mixture_source.py) is built from sources of the other kinds.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch.utils.data import Dataset

from ddptrain.config import Config, DataConfig
from ddptrain.data.corpus import (
    PrepareOptions,
    corpus_fingerprint,
    corpus_ready,
    prepare_corpus,
    read_meta,
    stdlib_sources,
)
from ddptrain.data.dataset import load_split
from ddptrain.data.identity import corpus_identity, datasets_identity
from ddptrain.data.tokenizer import Tokenizer, load_tokenizer_file
from ddptrain.data.verify import verify_corpus
from ddptrain.dist import DistContext, max_over_ranks
from ddptrain.errors import ConfigError, DataError, DdptrainError
from ddptrain.targets import import_target

log = logging.getLogger(__name__)

Datasets = tuple[Dataset[Any], Dataset[Any] | None]
# What ddptrain.train(datasets=...) holds once run_sources.py has recorded it: (train, val), or a factory
# that cannot be named in config.yaml; None when the config builds the data.
LiveData = Datasets | Callable[..., Datasets] | None
DEFAULT_DATA_DIR: str = DataConfig.model_fields["dir"].default
BYTES = Tokenizer(None, 256, None)  # a byte-level corpus's tokenizer: no file, no separator


@dataclass(frozen=True)
class Sampling:
    """What the datasets of a run depend on beyond the data section: the model's context (a corpus's window),
    and the global batch and seed a mixture's stream is cut by."""

    block_size: int
    global_batch: int
    seed: int

    @classmethod
    def of(cls, cfg: Config) -> Sampling:
        """The run's sampling."""
        return cls(cfg.model.block_size, cfg.train.global_batch_size, cfg.run.seed)


class DataSource:
    """The questions every kind of data answers; the defaults fit data ddptrain knows nothing about."""

    kind: ClassVar[str]
    key: ClassVar[str]  # the config key that names the data, for messages
    prepares_itself: ClassVar[bool] = False  # its folder may be missing before the run: prepare() makes it

    def __init__(self, cfg: DataConfig, live: LiveData = None) -> None:
        self.cfg = cfg
        self.live = live

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """Whether this kind is the data cfg (and the live object, if any) describes."""
        raise NotImplementedError

    @classmethod
    def build(cls, cfg: DataConfig, live: LiveData, make: Callable[[DataConfig], DataSource]) -> DataSource:
        """How data_source() makes one; a kind made of other sources builds them with `make`."""
        return cls(cfg, live)

    def check_can_build(self) -> None:
        """ConfigError (exit 2, one line) when the datasets cannot be built from what this source holds."""

    def prepare(self, ctx: DistContext, wait_s: float) -> None:
        """Every rank calls it, in step 3 of run.py; a kind that prepares itself does it here (and may run a
        collective, the same on every rank), waiting at most wait_s for another node's preparation."""

    def datasets(self, sampling: Sampling) -> Datasets:
        """(train, val or None) for samples of sampling.block_size tokens (the prepared corpus's window)."""
        raise NotImplementedError

    def split(self, name: str, sampling: Sampling) -> Dataset[Any]:
        """One split by name ('train' or 'val'), for `ddptrain eval`."""
        self.check_can_build()
        if name not in ("train", "val"):
            raise ConfigError(f"--split {name!r}: {self.key} gives the splits train and val")
        train, val = self.datasets(sampling)
        if name == "val" and val is None:
            raise DataError(f"{self.named()} returned no validation set")
        return train if name == "train" else val  # type: ignore[return-value]  # val checked above

    def vocab_size(self) -> int | None:
        """The data's vocabulary (token ids are below it); None when ddptrain does not know it."""
        return None

    def folder(self) -> Path | None:
        """The folder every node reads the data from (a batch job checks it before it starts); None when the
        data come from code."""
        return None

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer the data's ids come from; None when ddptrain does not know it."""
        return None

    def tokenizer_dir(self) -> Path | None:
        """The prepared corpus whose tokenizer an export to transformers carries; None when there is none."""
        return None

    def pad_id(self) -> int:
        """The id data.collate=pad fills with: the tokenizer's end-of-document id, else 0."""
        return 0

    def verify(self) -> None:
        """DataError when the data's bytes are not what its description says (only a prepared corpus can tell)."""

    def identity(self, train: Dataset[Any], val: Dataset[Any] | None) -> dict[str, Any]:
        """What this rank trains on, compared across ranks at start (data/identity.py)."""
        return datasets_identity(train, val, None)

    def resume_identity(self) -> dict[str, Any]:
        """What a checkpoint records of the data and a resume compares (checkpoint/compat.py)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The data in a few words (the value of its key)."""
        raise NotImplementedError

    def named(self) -> str:
        """`key='value'`, how an error names the data."""
        return f"{self.key}={self.describe()!r}"


class LiveDatasets(DataSource):
    """Datasets (or an unimportable factory) passed to ddptrain.train(); config.yaml records them as data.live."""

    kind = "live"
    key = "data.live"

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """A live object was given, or a config recorded one and names no factory to rebuild it."""
        return live is not None or (cfg.live is not None and cfg.target is None)

    def check_can_build(self) -> None:
        """A config whose data were live objects cannot rebuild them: the line says which keys to set."""
        if self.live is None:
            raise ConfigError(
                f"data.live={self.cfg.live!r}: the run trained on live datasets passed to ddptrain.train(), which "
                "ddptrain cannot rebuild; add data.target=pkg.module:factory (returning (train, val)), "
                "or data.live=null data.dir=DIR for a prepared corpus"
            )

    def datasets(self, sampling: Sampling) -> Datasets:
        """The datasets given, or what the factory given returns (called with data.kwargs)."""
        self.check_can_build()
        if isinstance(self.live, tuple) or self.live is None:  # None: refused by check_can_build
            return self.live  # type: ignore[return-value]
        return _dataset_pair(self.live(**self.cfg.kwargs), "the datasets factory given to ddptrain.train()")

    def tokenizer(self) -> Tokenizer | None:
        """Unknown, and a command needing it must be told: ConfigError naming --data-dir."""
        raise self._unknown_tokenizer()

    def tokenizer_dir(self) -> Path | None:
        """Unknown: ConfigError naming --data-dir."""
        raise self._unknown_tokenizer()

    def _unknown_tokenizer(self) -> ConfigError:
        return ConfigError(
            f"data.live={self.cfg.live!r}: the run trained on live datasets passed to ddptrain.train(), whose "
            "tokenizer ddptrain does not know; pass --data-dir DIR (the prepared corpus its tokens come from)"
        )

    def resume_identity(self) -> dict[str, Any]:
        """Live objects have no identity ddptrain can check at resume."""
        return {"source": "live"}

    def describe(self) -> str:
        """The classes config.yaml records."""
        return str(self.cfg.live)


class UserFactory(DataSource):
    """data.target: the user's factory, called with data.kwargs, returning (train, val or None)."""

    kind = "target"
    key = "data.target"

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """data.target is set (and no live object was given)."""
        return cfg.target is not None

    def datasets(self, sampling: Sampling) -> Datasets:
        """What the factory returns; ConfigError when that is not (train_dataset, val_dataset_or_None)."""
        return _dataset_pair(import_target(self.describe(), "data.target")(**self.cfg.kwargs), self.named())

    def identity(self, train: Dataset[Any], val: Dataset[Any] | None) -> dict[str, Any]:
        """The datasets' lengths and sample fingerprint, and the factory's name."""
        return datasets_identity(train, val, self.describe())

    def resume_identity(self) -> dict[str, Any]:
        """The factory and its kwargs: the data a checkpoint's position counts in."""
        # As config.yaml and the manifest hold them (JSON): a tuple given through the Python API is a list there.
        return {"source": "target", "target": self.cfg.target, "kwargs": self.cfg.model_dump(mode="json")["kwargs"]}

    def describe(self) -> str:
        """data.target's value."""
        return str(self.cfg.target)


class PreparedCorpus(DataSource):
    """A prepared token corpus in data.dir (meta.json, token shards, maybe tokenizer.json)."""

    kind = "corpus"
    key = "data.dir"

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """The fallback: whatever names no other kind of data reads data.dir."""
        return True

    @property
    def dir(self) -> Path:
        """data.dir, the corpus's folder."""
        return Path(self.cfg.dir)

    @functools.cached_property
    def meta(self) -> dict[str, Any]:
        """meta.json, validated and checked against the shards' sizes; read once (after prepare)."""
        return read_meta(self.dir)

    def datasets(self, sampling: Sampling) -> Datasets:
        """The train and val splits as windows of block_size + 1 tokens."""
        return self.split("train", sampling), self.split("val", sampling)

    def split(self, name: str, sampling: Sampling) -> Dataset[Any]:
        """Any split meta.json lists."""
        return load_split(self.dir, name, sampling.block_size, self.meta)

    def vocab_size(self) -> int | None:
        """meta.json's vocabulary size."""
        return int(self.meta["vocab_size"])

    def tokenizer(self) -> Tokenizer | None:
        """The corpus's tokenizer.json (its SHA-256 checked against meta.json's), or bytes; None when the
        corpus is gone (what `generate` then reads as bytes)."""
        try:
            described = self.meta["tokenizer"]
        except DataError:
            return None
        if not described["file"]:
            return BYTES
        return load_tokenizer_file(self.dir / described["file"], expected_sha256=described["sha256"])

    def tokenizer_dir(self) -> Path | None:
        """The corpus's own folder."""
        return self.dir

    def folder(self) -> Path | None:
        """data.dir."""
        return self.dir

    def pad_id(self) -> int:
        """The end-of-document id meta.json records; 0 for bytes (no such id)."""
        eos_id = self.meta.get("eos_id")
        return eos_id if isinstance(eos_id, int) else 0

    def verify(self) -> None:
        """Every shard's bytes against meta.json (data/verify.py: SHA-256, token range; once per process)."""
        verify_corpus(self.dir, self.meta)

    def identity(self, train: Dataset[Any], val: Dataset[Any] | None) -> dict[str, Any]:
        """The corpus's SHA-256, sizes and tokenizer, after its bytes were verified (`bad_data` when not)."""
        return corpus_identity(self.dir, self.meta)

    def resume_identity(self) -> dict[str, Any]:
        """The corpus's SHA-256 (of its shards' hashes, dtype and tokenizer); None when it cannot be read."""
        try:
            sha = corpus_fingerprint(self.meta)
        except (DataError, OSError):
            sha = None
        return {"source": "corpus", "sha256": sha}

    def describe(self) -> str:
        """data.dir's value."""
        return self.cfg.dir


class CorpusPreparedOnFirstUse(PreparedCorpus):
    """A prepared corpus the run itself prepares into data.dir when it is not there (or not from these inputs)."""

    prepares_itself = True
    what: ClassVar[str]  # how the log names it

    def inputs(self) -> list[Path]:
        """The files to prepare."""
        raise NotImplementedError

    def options(self, wait_s: float) -> PrepareOptions:
        """How to prepare them (tokenizer, text field), waiting at most wait_s for another preparer."""
        return PrepareOptions(wait_s=wait_s)

    def ready(self, folder: Path) -> bool:
        """Whether folder already holds this corpus (then nothing is prepared)."""
        return corpus_ready(folder)

    def prepare(self, ctx: DistContext, wait_s: float) -> None:
        """Local rank 0 of each node prepares the corpus when it is not there; the others wait.

        Nodes sharing a filesystem (a shared home) take turns through the folder's prepare lock and the
        later ones reuse the corpus the first published; a node waits at most wait_s (run.py gives half of
        dist.timeout_s: the other ranks wait for it in the all-reduce below, bounded by that timeout).
        Collective: one all-reduce.
        """
        failure: DdptrainError | None = None
        if ctx.local_rank == 0 and not self.ready(self.dir):
            if ctx.is_main:
                log.info("preparing %s into %s", self.what, self.dir)
            try:
                prepare_corpus(self.inputs(), self.dir, self.cfg.val_fraction, self.options(wait_s), reuse=self.ready)
            except DdptrainError as e:
                failure = e
            except OSError as e:  # the user's folder or disk (read-only, full): prepare_corpus raises no other
                failure = DataError(f"cannot prepare {self.what} in {self.dir}: {e.strerror or e}")
        # Every rank learns the worst outcome (0, or an exit code) and fails with it: nobody waits on a rank that
        # gave up, and every rank exits alike (bad input 2, never restarted; a lost lock or a timeout 1).
        worst = max_over_ranks(ctx, failure.exit_code if failure else 0)
        if failure is not None and failure.exit_code == worst:
            raise failure
        if worst:
            elsewhere = f"preparing {self.what} in {self.dir} failed on another rank"
            raise DataError(elsewhere) if worst == DataError.exit_code else DdptrainError(elsewhere)


class DefaultCorpus(CorpusPreparedOnFirstUse):
    """The embedded default corpus (the Python standard library's sources), prepared on first use."""

    kind = "default"
    what = "the default corpus (Python standard library sources)"

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """data.dir is the default folder."""
        return cfg.dir == DEFAULT_DATA_DIR

    def inputs(self) -> list[Path]:
        """The standard library's .py files."""
        return stdlib_sources()


def _dataset_pair(made: Any, who: str) -> Datasets:
    """made, when it is (train_dataset, val_dataset_or_None); else ConfigError saying what `who` must return."""
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], Dataset)):
        raise ConfigError(f"{who} must return (train_dataset, val_dataset_or_None)")
    return made
