"""Checksum speed: SHA-256 (hashlib), BLAKE3 on one thread and on every core, xxHash xxh3_128, in GB/s.

The algorithms a checkpoint could record (docs/checkpoints.md "Which checksum"), each hashing the
same random buffer held in memory (64 MB and 256 MB; smoke: 1 MB), interleaved per round, so the
figure is the hash alone, not the disk. Ratios are per round against SHA-256, then the median.
xxHash is reported when its package is installed (it is no dependency of ddptrain: bench only).
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

import blake3

from bench.common import Options, Row, interleave, summary

SIZES_MB = (64, 256)
SMOKE_SIZES_MB = (1,)


def hashers() -> dict[str, Callable[[memoryview], object]]:
    """name -> a function hashing a buffer once (the digest is computed, so nothing is skipped)."""
    out: dict[str, Callable[[memoryview], object]] = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "blake3 1 thread": lambda b: blake3.blake3(b).digest(),
        "blake3 all cores": lambda b: blake3.blake3(b, max_threads=blake3.blake3.AUTO).digest(),
    }
    try:
        import xxhash

        out["xxh3_128"] = lambda b: xxhash.xxh3_128(b).digest()
    except ImportError:
        pass
    return out


def measure(size_mb: int, opts: Options) -> dict[str, list[float]]:
    """GB/s per measured round of every hasher on one random buffer of size_mb MB."""
    buf = memoryview(os.urandom(size_mb << 20))

    def timed(fn: Callable[[memoryview], object]) -> Callable[[], float]:
        def once() -> float:
            t0 = time.perf_counter()
            fn(buf)
            return buf.nbytes / (time.perf_counter() - t0) / 1e9

        return once

    return interleave({name: timed(fn) for name, fn in hashers().items()}, opts)


def report(size_mb: int, speeds: dict[str, list[float]]) -> list[Row]:
    """One row per hasher: median GB/s, and its speed over SHA-256's in the same rounds."""
    rows = []
    for name, values in speeds.items():
        ratio = summary([v / s for v, s in zip(values, speeds["sha256"])])
        note = "" if name == "sha256" else f"{ratio['median']:.2f}x SHA-256"
        rows.append(Row("hashes", f"{name}, {size_mb} MB buffer", summary(values), "GB/s", "reported", None, note))
    return rows


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Every size; per-round GB/s of every hasher."""
    rows: list[Row] = []
    data: dict[str, Any] = {"cores": os.cpu_count()}
    for size in SMOKE_SIZES_MB if opts.smoke else SIZES_MB:
        speeds = measure(size, opts)
        rows += report(size, speeds)
        data[f"{size}MB"] = {"GBps": speeds}
    return rows, data


def machine_report(rounds: int, smoke: bool) -> dict[str, Any]:
    """The same figures for bench/gpu.py's report: median GB/s and ratio to SHA-256 per hasher and size."""
    opts = Options(smoke=smoke, rounds=rounds, warmup=0 if smoke else 1)
    out: dict[str, Any] = {"cores": os.cpu_count()}
    for size in SMOKE_SIZES_MB if smoke else SIZES_MB:
        speeds = measure(size, opts)
        out[f"{size}MB"] = {
            name: {
                "GBps": summary(values),
                "vs_sha256": summary([v / s for v, s in zip(values, speeds["sha256"])]),
            }
            for name, values in speeds.items()
        }
    return out
