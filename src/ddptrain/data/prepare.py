"""`ddptrain prepare`: tokenize documents on every core into fixed-size shards, in bounded memory.

The documents are cut into tasks of about `task_bytes` of input (sources.py). Worker processes
read and tokenize whole tasks; the main process takes their results in task order, sends the last
`val_fraction` of each task's tokens to the validation split and the rest to the train split, and
streams both into shards (shards.py). At most two tasks per worker are in flight, so the peak
memory depends on the task size and the worker count, never on the corpus size.

Everything is deterministic in the inputs: a prepare that was killed and is run again rewrites the
same shards. `meta.json` is removed first and written last, so a folder is usable only once a
prepare has completed into it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.data.shards import ShardWriter
from ddptrain.data.sources import Task, iter_documents, plan_tasks, read_documents
from ddptrain.data.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerSpec,
    load_tokenizer_file,
    sha256_file,
    train_bpe,
)
from ddptrain.errors import DataError

META = "meta.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 26
DEFAULT_TASK_BYTES = 1 << 20


@dataclass(frozen=True)
class CorpusInfo:
    """What `prepare` wrote."""

    out_dir: Path
    files: int
    train_tokens: int
    val_tokens: int
    documents: int = 0
    vocab_size: int = 256
    shards: int = 2


@dataclass(frozen=True)
class PrepareOptions:
    """How to prepare: tokenizer, JSON Lines field, worker processes, shard and task sizes."""

    tokenizer: str = "bytes"
    jsonl_field: str = "text"
    workers: int = 0  # 0: one per available core
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    task_bytes: int = DEFAULT_TASK_BYTES


# ---- worker processes -------------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer_file: str, jsonl_field: str) -> None:
    # One single-threaded tokenizer per process: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker["tokenizer"] = load_tokenizer_file(Path(tokenizer_file))
    _worker["field"] = jsonl_field


def _tokenize(task: Task, tokenizer: Tokenizer, jsonl_field: str) -> tuple[np.ndarray, int, int]:
    docs = [d for piece in task.pieces for d in read_documents(piece, jsonl_field)]
    return tokenizer.encode_batch(docs), len(docs), sum(map(len, docs))


def _tokenize_in_worker(task: Task) -> tuple[np.ndarray, int, int]:
    return _tokenize(task, _worker["tokenizer"], _worker["field"])


def _results(
    tasks: Iterator[Task], tokenizer: Tokenizer, out_dir: Path, opts: PrepareOptions, workers: int
) -> Iterator[tuple[np.ndarray, int, int]]:
    """Each task's (tokens, documents, input bytes), in task order."""
    if tokenizer.hf is None or workers <= 1:
        # Raw bytes need no tokenizing: reading is the whole cost, and one process does it.
        for task in tasks:
            yield _tokenize(task, tokenizer, opts.jsonl_field)
        return
    # fork, not spawn: `python -m ddptrain` would re-run the command in a spawned child. An executor,
    # not a Pool: a worker that dies (OOM-killed) fails its task with BrokenProcessPool instead of a hang.
    ctx = multiprocessing.get_context("fork")
    init_args = (str(out_dir / TOKENIZER_FILE), opts.jsonl_field)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque[Future[tuple[np.ndarray, int, int]]] = deque()
        try:
            for task in tasks:
                pending.append(pool.submit(_tokenize_in_worker, task))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise DataError("a tokenizing worker process died (out of memory?); run prepare again") from None
        finally:
            for f in pending:
                f.cancel()


# ---- the pipeline -------------------------------------------------------------------------------


def _setup_tokenizer(spec: TokenizerSpec, files: list[Path], out_dir: Path, jsonl_field: str) -> Tokenizer:
    target = out_dir / TOKENIZER_FILE
    if spec.kind == "bytes":
        target.unlink(missing_ok=True)
        return Tokenizer(None, 256, None)
    if spec.kind == "file":
        assert spec.path is not None
        if spec.path.resolve() != target.resolve():
            tmp = out_dir / f".{TOKENIZER_FILE}.{os.getpid()}.tmp"
            shutil.copyfile(spec.path, tmp)
            os.replace(tmp, target)
    else:
        train_bpe(iter_documents(files, jsonl_field), spec.vocab_size, target)
    return load_tokenizer_file(target)


def _clear_leftovers(out_dir: Path, keep: set[str]) -> None:
    """Temporary files of an interrupted prepare, and shards or legacy files this prepare did not write."""
    for p in out_dir.iterdir():
        stale_shard = p.suffix == ".bin" and p.name.split("-")[0] in SPLITS and p.name not in keep
        legacy = p.name in ("train.bin", "val.bin")
        if p.is_file() and (p.name.endswith(".tmp") or stale_shard or legacy):
            p.unlink()


def prepare_corpus(
    sources: list[Path], out_dir: Path, val_fraction: float, options: PrepareOptions | None = None
) -> CorpusInfo:
    """Tokenize the files into train/val shards in out_dir with meta.json written last."""
    opts = options or PrepareOptions()
    if not sources:
        raise DataError("no source files to prepare")
    spec = TokenizerSpec.parse(opts.tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META).unlink(missing_ok=True)  # the folder is incomplete until meta.json is back
    _clear_leftovers(out_dir, keep={p.name for p in out_dir.iterdir()})
    tokenizer = _setup_tokenizer(spec, sources, out_dir, opts.jsonl_field)
    workers = opts.workers or len(os.sched_getaffinity(0))
    writers = {s: ShardWriter(out_dir, s, opts.shard_tokens, tokenizer.dtype) for s in SPLITS}
    documents = input_bytes = 0
    for tokens, docs, nbytes in _results(plan_tasks(sources, opts.task_bytes), tokenizer, out_dir, opts, workers):
        n_val = int(len(tokens) * val_fraction)
        writers["train"].append(tokens[: len(tokens) - n_val])
        writers["val"].append(tokens[len(tokens) - n_val :])
        documents += docs
        input_bytes += nbytes
    shards = {s: w.finish() for s, w in writers.items()}
    counts = {s: sum(x["tokens"] for x in shards[s]) for s in SPLITS}
    _clear_leftovers(out_dir, keep={x["file"] for s in SPLITS for x in shards[s]})
    if counts["train"] < 1024 or counts["val"] < 256:
        raise DataError(
            f"corpus too small: {counts['train'] + counts['val']} tokens from {len(sources)} file(s); "
            "need at least ~8 KB of text"
        )
    tok_file = out_dir / TOKENIZER_FILE
    meta = {
        "format": 2,
        "tokenizer": {
            "kind": spec.kind,
            "file": TOKENIZER_FILE if tokenizer.hf is not None else None,
            "sha256": sha256_file(tok_file) if tokenizer.hf is not None else None,
        },
        "vocab_size": tokenizer.vocab_size,
        "dtype": tokenizer.dtype.name,
        "eos_id": tokenizer.eos_id,
        "files": len(sources),
        "documents": documents,
        "input_bytes": input_bytes,
        "shard_tokens": opts.shard_tokens,
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "shards": shards,
    }
    tmp = out_dir / f".{META}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out_dir / META)
    return CorpusInfo(
        out_dir,
        len(sources),
        counts["train"],
        counts["val"],
        documents,
        tokenizer.vocab_size,
        len(shards["train"]) + len(shards["val"]),
    )
