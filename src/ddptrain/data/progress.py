"""Progress of a prepare's long work (training a tokenizer, tokenizing into shards): lines on stderr, rate-limited.

What `describe()` returns is said at most every `every_s` seconds, as the training loop prints a line
per logged step: a prepare that ends within the first interval says nothing more than before, a long
one is never silent for long. Tokenizing calls Ticker.tick after each task (a thread there would be
alive when the tokenizing workers are forked); training a tokenizer is one long call, so a heartbeat
thread speaks during it (nothing forks there). The counters are updated by the work itself
(WorkCounter); nothing here changes what is prepared.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

PROGRESS_EVERY_S = 10.0


@dataclass
class WorkCounter:
    """Input bytes and documents done so far of `total_bytes` (0: unknown), and when the work started."""

    total_bytes: int = 0
    done_bytes: int = 0
    documents: int = 0
    started: float = field(default_factory=time.monotonic)
    read_all: bool = False  # counted() has passed on its last document

    def counted(self, docs: Iterable[bytes]) -> Iterator[bytes]:
        """docs, counting each one's bytes as it passes."""
        for doc in docs:
            self.documents += 1
            self.done_bytes += len(doc)
            yield doc
        self.read_all = True

    def tokenizing(self) -> str:
        """'prepare: tokenized 8.1 of 18.0 MB of input (45%), 1.2 MB/s, 0:09 left'."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = self.done_bytes / elapsed
        line = f"prepare: tokenized {_mb(self.done_bytes)} of {_mb(self.total_bytes)} MB of input"
        if self.total_bytes:
            line += f" ({min(self.done_bytes / self.total_bytes, 1.0):.0%})"
        line += f", {_mb(rate)} MB/s"
        if rate > 0 and self.total_bytes > self.done_bytes:
            line += f", {_duration((self.total_bytes - self.done_bytes) / rate)} left"
        return line

    def training(self, vocab_size: int) -> str:
        """'prepare: training a BPE of 4096 tokens: 41,000 documents (52.3 MB) read, 0:40 so far' (then 'all ...
        read, merging')."""
        elapsed = time.monotonic() - self.started
        read = f"all {self.documents:,} documents" if self.read_all else f"{self.documents:,} documents"
        merging = ", merging" if self.read_all else ""
        return (
            f"prepare: training a BPE of {vocab_size} tokens: {read} ({_mb(self.done_bytes)} MB) read{merging}, "
            f"{_duration(elapsed)} so far"
        )


class Ticker:
    """Says describe() when tick() comes every_s seconds or more after the start or the last line said."""

    def __init__(self, say: Callable[[str], None], describe: Callable[[], str], every_s: float) -> None:
        self.say, self.describe, self.every_s = say, describe, every_s
        self._next = time.monotonic() + every_s

    def tick(self) -> None:
        """A line, when one is due."""
        now = time.monotonic()
        if now >= self._next:
            self.say(self.describe())
            self._next = now + self.every_s


@contextmanager
def heartbeat(say: Callable[[str], None], describe: Callable[[], str], every_s: float) -> Iterator[None]:
    """Say describe() every every_s seconds until the block ends (never at its start: short work stays quiet)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every_s):
            say(describe())

    thread = threading.Thread(target=beat, name="prepare-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f}"


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
