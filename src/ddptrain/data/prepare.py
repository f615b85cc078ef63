"""`ddptrain prepare`: tokenize documents on every core into fixed-size shards, in bounded memory.

The documents are cut into tasks of about `task_bytes` of input (sources.py). Worker processes
read and tokenize whole tasks; the main process takes their results in task order, sends the last
`val_fraction` of each task's tokens to the validation split and the rest to the train split, and
streams both into shards (shards.py). At most two tasks per worker are in flight, so the peak
memory depends on the task size and the worker count, never on the corpus size.

Everything is deterministic in the inputs: a prepare that was killed and is run again writes the
same shards. One preparer at a time writes a folder (its prepare lock), into a private folder
published with meta.json last (publish.py), so a folder is usable only once a prepare has completed
into it, and a corpus is never seen half-written.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ddptrain.data.meta import FORMAT, META, parse_meta, read_meta_file
from ddptrain.data.progress import PROGRESS_EVERY_S, Ticker, WorkCounter, heartbeat
from ddptrain.data.publish import PREPARE_WAIT_S, PrepareLock, read_recipe
from ddptrain.data.sft import SftSpec, check_sft_sources, parse_sft, record_texts, tokenize_records, validation_cut
from ddptrain.data.shards import MASK_SUFFIX, ShardWriter
from ddptrain.data.sources import Task, iter_documents, plan_tasks, read_documents
from ddptrain.data.tokenizer import (
    TOKENIZER_FILE,
    Tokenizer,
    TokenizerSpec,
    load_tokenizer_file,
    sha256_file,
    train_bpe,
)
from ddptrain.errors import DataError, DdptrainError
from ddptrain.safe_files import open_new_no_follow

__all__ = ["META", "SPLITS", "CorpusInfo", "PrepareOptions", "prepare_corpus", "recipe_of"]

log = logging.getLogger(__name__)
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 1 << 26
DEFAULT_TASK_BYTES = 1 << 20
_FORCE_HINT = "prepare into a new or empty folder, move them away, or run `ddptrain prepare --out {out} --force`"
# OS errors that are the user's folder or disk, not this prepare's doing: they stay OSErrors (exit 2).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


@dataclass(frozen=True)
class CorpusInfo:
    """What `prepare` wrote (or found, when another preparer wrote it first)."""

    out_dir: Path
    files: int
    train_tokens: int
    val_tokens: int
    documents: int = 0
    vocab_size: int = 256
    shards: int = 2
    reused: bool = False  # True when another preparer made it while this one waited


@dataclass(frozen=True)
class PrepareOptions:
    """How to prepare: tokenizer, JSON Lines field, worker processes, shard and task sizes; how long to wait for
    another preparer of the same folder, and whether to prepare into a folder holding others' files (publish.py)."""

    tokenizer: str = "bytes"
    text_field: str = "text"
    workers: int = 0  # 0: one per available core
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    task_bytes: int = DEFAULT_TASK_BYTES
    wait_s: float = PREPARE_WAIT_S
    force: bool = False  # prepare into a folder holding files no prepare wrote (replacing those of its names)
    sft: str | None = None  # instruction records: "PROMPT,COMPLETION" or "MESSAGES" field names (data/sft.py)
    progress_every_s: float = PROGRESS_EVERY_S  # a line on the long work (data/progress.py) this often


# ---- worker processes -------------------------------------------------------------------------

_worker: dict[str, Any] = {}
# A task's tokens, their loss mask (instruction data only), its documents (records) and input bytes.
Tokenized = tuple[np.ndarray, np.ndarray | None, int, int]


def _init_worker(tokenizer_file: str, text_field: str, sft: SftSpec | None) -> None:
    # One single-threaded tokenizer per process: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker["tokenizer"] = load_tokenizer_file(Path(tokenizer_file))
    _worker["field"] = text_field
    _worker["sft"] = sft


def _tokenize(task: Task, tokenizer: Tokenizer, text_field: str, sft: SftSpec | None) -> Tokenized:
    if sft is not None:
        tokens, mask, records, nbytes = tokenize_records(task, sft, tokenizer)
        return tokens, mask, records, nbytes
    docs = [d for piece in task.pieces for d in read_documents(piece, text_field)]
    return tokenizer.encode_batch(docs), None, len(docs), sum(map(len, docs))


def _tokenize_in_worker(task: Task) -> Tokenized:
    return _tokenize(task, _worker["tokenizer"], _worker["field"], _worker["sft"])


def _results(
    tasks: Iterator[Task],
    tokenizer: Tokenizer,
    out_dir: Path,
    opts: PrepareOptions,
    workers: int,
    sft: SftSpec | None = None,
) -> Iterator[Tokenized]:
    """Each task's (tokens, mask, documents, input bytes), in task order."""
    if tokenizer.hf is None or workers <= 1:
        # Raw bytes need no tokenizing: reading is the whole cost, and one process does it.
        for task in tasks:
            yield _tokenize(task, tokenizer, opts.text_field, sft)
        return
    # fork, not spawn: `python -m ddptrain` would re-run the command in a spawned child. An executor,
    # not a Pool: a worker that dies (OOM-killed) fails its task with BrokenProcessPool instead of a hang.
    ctx = multiprocessing.get_context("fork")
    init_args = (str(out_dir / TOKENIZER_FILE), opts.text_field, sft)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init_args) as pool:
        pending: deque[Future[Tokenized]] = deque()
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


def _setup_tokenizer(
    spec: TokenizerSpec, files: list[Path], folder: Path, opts: PrepareOptions, say: Callable[[str], None]
) -> Tokenizer:
    target = folder / TOKENIZER_FILE
    if spec.kind == "bytes":
        return Tokenizer(None, 256, None)
    if spec.kind == "file":
        assert spec.path is not None
        shutil.copyfile(spec.path, target)
    else:
        sft = parse_sft(opts.sft, spec.path) if opts.sft is not None else None
        texts = record_texts(files, sft) if sft is not None else iter_documents(files, opts.text_field)
        read = WorkCounter()
        with heartbeat(say, lambda: read.training(spec.vocab_size), opts.progress_every_s):
            train_bpe(read.counted(texts), spec.vocab_size, target)
    return load_tokenizer_file(target)


def recipe_of(sources: list[Path], val_fraction: float, opts: PrepareOptions, spec: TokenizerSpec) -> str:
    """One SHA-256 naming what a prepare makes from what: the files (path, size, modification time), the
    validation fraction and the options that change the output (not the worker count, which does not)."""
    files = []
    for path in sources:
        try:
            st = path.stat()
        except OSError as e:
            raise DataError(f"cannot read {path}: {e.strerror}") from None
        files.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    tokenizer = sha256_file(spec.path) if spec.path is not None else opts.tokenizer
    described: list[Any] = [files, val_fraction, tokenizer, opts.text_field, opts.shard_tokens, opts.task_bytes]
    if opts.sft is not None:  # appended only here: the recipes of corpora without --sft stay as they were
        described.append(parse_sft(opts.sft, spec.path).described())
    return hashlib.sha256(json.dumps(described).encode()).hexdigest()


def prepare_corpus(
    sources: list[Path],
    out_dir: Path,
    val_fraction: float,
    options: PrepareOptions | None = None,
    *,
    reuse: Callable[[Path], bool] | None = None,
    say: Callable[[str], None] = log.warning,
) -> CorpusInfo:
    """Tokenize the files into train/val shards in out_dir: one preparer at a time, published at once.

    Holds out_dir's prepare lock, waiting up to opts.wait_s for another preparer (and saying so through
    say); Contention (exit 1) when that runs out. Under the lock, the corpus already in out_dir is
    kept when reuse(out_dir) is true; without reuse, when this call waited for another preparer and
    that one prepared the same recipe (recipe_of). Otherwise, DataError when out_dir holds files no
    prepare wrote (unless opts.force); else the corpus is written into a private folder and published
    into out_dir with meta.json last (publish.py).
    """
    opts = options or PrepareOptions()
    if not sources:
        raise DataError("no source files to prepare")
    spec = TokenizerSpec.parse(opts.tokenizer)
    if opts.sft is not None:
        check_sft_sources(sources, parse_sft(opts.sft, spec.path))
    recipe = recipe_of(sources, val_fraction, opts, spec)
    created = _missing_folders(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # its errors are the user's path (a file there, no permission)
        return _prepare_locked(sources, out_dir, val_fraction, opts, spec, recipe, reuse, say)
    except BaseException:
        _remove_empty(created)  # a refused or failed prepare leaves no folder it made
        raise


def _missing_folders(folder: Path) -> list[Path]:
    """The folders `folder.mkdir(parents=True)` would create, outermost first."""
    missing: list[Path] = []
    while not folder.exists() and not folder.is_symlink() and folder.parent != folder:
        missing.insert(0, folder)
        folder = folder.parent
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders, innermost first, while they are empty (another process's files stay)."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def _prepare_locked(
    sources: list[Path],
    out_dir: Path,
    val_fraction: float,
    opts: PrepareOptions,
    spec: TokenizerSpec,
    recipe: str,
    reuse: Callable[[Path], bool] | None,
    say: Callable[[str], None],
) -> CorpusInfo:
    """prepare_corpus's work under out_dir's prepare lock (out_dir exists)."""
    try:
        with PrepareLock(out_dir, opts.wait_s, say) as lock:
            if reuse(out_dir) if reuse is not None else (lock.waited and read_recipe(out_dir) == recipe):
                return _info_of(out_dir)
            if not opts.force:
                lock.refuse_foreign(_FORCE_HINT.format(out=out_dir))
            lock.private.mkdir()
            info = _prepare_into(sources, lock.private, val_fraction, opts, spec, recipe, say)
            lock.publish()
    except OSError as e:
        if e.errno in DISK_ERRNOS:
            raise  # the user's folder or disk: read-only, no permission, full (exit 2, as everywhere)
        # Anything else on files only this prepare writes (one vanished, an I/O error) is no bad input.
        where = f": {e.filename}" if e.filename else ""
        raise DdptrainError(f"preparing {out_dir} failed: {e.strerror or e}{where}") from e
    return replace(info, out_dir=out_dir)


def _info_of(out_dir: Path) -> CorpusInfo:
    """What the corpus already in out_dir holds (the one this call reuses: reuse() or the recipe vouched for it)."""
    meta = read_meta_file(out_dir)
    return CorpusInfo(
        out_dir,
        meta["files"],
        meta["train_tokens"],
        meta["val_tokens"],
        meta.get("documents", 0),
        meta["vocab_size"],
        sum(len(meta["shards"][s]) for s in SPLITS),
        reused=True,
    )


def _prepare_into(
    sources: list[Path],
    folder: Path,
    val_fraction: float,
    opts: PrepareOptions,
    spec: TokenizerSpec,
    recipe: str,
    say: Callable[[str], None] = log.warning,
) -> CorpusInfo:
    """The pipeline: tokenize the files into shards and meta.json in folder (a fresh, private one)."""
    sft = parse_sft(opts.sft, spec.path) if opts.sft is not None else None
    tokenizer = _setup_tokenizer(spec, sources, folder, opts, say)
    if sft is not None:
        sft = sft.for_tokenizer(tokenizer.hf.id_to_token(tokenizer.eos_id) if tokenizer.hf is not None else "")
    shards, mask_shards, documents, input_bytes = _write_shards(
        sources, folder, val_fraction, opts, tokenizer, sft, say
    )
    counts = {s: sum(x["tokens"] for x in shards[s]) for s in SPLITS}
    if counts["train"] < 1024 or counts["val"] < 256:
        raise DataError(
            f"corpus too small: {counts['train'] + counts['val']} tokens from {len(sources)} file(s); "
            "need at least ~8 KB of text"
        )
    meta = {
        "format": FORMAT,
        "tokenizer": {
            "kind": spec.kind,
            "file": TOKENIZER_FILE if tokenizer.hf is not None else None,
            "sha256": sha256_file(folder / TOKENIZER_FILE) if tokenizer.hf is not None else None,
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
        "shards": _with_masks(shards, mask_shards),
        "recipe": recipe,
        **({"sft": sft.recorded()} if sft is not None else {}),
    }
    _write_meta(folder, meta)
    return CorpusInfo(
        folder,
        len(sources),
        counts["train"],
        counts["val"],
        documents,
        tokenizer.vocab_size,
        len(shards["train"]) + len(shards["val"]),
    )


def _write_shards(
    sources: list[Path],
    folder: Path,
    val_fraction: float,
    opts: PrepareOptions,
    tokenizer: Tokenizer,
    sft: SftSpec | None,
    say: Callable[[str], None],
) -> tuple[dict[str, list[Any]], dict[str, list[Any]], int, int]:
    """Tokenize the sources into folder's train/val shards (and masks), saying how far it got every
    opts.progress_every_s: (shards, mask shards, documents, input bytes)."""
    workers = opts.workers or len(os.sched_getaffinity(0))
    writers = {s: ShardWriter(folder, s, opts.shard_tokens, tokenizer.dtype) for s in SPLITS}
    masks = {s: ShardWriter(folder, s, opts.shard_tokens, np.dtype(np.uint8), MASK_SUFFIX) for s in SPLITS}
    documents = input_bytes = 0
    done = WorkCounter(sum(t.input_bytes for t in plan_tasks(sources, opts.task_bytes)))
    planned: deque[Task] = deque()  # the tasks handed out, oldest first: results come back in their order
    tasks = _handed_out(plan_tasks(sources, opts.task_bytes), planned)
    ticker = Ticker(say, done.tokenizing, opts.progress_every_s)
    for tokens, mask, docs, nbytes in _results(tasks, tokenizer, folder, opts, workers, sft):
        cut = len(tokens) - int(len(tokens) * val_fraction) if mask is None else validation_cut(mask, val_fraction)
        writers["train"].append(tokens[:cut])
        writers["val"].append(tokens[cut:])
        if mask is not None:
            masks["train"].append(mask[:cut])
            masks["val"].append(mask[cut:])
        documents += docs
        input_bytes += nbytes
        done.done_bytes += planned.popleft().input_bytes
        ticker.tick()
    shards = {s: w.finish() for s, w in writers.items()}
    return shards, {s: w.finish() for s, w in masks.items()}, documents, input_bytes


def _handed_out(tasks: Iterator[Task], planned: deque[Task]) -> Iterator[Task]:
    """tasks, each appended to planned as it is handed out (for the progress count)."""
    for task in tasks:
        planned.append(task)
        yield task


def _with_masks(shards: dict[str, list[Any]], masks: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Each token shard's entry with its loss mask's file and SHA-256 (the mask writers cut at the same
    token counts, so the i-th mask belongs to the i-th shard); the shards alone without instruction data."""
    return {
        split: [{**shard, "mask": {"file": m["file"], "sha256": m["sha256"]}} for shard, m in zip(listed, masks[split])]
        if masks[split]
        else listed
        for split, listed in shards.items()
    }


def _write_meta(folder: Path, meta: dict[str, Any]) -> None:
    raw = json.dumps(meta, indent=1).encode()
    parse_meta(raw, folder / META)  # what readers check, checked here first: nothing is published they refuse
    with open_new_no_follow(folder / META) as f:  # folder is the preparer's fresh private one
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
