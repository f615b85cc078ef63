"""The resume certificate: on every logged step, a cheap digest of the training state and the samples consumed.

Rank 0 appends one line per logged step to `run.dir/certificate.jsonl`: per parameter and per
optimizer-state tensor, a float64 sum and the exact digest of observe/digest.py (the one the
replica check compares across ranks: any flipped bit changes it), the global sample positions consumed
since the previous record with a CRC-32 of their ids, and the logged loss. The digest is computed on
the device and read with one transfer, only on logged steps (which synchronize anyway). `ddptrain
verify-resume` (verify_resume.py) replays steps from a checkpoint and compares its own digests with
these.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ddptrain.data.sampler import DataPosition
from ddptrain.errors import UserError
from ddptrain.observe.digest import named_state, state_digests
from ddptrain.run_folder import certificate_file
from ddptrain.safe_files import check_regular_or_absent, open_append_no_follow, read_regular_file


def state_digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[float | int]]:
    """name -> [sum, exact digest] for every parameter and optimizer-state tensor (one device-to-host copy).

    The exact digest (observe/digest.py, the replica check's) decides "the same state"; the float64 sum
    measures how far two states drifted (a replay at another world size). Under FSDP (DTensor) rank 0
    digests its own shard: reading the full tensor would be a collective that only rank 0 enters.
    """
    tensors = named_state(model, optimizer)
    if not tensors:
        return {}
    device = tensors[0][1].device
    sums = torch.stack(
        [
            (t.to_local() if isinstance(t, DTensor) else t).detach().sum(dtype=torch.float64).to(device)
            for _, t in tensors
        ]
    )
    exact = state_digests(tensors, device).view(torch.float64)  # the int64 bits ride in the same copy
    both = torch.stack([sums, exact]).cpu()
    return {name: [s, d] for (name, _), s, d in zip(tensors, both[0].tolist(), both[1].view(torch.int64).tolist())}


def consumed(sampler: DataPosition, steps: int) -> tuple[list[list[int]], int]:
    """The (epoch, from, to) position segments of the last `steps` global batches, and the CRC-32 of their ids."""
    per_epoch = sampler.steps_per_epoch * sampler.global_batch_size
    epoch, end, left = sampler.epoch, sampler.position, steps * sampler.global_batch_size
    segments: list[list[int]] = []
    while left > 0 and epoch >= 0:
        start = max(0, end - left)
        if end > start:
            segments.append([epoch, start, end])
        left -= end - start
        epoch, end = epoch - 1, per_epoch
    segments.reverse()
    crc = 0
    for e, start, end in segments:
        crc = zlib.crc32(sampler.ids(e, start, end).numpy().astype("<i8").tobytes(), crc)
    return segments, crc


def certificate_record(
    step: int,
    loss: float,
    world_size: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    sampler: DataPosition,
    steps: int,
) -> dict[str, Any]:
    """One line of the certificate: what the state and data stream were after `step`."""
    segments, crc = consumed(sampler, steps)
    return {
        "step": step,
        "loss": loss,
        "world_size": world_size,
        "samples": segments,
        "ids_crc32": crc,
        "digest": state_digest(model, optimizer),
    }


class Certificate:
    """The loop's observer (train/hooks.py) that writes the certificate: a record per logged step, rank 0 only.

    model, optimizer and sampler: the trainer's own objects, digested and read when a step is logged.
    """

    def __init__(
        self, writer: CertificateWriter, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: DataPosition
    ) -> None:
        self.writer, self.model, self.optimizer, self.sampler = writer, model, optimizer, sampler

    def step_logged(self, record: dict[str, Any], steps: int, seconds: float) -> None:
        """Rank 0 (while it writes the folder): digest the state after the logged step, append the record."""
        if self.writer.enabled:
            step, loss, world_size = record["step"], record["loss"], record["world_size"]
            self.writer.write(
                certificate_record(step, loss, world_size, self.model, self.optimizer, self.sampler, steps)
            )


class CertificateWriter:
    """Rank 0 appends certificate records to run.dir/certificate.jsonl (others do nothing).

    A link, FIFO or folder under the file's name is refused when the writer is made (before training,
    exit 2) and again when the file is opened: never followed, never waited on.
    """

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.path = certificate_file(run_dir)
        self._file: IO[str] | None = None
        if enabled:
            try:
                check_regular_or_absent(self.path)  # not created yet: a refused run leaves the folder as it was
            except OSError as e:
                raise UserError(f"cannot write the resume certificate {self.path}: {e.strerror or e}") from None

    def write(self, record: dict[str, Any]) -> None:
        """Append one record (line-buffered: a crash loses at most this line).

        A failed write (a full disk, a link planted mid-run) is bad input naming the file and the step.
        """
        if not self.enabled:
            return
        try:
            if self._file is None:
                self._file = open_append_no_follow(self.path, buffering=1)
            self._file.write(json.dumps(record) + "\n")
        except OSError as e:
            self.enabled = False  # nothing more is tried, closing included: the disk already refused
            self._file = None
            raise UserError(
                f"cannot write the resume certificate {self.path} at step {record.get('step')}: {e.strerror or e}"
            ) from None

    def close(self) -> None:
        """Close the file (a full disk's failed flush was reported by write, or is dropped here)."""
        file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


def read_certificate(path: Path) -> dict[int, list[dict[str, Any]]]:
    """Records by step, in file order: a run resumed after a crash logs the steps after its checkpoint again."""
    out: dict[int, list[dict[str, Any]]] = {}
    text = read_regular_file(path, follow=True).decode("utf-8", errors="replace")  # a FIFO: OSError, never a wait
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut off by a crash
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.setdefault(record["step"], []).append(record)
    return out


def _spans(record: dict[str, Any], per_epoch: int) -> list[tuple[int, int]]:
    """A record's sample segments as [from, to) positions in the whole stream (pass `epoch` starts at epoch x
    per_epoch)."""
    return [(e * per_epoch + start, e * per_epoch + end) for e, start, end in record["samples"]]


def coverage_gap(logged: dict[int, list[dict[str, Any]]], global_batch: int, per_epoch: int) -> str | None:
    """None when the records of each logged step (the first, when a resumed run logged a step again) hold every
    committed step's samples exactly once, steps 1 to the last logged one; else the first step whose samples
    are missing or repeated.

    Step k consumes positions [(k-1) x global_batch, k x global_batch) of the stream (a pass holds per_epoch
    positions), so the record of logged step s, after logged step p, must hold exactly [p x B, s x B).
    """
    previous = 0
    for step in sorted(logged):
        record = logged[step][0]
        want, spans = previous * global_batch, _spans(record, per_epoch)
        for start, end in spans:
            if start != want:
                lost = start > want
                first = want // global_batch + 1 if lost else start // global_batch + 1
                last = start // global_batch if lost else want // global_batch
                what = "in no record" if lost else "also in the record of an earlier step"
                return f"the samples of step(s) {first}..{last} are {what} (the record of step {step} holds {spans})"
            want = end
        if want != step * global_batch:
            return f"the record of step {step} ends at stream position {want}, not {step * global_batch}"
        previous = step
    return None
