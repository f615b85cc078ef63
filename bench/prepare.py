"""`ddptrain prepare` with a BPE tokenizer: throughput, peak memory, and the data stall of training on it.

- Throughput: `prepare_corpus` (worker processes, one per core, reading files and writing shards)
  against the `tokenizers` library's own `encode_batch` on the same texts, already in memory, in
  one process with all its threads. Same tokenizer (a BPE of 8192 trained once on the corpus). The
  same texts as rows of one Parquet file (row groups of 16 documents) give the Parquet row.
- Peak memory: a `ddptrain prepare` child on a generated corpus and on one 10x larger (the kernel's
  ru_maxrss of the child and its workers), as text files and as one Parquet file.
- Data stall: bench/data.py's end-to-end measurement on the BPE shards with the built-in GPT.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Options, Row, interleave, summary
from ddptrain.data.corpus import PrepareOptions, prepare_corpus, stdlib_sources
from ddptrain.data.tokenizer import load_tokenizer_file

VOCAB = 8192


def _sources(opts: Options) -> list[Path]:
    files = stdlib_sources()
    return files[:40] if opts.smoke else files


def _generated_corpus(folder: Path, files: int, file_kb: int, lines: list[str]) -> Path:
    """`files` files of ~file_kb KB, each a distinct shuffle of standard-library lines."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        random.Random(i).shuffle(lines)
        text, size = [], 0
        for ln in lines:
            text.append(ln)
            size += len(ln) + 1
            if size > file_kb << 10:
                break
        (folder / f"doc{i:04d}.txt").write_text("\n".join(text))
    return folder


def _size(kb: int) -> str:
    return f"{kb >> 10} MB" if kb >= 1024 else f"{kb} KB"


def _as_parquet(texts: list[str], path: Path, rows_per_group: int) -> Path:
    """The texts as the rows of one Parquet file's `text` column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path, row_group_size=rows_per_group)
    return path


def _peak_rss_mb(jobs: list[tuple[Path, Path]], tokenizer: Path) -> list[float]:
    """A `ddptrain prepare CORPUS --out OUT` child per job, all started at once (each its own process tree);
    each one's peak RSS (the kernel's ru_maxrss of the child and its workers)."""
    cmds = [[sys.executable, "-m", "ddptrain", "prepare", str(c), "--out", str(o), "--tokenizer", str(tokenizer)]
            for c, o in jobs]  # fmt: skip
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for cmd in cmds]
    peaks = []
    for cmd, proc in zip(cmds, procs):
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed")
        peaks.append(usage.ru_maxrss / 1024)
    return peaks


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Throughput ratio, peak RSS at 1x and 10x, and the data stall on BPE shards."""
    from bench import data

    work = opts.work_dir / "prepare"
    shutil.rmtree(work, ignore_errors=True)
    files = _sources(opts)
    bpe_dir = work / "bpe"
    t0 = time.perf_counter()
    info = prepare_corpus(files, bpe_dir, 0.05, PrepareOptions(tokenizer=f"train:{VOCAB}"))
    first_s = time.perf_counter() - t0
    tokenizer_file = bpe_dir / "tokenizer.json"
    tokens = info.train_tokens + info.val_tokens
    texts = [p.read_text(errors="replace") for p in files]
    hf = load_tokenizer_file(tokenizer_file).hf

    def ours() -> float:
        t = time.perf_counter()
        prepare_corpus(files, work / "again", 0.05, PrepareOptions(tokenizer=str(tokenizer_file)))
        return tokens / (time.perf_counter() - t)

    def library() -> float:
        t = time.perf_counter()
        n = sum(len(e.ids) + 1 for e in hf.encode_batch(texts, add_special_tokens=False))
        return n / (time.perf_counter() - t)

    parquet = _as_parquet(texts, work / "parquet" / "docs.parquet", rows_per_group=16)

    def ours_parquet() -> float:
        t = time.perf_counter()
        prepare_corpus([parquet], work / "again-parquet", 0.05, PrepareOptions(tokenizer=str(tokenizer_file)))
        return tokens / (time.perf_counter() - t)

    t = interleave({"prepare": ours, "prepare_parquet": ours_parquet, "encode_batch": library}, opts)
    ratio = summary([a / b for a, b in zip(t["prepare"], t["encode_batch"])])
    parquet_ratio = summary([a / b for a, b in zip(t["prepare_parquet"], t["encode_batch"])])

    lines = [ln for p in files[:20] for ln in p.read_text(errors="replace").splitlines()]
    n_files, file_kb = (1, 64) if opts.smoke else (4, 1024)  # smoke: the code path, not the figure
    small = _generated_corpus(work / "gen-1x", n_files, file_kb, lines)
    large = _generated_corpus(work / "gen-10x", 10 * n_files, file_kb, lines)
    parquet = [_as_parquet([p.read_text() for p in sorted(g.iterdir())], work / f"{g.name}.parquet", 1) for g in (small, large)]  # fmt: skip
    rss_1, rss_10, *rss_pq = _peak_rss_mb(
        [(small, work / "out-1x"), (large, work / "out-10x"), *((pq, work / f"out-{pq.stem}-pq") for pq in parquet)],
        tokenizer_file,
    )
    size, size_10 = _size(n_files * file_kb), _size(10 * n_files * file_kb)

    stall_rows, stall_data = data.measure(dataclasses.replace(opts, data_dir=bpe_dir), "data-run", [], "")
    stall = next(r for r in stall_rows if r.unit == "%")
    shutil.rmtree(work, ignore_errors=True)
    rows = [
        Row(
            "prepare",
            "tokens/s of prepare (workers) / tokenizers encode_batch (all threads)",
            ratio,
            "x",
            ">= 0.8",
            ratio["median"] >= 0.8,
            f"prepare {summary(t['prepare'])['median']:,.0f} tokens/s, encode_batch "
            f"{summary(t['encode_batch'])['median']:,.0f}; {len(files)} files, {tokens:,} tokens, BPE {VOCAB} "
            f"(first prepare incl. training the BPE: {first_s:.1f} s)",
        ),
        Row(
            "prepare",
            "tokens/s of prepare from one Parquet file (workers) / tokenizers encode_batch (all threads)",
            parquet_ratio,
            "x",
            ">= 0.8",
            parquet_ratio["median"] >= 0.8,
            f"prepare from Parquet {summary(t['prepare_parquet'])['median']:,.0f} tokens/s; the same texts as rows, "
            "row groups of 16 documents",
        ),
        Row(
            "prepare",
            f"peak RSS of prepare from Parquet, {size_10} / {size} (rows of ~{_size(file_kb)})",
            {"median": rss_pq[1] / rss_pq[0], "min": rss_pq[1] / rss_pq[0], "max": rss_pq[1] / rss_pq[0], "n": 1},
            "x",
            "< 1.5",
            rss_pq[1] / rss_pq[0] < 1.5,
            f"{rss_pq[0]:.0f} MB at 1x, {rss_pq[1]:.0f} MB at 10x (child and its workers)",
        ),
        Row(
            "prepare",
            f"peak RSS of prepare, {size_10} corpus / {size} corpus",
            {"median": rss_10 / rss_1, "min": rss_10 / rss_1, "max": rss_10 / rss_1, "n": 1},
            "x",
            "< 1.5",
            rss_10 / rss_1 < 1.5,
            f"{rss_1:.0f} MB at 1x, {rss_10:.0f} MB at 10x (child and its workers)",
        ),
        Row(
            "prepare",
            "end-to-end data stall on BPE shards, built-in GPT",
            stall.stats,
            "%",
            "<= 1%",
            stall.stats is not None and stall.stats["median"] <= 1,
            stall.note,
        ),
    ]
    return rows, {
        "tokens_per_s": t,
        "rss_mb": {"1x": rss_1, "10x": rss_10, "parquet_1x": rss_pq[0], "parquet_10x": rss_pq[1]},
        "stall": stall_data,
    }
