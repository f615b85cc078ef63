"""A weighted mixture of datasets as one stream whose every global batch holds each source's share.

The stream is a function of the global sample position p alone (the sampler's position, which the
checkpoint holds and which does not depend on the world size), so a mixture resumes exactly at any
world size with no state of its own:

- Global batch k (positions kB .. kB+B-1) gives source s a quota of floor(w_s B) or floor(w_s B) + 1
  samples: the B - sum floor(w_s B) extra seats are a pfair schedule of the fractional parts (quotas()),
  so each batch is within one sample of every weight and so are the running totals
  (tests/unit/test_mixture.py checks both).
- Within the batch the sources are spread evenly (slot j goes to the source whose quota is least
  served at j), so each rank's contiguous slice holds a mix, not one source.
- The n-th sample taken from source s is, in that source's own epoch n // len_s (a seeded
  permutation per source and epoch), its sample n % len_s. A source used up simply starts its next
  epoch: its epoch count is in `taken()` and the trainer logs each new one.

Weights are exact fractions of their sum, so every rank and every DataLoader worker computes the
same quotas (no float rounding can differ).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, Dataset

from ddptrain.errors import ConfigError

log = logging.getLogger(__name__)
_CACHE_EVERY = 1024  # batches between the running totals kept for random access
SOURCE_VAL_LOSS = "val_loss/"  # an evaluation record's key of one source's own val loss: val_loss/<name>


@dataclass(frozen=True)
class MixturePart:
    """One source of a mixture: a name (for logs and metrics), its dataset and its weight (> 0)."""

    name: str
    dataset: Dataset[Any]
    weight: float


class MixtureSchedule:
    """Which source fills each slot of each global batch: a pure function of the weights and B."""

    def __init__(self, weights: Sequence[float], global_batch: int) -> None:
        if not weights or any(not (w > 0 and w != float("inf")) for w in weights):
            raise ConfigError(f"mixture weights must be positive and finite, got {list(weights)}")
        total = sum(Fraction(w) for w in weights)
        shares = [Fraction(w) / total * global_batch for w in weights]  # w_s B, exactly
        # In units of 1/D (D: the shares' common denominator) every comparison below is between integers.
        self.unit = math.lcm(*(share.denominator for share in shares))
        self.shares = [int(share * self.unit) for share in shares]
        self.base = [int(share) for share in shares]  # floor(w_s B): shares are >= 0
        self.global_batch = global_batch
        self._totals: dict[int, tuple[int, ...]] = {0: (0,) * len(weights)}  # batch -> taken before it
        self._recent = (0, self._totals[0])  # the last totals computed: batches are mostly read in order

    def quotas(self, batch: int, taken: Sequence[int]) -> list[int]:
        """Samples of each source in global batch `batch`, given the totals taken before it.

        Each source gets floor(w_s B) or one more; the extra seats are scheduled as a proportionate-fair
        (pfair) schedule of the fractional parts r_s: earliest pseudo-deadline first among the sources a seat
        would not put a whole sample ahead. That keeps every running total within one sample of w_s B per batch
        (the greedy "most behind first" it replaces drifted past one with four sources, found by hypothesis).
        """
        extra = self.global_batch - sum(self.base)
        frac = [share - self.unit * base for share, base in zip(self.shares, self.base)]  # r_s, in units

        def lag(s: int) -> int:  # r_s (batch + 1) - extra seats s had so far, in units: behind after this batch
            return frac[s] * (batch + 1) - self.unit * (taken[s] - self.base[s] * batch)

        def deadline(s: int) -> tuple[int, int, int]:  # the batch by which s must have its next seat
            seats = taken[s] - self.base[s] * batch
            return (-(-self.unit * (seats + 1) // frac[s]), -frac[s], s)

        eligible = sorted((s for s in range(len(frac)) if frac[s] and lag(s) > 0), key=deadline)
        rest = sorted((s for s in range(len(frac)) if s not in eligible), key=lambda s: (-lag(s), s))
        chosen = set((eligible + rest)[:extra])
        return [b + (s in chosen) for s, b in enumerate(self.base)]

    def taken_before(self, batch: int) -> tuple[int, ...]:
        """Samples taken from each source by the global batches before `batch`."""
        start = max(k for k in self._totals if k <= batch)
        if start <= self._recent[0] <= batch:
            start = self._recent[0]
        taken = self._recent[1] if start == self._recent[0] else self._totals[start]
        for k in range(start, batch):
            taken = tuple(t + q for t, q in zip(taken, self.quotas(k, taken)))
            if (k + 1) % _CACHE_EVERY == 0:
                self._totals[k + 1] = taken
        self._recent = (batch, taken)
        return taken

    def layout(self, batch: int) -> list[tuple[int, int]]:
        """(source, n) for each slot of global batch `batch`: n counts that source's samples over the whole stream."""
        taken = self.taken_before(batch)
        quotas = self.quotas(batch, taken)
        placed = [0] * len(quotas)
        slots = []
        for j in range(self.global_batch):
            # the source whose quota is least served after j+1 slots (integers: q_s (j+1) - B placed_s)
            s = max(range(len(quotas)), key=lambda s: (quotas[s] * (j + 1) - self.global_batch * placed[s], -s))
            slots.append((s, taken[s] + placed[s]))
            placed[s] += 1
        return slots


class MixtureDataset(Dataset[Any]):
    """Sample p of the mixture's stream (p: a global position, see module docstring). Its length is one
    nominal epoch (all sources' samples once); the sampler continues the positions across epochs."""

    sample_order = "stream"  # what the trainer's sampler yields: positions, never reshuffled

    def __init__(self, parts: Sequence[MixturePart], global_batch: int, seed: int) -> None:
        self.parts = list(parts)
        self.schedule = MixtureSchedule([p.weight for p in parts], global_batch)
        self.seed = seed
        self.sizes = [len(p.dataset) for p in parts]  # type: ignore[arg-type]  # map-style datasets
        empty = [p.name for p, n in zip(parts, self.sizes) if n < 1]
        if empty:
            raise ConfigError(f"data.sources: {', '.join(empty)} has no samples")
        self._layout: tuple[int, list[tuple[int, int]]] | None = None
        self._orders: dict[tuple[int, int], np.ndarray] = {}
        self._epochs_logged: dict[str, int] = {}
        per_sample = {getattr(p.dataset, "tokens_per_sample", None) for p in parts}
        self.tokens_per_sample = per_sample.pop() if len(per_sample) == 1 else None

    def __len__(self) -> int:
        return sum(self.sizes)

    def source_of(self, position: int) -> tuple[int, int]:
        """(source, sample index in that source's dataset) of stream position `position`."""
        batch, slot = divmod(position, self.schedule.global_batch)
        if self._layout is None or self._layout[0] != batch:
            self._layout = (batch, self.schedule.layout(batch))
        source, n = self._layout[1][slot]
        epoch, offset = divmod(n, self.sizes[source])
        return source, int(self._order(source, epoch)[offset])

    def __getitem__(self, position: int) -> Any:
        source, index = self.source_of(position)
        return self.parts[source].dataset[index]

    def taken(self, batches: int) -> dict[str, int]:
        """Samples each source gave to the first `batches` global batches, by name (cumulative)."""
        return {p.name: n for p, n in zip(self.parts, self.schedule.taken_before(batches))}

    def epochs(self, batches: int) -> dict[str, int]:
        """The epoch each source is in after `batches` global batches (0: its first pass)."""
        taken = self.schedule.taken_before(batches)
        return {p.name: n // size for p, n, size in zip(self.parts, taken, self.sizes)}

    def stream_record(self, batches: int) -> dict[str, Any]:
        """For the logged step after `batches` global batches: each source's samples so far (`source_samples`);
        logs each source that started a new epoch since the last call (a used-up source repeats)."""
        if not self._epochs_logged:  # the first logged step of this process (maybe a resume): since the step before
            self._epochs_logged = self.epochs(max(0, batches - 1))
        for name, epoch in self.epochs(batches).items():
            if epoch > self._epochs_logged[name]:
                log.info(
                    "data source %s starts its epoch %d (a pass over its samples ended) by step %d",
                    name,
                    epoch,
                    batches,
                )
            self._epochs_logged[name] = epoch
        return {"source_samples": self.taken(batches)}

    def _order(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._orders:
            if len(self._orders) > 8:  # a worker moves forward: older epochs are not read again
                self._orders.clear()
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1009 + source)
            self._orders[key] = torch.randperm(self.sizes[source], generator=g).numpy()  # numpy: faster to index
        return self._orders[key]


class MixtureValidation(ConcatDataset[Any]):
    """A mixture's validation sets one after another (what val_loss reads, as before), each also known by its
    source's name: the trainer adds each source's own loss (`val_loss/<name>`)."""

    def __init__(self, named: Sequence[tuple[str, Dataset[Any]]]) -> None:
        super().__init__([dataset for _, dataset in named])
        self.named = list(named)
