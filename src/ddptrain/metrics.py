"""Metrics sinks and terminal progress. Only rank 0 writes shared files or prints.

`metrics.jsonl` gets one JSON object per logged step (`"kind": "train"`), per evaluation
(`"kind": "eval"`), and per notable event (`"kind": "event"`: start, resume, checkpoint, ...).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from ddptrain.runlog import log_message


def _clean(value: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so the file stays parseable everywhere.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Appends records to run.dir/metrics.jsonl (and TensorBoard when enabled)."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool = False) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self._file: TextIO | None = None
        self._tb = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        # Line-buffered append: a crash loses at most the line being written, and a resumed
        # run continues the same file.
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # optional extra: ddptrain[tensorboard]

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, kind: str, **fields: Any) -> None:
        """One record; numeric fields also go to TensorBoard under kind/name."""
        if not self.enabled or self._file is None:
            return
        record = {"kind": kind, "time": round(time.time(), 3), **{k: _clean(v) for k, v in fields.items()}}
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None and "step" in fields:
            for k, v in fields.items():
                if _is_number(v) and k != "step":
                    self._tb.add_scalar(f"{kind}/{k}", v, fields["step"])
                elif isinstance(v, list) and v and all(map(_is_number, v)):  # per-rank values
                    self._tb.add_scalars(f"{kind}/{k}", {f"rank{i}": x for i, x in enumerate(v)}, fields["step"])

    def close(self) -> None:
        """Flush and close the sinks."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class Progress:
    """A progress bar on a TTY, plain periodic lines otherwise (logs, CI, SLURM output).

    Only the enabled (rank 0) instance prints; every rank's instance also writes its lines to
    that rank's log file (see runlog.py).
    """

    def __init__(self, enabled: bool, total: int, initial: int, stream: TextIO = sys.stdout) -> None:
        self.enabled = enabled
        self.stream = stream
        self.total = total
        self.bar = None
        self._first: tuple[float, int] | None = None  # (time, step) of the first update, for the ETA
        if enabled and stream.isatty():
            self.bar = tqdm(total=total, initial=initial, file=stream, dynamic_ncols=True, unit="step")

    def eta_s(self, step: int) -> float | None:
        """Seconds left at the mean pace since the first update of this process (None before two updates)."""
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step)
            return None
        t0, s0 = self._first
        return (now - t0) / (step - s0) * (self.total - step) if step > s0 else None

    def update(self, step: int, fields: dict[str, Any]) -> None:
        """Show a logged step's headline numbers (the bar shows its own rate and ETA)."""
        summary = "  ".join(_format(k, v) for k, v in fields.items())
        eta = self.eta_s(step)
        line = f"step {step:>6}/{self.total}  {summary}" + (f"  eta {_duration(eta)}" if eta is not None else "")
        log_message(line)
        if not self.enabled:
            return
        if self.bar is not None:
            if eta is None:
                # The first shown step: restart the bar's clock here, so that its rate and ETA count
                # only steps this process trained (not a resume's jump, nor start-up time).
                self.bar.reset()
                self.bar.initial = self.bar.n = self.bar.last_print_n = step
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(summary, refresh=True)
        else:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line of text that does not break the bar."""
        log_message(text)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _format(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key == "lr":
            return f"{key} {value:.2e}"
        if key == "mfu":
            return f"{key} {value:.1%}"
        if key.endswith("_per_s"):
            return f"{key} {value:,.1f}" if value < 100 else f"{key} {value:,.0f}"
        return f"{key} {value:.4f}" if abs(value) < 100 else f"{key} {value:,.0f}"
    return f"{key} {value}"
