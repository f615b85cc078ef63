"""TensorBoard event files in run.dir/tensorboard (the SummaryWriter has its own writer thread)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddptrain.config import Config
from ddptrain.observe.endings import describe, is_end_record
from ddptrain.observe.trackers.base import _is_number
from ddptrain.observe.trackers.state import TrackerState
from ddptrain.run_folder import tensorboard_dir


def build(cfg: Config, state: TrackerState | None) -> TensorBoardSink:
    """The TensorBoard sink of a run (local files: no tracker state)."""
    return TensorBoardSink(cfg.run_dir)


class TensorBoardSink:
    """Numeric fields as scalars "<kind>/<field>"; per-rank lists as one chart with a line per rank; an
    attempt's end as text ("ending")."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # optional extra: ddptrain[tensorboard]

        self._writer: Any = SummaryWriter(str(tensorboard_dir(run_dir)))

    def write(self, record: dict[str, Any]) -> None:
        """Add the record's numbers at its step (records without a step are not plotted)."""
        if "step" not in record:
            return
        kind, step = record["kind"], record["step"]
        if is_end_record(record):  # how the attempt ended, in the Text tab at its last step
            self._writer.add_text("ending", describe(record), step)
        for k, v in record.items():
            if k in ("step", "time"):
                continue
            if _is_number(v):
                self._writer.add_scalar(f"{kind}/{k}", v, step)
            elif isinstance(v, list) and v and all(map(_is_number, v)):  # per-rank values
                self._writer.add_scalars(f"{kind}/{k}", {f"rank{i}": x for i, x in enumerate(v)}, step)

    def upload(self, folder: Path, kind: str) -> None:
        """TensorBoard keeps no files: nothing to do."""

    def close(self, status: str) -> None:
        """Flush and close the event file."""
        self._writer.close()
