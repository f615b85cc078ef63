"""What data a rank trains on, and the start-up check that every rank trains on the same.

Each node reads its own `data.dir` (or builds the user's datasets itself), so two ranks can be
handed different data without noticing: a wrapper choosing `data.dir` per node, nodes whose
Python versions give different default corpora. The global sampler then silently skips and
repeats samples. At start every rank describes its data; all ranks compare the descriptions
and a mismatch stops every rank with exit 2, naming the hosts and what differs. A prepared
corpus is described after its bytes were verified against its meta.json (data/verify.py); a rank
whose shards fail that stops every rank, with the shard's line and the rank that found it.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterator, Sized
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from ddptrain.data.corpus import corpus_fingerprint, read_meta
from ddptrain.data.stream import is_stateful
from ddptrain.data.verify import verify_corpus
from ddptrain.dist import DistContext, all_gather_object
from ddptrain.errors import DataError

# Samples read for a user dataset's fingerprint, as fractions of its length: first, middle, last.
_PROBES = (0.0, 0.5, 1.0)


def corpus_identity(data_dir: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A prepared corpus: its SHA-256 (of the shards' hashes), token counts and tokenizer, after its bytes were
    verified against meta.json (data/verify.py); `bad_data` says why they are not (None when they are).
    meta: the corpus's read_meta, when already read."""
    meta = read_meta(data_dir) if meta is None else meta
    try:
        verify_corpus(data_dir, meta)
        bad_data = None
    except DataError as e:  # told to every rank by the identity exchange: all of them stop with this line
        bad_data = str(e)
    tokenizer = meta["tokenizer"]
    return {
        "sha256": corpus_fingerprint(meta),
        "train_tokens": meta["train_tokens"],
        "val_tokens": meta["val_tokens"],
        "tokenizer": f"{tokenizer['kind']}/{meta['dtype']}",
        "tokenizer_sha256": tokenizer["sha256"],
        "vocab_size": meta["vocab_size"],
        "bad_data": bad_data,
    }


def datasets_identity(train: Dataset[Any], val: Dataset[Any] | None, source: str | None = None) -> dict[str, Any]:
    """A user's datasets: their lengths and a fingerprint of a few fixed samples (of a stream, an
    IterableDataset: its first few items; no length).

    The samples are read with every random stream saved and restored, so that a dataset with random
    augmentation gives the same fingerprint on every rank (they are all seeded alike here) and
    reading it does not shift the run's random streams; a stateful stream gets its own state back.
    """
    stream = train if isinstance(train, IterableDataset) else None
    identity: dict[str, Any] = {
        "source": source,
        "train_len": None if stream is not None else _length(train),
        "val_len": None if val is None else _length(val, "validation"),
    }
    digest = hashlib.sha256()
    with _saved_random_state():
        for item in _first_items(stream) if stream is not None else ():
            _feed(digest, item)
        for dataset in (val,) if stream is not None else (train, val):
            n = identity["train_len"] if dataset is train else identity["val_len"]
            for index in sorted({round(f * (n - 1)) for f in _PROBES}) if n else ():
                _feed(digest, dataset[index])  # type: ignore[index]  # n > 0 only for a dataset present
    identity["fingerprint"] = digest.hexdigest()[:16]
    return identity


def _first_items(stream: IterableDataset[Any]) -> list[Any]:
    """The stream's first few items, the stream's own state (if it keeps one) put back after reading them."""
    saved = stream.state_dict() if is_stateful(stream) else None  # type: ignore[attr-defined]
    items = list(itertools.islice(iter(stream), len(_PROBES)))
    if saved is not None:
        stream.load_state_dict(saved)  # type: ignore[attr-defined]
    return items


def agree_on_data(ctx: DistContext, identity: dict[str, Any]) -> None:
    """Collective (every rank, at start): DataError on every rank unless all ranks describe the same data."""
    check_same_data(all_gather_object(ctx, identity), ctx.hosts)


def check_same_data(every: list[dict[str, Any]], hosts: tuple[str, ...]) -> None:
    """DataError naming the first rank whose data failed its own check (`bad_data`), else the first whose data
    differs from rank 0's, its host and the differing keys."""
    hosts = hosts if len(hosts) == len(every) else tuple("?" for _ in every)
    bad = [rank for rank, identity in enumerate(every) if identity.get("bad_data")]
    if bad:
        line = every[bad[0]]["bad_data"]
        if len(every) > 1:  # which rank found it: on a shared filesystem every rank, else that node's copy
            who = "every rank" if len(bad) == len(every) else f"rank {bad[0]} ({hosts[bad[0]]})"
            line = f"{who}: {line}"
        raise DataError(line)
    differing = [rank for rank, other in enumerate(every) if other != every[0]]
    if not differing:
        return
    first = differing[0]
    keys = sorted(k for k in set(every[0]) | set(every[first]) if every[0].get(k) != every[first].get(k))
    detail = "; ".join(
        f"{k}: {every[0].get(k)!r} on rank 0 ({hosts[0]}) vs {every[first].get(k)!r} on rank {first} ({hosts[first]})"
        for k in keys
    )
    raise DataError(
        f"ranks see different training data ({len(differing)} of {len(every)} differ from rank 0): {detail}; "
        "give every rank the same data.dir contents (prepare once on a shared filesystem, or copy it)"
    )


def _length(dataset: Dataset[Any], which: str = "training") -> int:
    if isinstance(dataset, Sized):
        return len(dataset)
    name = type(dataset).__name__
    if which == "validation":
        raise DataError(f"validation dataset {name} has no len(): give a map-style validation set, or None")
    raise DataError(f"dataset {name} has no len() and is no IterableDataset: ddptrain needs one or the other")


def _feed(digest: Any, value: Any) -> None:
    """Hash a sample: tensors and arrays by dtype, shape and bytes; containers item by item."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, np.ndarray):
        digest.update(f"A{value.dtype}{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            digest.update(f"K{key}".encode())
            _feed(digest, value[key])
    elif isinstance(value, (list, tuple)):
        digest.update(f"L{len(value)}".encode())
        for item in value:
            _feed(digest, item)
    else:
        digest.update(f"V{type(value).__name__}:{value!r}".encode())


@contextmanager
def _saved_random_state() -> Iterator[None]:
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
