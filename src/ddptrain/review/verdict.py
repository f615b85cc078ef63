"""`ddptrain triage RUN_DIR`: the forensics in run.dir/stacks/ merged into one short verdict.

Which collective hung: per process group, the flight recorder says the newest collective
(sequence number) each rank entered. The ranks that entered the newest one wait in it; the others
never entered it. When several groups have such a gap (a rank skipped a collective and went on to
the next one, in another group) the one entered first is where the job stopped. Where each rank
is: the main thread's Python frames, reduced to landmarks ("the DataLoader's __next__", a
model's forward, backward, a collective) and the innermost frame, plus the kernel's wait channel.
A rank that wrote nothing is described by the peer on its host that looked at its process.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddptrain.errors import UserError
from ddptrain.safe_files import read_regular_file

FORENSICS = "replicas.json"  # train/replicas.py: the verdict of replicas that diverged


class TriageError(UserError):
    """No forensics to read (no hang was recorded in this run folder)."""


@dataclass
class OpenCollective:
    """A collective some ranks entered and the others did not."""

    group: str
    seq: int
    name: str
    created_ns: int
    waiting: list[int]
    missing: list[int]


def _json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object from a regular file (a link or FIFO under the name is skipped, never followed or waited on)."""
    try:
        data = json.loads(read_regular_file(path))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _load(path: Path) -> dict[str, Any] | None:
    data = _json_object(path)
    return data if data is not None and isinstance(data.get("rank"), int) else None


def read_stacks(stacks_dir: Path) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """(own reports, observations of silent ranks) by rank."""
    reports: dict[int, dict[str, Any]] = {}
    observed: dict[int, dict[str, Any]] = {}
    for path in sorted(stacks_dir.glob("rank-*.json")):
        data = _load(path)
        if data is None:
            continue
        (observed if path.name.endswith(".observed.json") else reports)[data["rank"]] = data
    return reports, observed


def _short(path: str) -> str:
    parts = Path(path).parts
    return "/".join(parts[-2:]) if len(parts) >= 2 and parts[-2] not in ("", "/") else Path(path).name


def _landmark(frame: dict[str, Any]) -> str | None:
    file, fn = frame["file"].replace("\\", "/"), frame["function"]
    if file.endswith("torch/utils/data/dataloader.py") and fn.endswith("__next__"):
        return "the DataLoader's __next__"
    if file.endswith("distributed_c10d.py") and not fn.split(".")[-1].startswith("_"):
        return f"collective {fn.split('.')[-1]}"
    if "/torch/autograd/" in file and fn.split(".")[-1] in ("backward", "_engine_run_backward"):
        return "backward"
    if fn.split(".")[-1] == "forward" and "/torch/" not in file:
        return str(fn)
    if "/ddptrain/" in file and fn in ("Trainer.evaluate", "Trainer.save_checkpoint", "Checkpointer.save"):
        return str(fn)
    return None


def where(frames: list[dict[str, Any]], wchan: str | None) -> str:
    """Where a thread is: landmarks outermost first, then its innermost Python frame and kernel wait."""
    marks: list[str] = []
    for f in frames:
        mark = _landmark(f)
        if mark and mark not in marks:
            marks.append(mark)
    text = "in " + " > ".join(marks) if marks else "outside any known landmark"
    if frames:
        inner = frames[-1]
        text += f", at {_short(inner['file'])}:{inner['line']} in {inner['function']}"
    if wchan:
        text += f" (in the kernel: {wchan})"
    return text


def _entered(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per process group, the newest flight-recorder entry of this rank."""
    out: dict[str, dict[str, Any]] = {}
    for e in report.get("flight_recorder") or []:
        group = (e.get("process_group") or [str(e.get("pg_id"))])[0]
        seq = e.get("collective_seq_id")
        if seq and (group not in out or seq > out[group]["collective_seq_id"]):
            out[group] = e
    return out


def _created(reports: dict[int, dict[str, Any]], group: str, seq: int) -> int | None:
    """When some rank entered collective `seq` of `group` (from any rank's flight recorder), if recorded."""
    for rep in reports.values():
        for e in rep.get("flight_recorder") or []:
            if (e.get("process_group") or [str(e.get("pg_id"))])[0] == group and e.get("collective_seq_id") == seq:
                return int(e.get("time_created_ns") or 0) or None
    return None


def first_in_program_order(reports: dict[int, dict[str, Any]], opened: list[OpenCollective]) -> list[OpenCollective]:
    """Open collectives with a crossed wait resolved: the one the program reaches first leads.

    When rank A waits in group g's collective that rank B never entered while B waits in group h's
    that A never entered, timing alone cannot say who skipped: both look stuck. Every rank runs the
    same program, so the order the two groups' previous collectives were entered in (the step
    before) is the program's order; the collective that comes first is where the job stopped.
    """
    if len(opened) < 2:
        return opened
    a, b = opened[0], opened[1]
    crossed = set(a.missing) & set(b.waiting) and set(b.missing) & set(a.waiting)
    ta, tb = _created(reports, a.group, a.seq - 1), _created(reports, b.group, b.seq - 1)
    if crossed and ta is not None and tb is not None and tb < ta:
        return [b, a, *opened[2:]]
    return opened


def open_collectives(reports: dict[int, dict[str, Any]]) -> list[OpenCollective]:
    """Collectives entered by some reporting ranks but not all, oldest first."""
    entered = {r: _entered(rep) for r, rep in reports.items()}
    groups = {g for per in entered.values() for g in per}
    found = []
    for g in groups:
        seqs = {r: per[g]["collective_seq_id"] if g in per else 0 for r, per in entered.items()}
        top = max(seqs.values())
        waiting = sorted(r for r, s in seqs.items() if s == top)
        missing = sorted(r for r, s in seqs.items() if s < top)
        entry = entered[waiting[0]][g]
        if missing and not entry.get("retired"):
            created = min(entered[r][g].get("time_created_ns") or 0 for r in waiting)
            found.append(OpenCollective(g, top, entry.get("profiling_name") or "?", created, waiting, missing))
    return sorted(found, key=lambda c: c.created_ns)


def _group_label(group: str, reports: dict[int, dict[str, Any]]) -> str:
    for rep in reports.values():
        name = (rep.get("groups") or {}).get(group)
        if name:
            return f"group {name}"
    return f"process group {group}"


def _ranks(ranks: list[int], hosts: list[str]) -> str:
    return ", ".join(f"{r} on {hosts[r]}" if r < len(hosts) else str(r) for r in ranks)


def _silent_line(rank: int, host: str, seen: dict[str, Any] | None) -> str:
    if seen is None:
        return f"rank {rank} on {host} wrote no report and no rank on its host could look at it (another host, or gone)"
    state = seen.get("state")
    pid = seen.get("pid")
    if state is None:
        what = f"its process {pid} no longer exists (it died)"
    elif state == "T":
        what = f"its process {pid} is stopped (state T: SIGSTOP, or a debugger)"
    elif state == "Z":
        what = f"its process {pid} has exited (zombie)"
    elif state == "D":
        what = f"its process {pid} is in uninterruptible I/O (state D, {seen.get('wchan') or 'unknown wait'})"
    else:
        what = f"its process {pid} is alive (state {state}) but did not report (frozen with the interpreter lock held?)"
    spy = seen.get("py_spy") or ""
    first = next((ln.strip() for ln in spy.splitlines() if ln.startswith("    ")), None)
    return f"rank {rank} on {host} wrote no report: {what}" + (f"; py-spy: {first}" if first else "")


def verdict(stacks_dir: Path) -> str:
    """The short verdict of a hang (or of replicas that diverged, train/replicas.py) from the files in stacks_dir."""
    if not stacks_dir.is_dir():
        raise TriageError(f"no {stacks_dir} folder: this run recorded no hang (the watchdog writes it on a hang)")
    reports, observed = read_stacks(stacks_dir)
    diverged = _json_object(stacks_dir / FORENSICS)
    if not reports and not observed and diverged is not None:
        return f"verdict: {diverged.get('verdict')}\ndetails: {stacks_dir / FORENSICS}"
    if not reports and not observed:
        raise TriageError(f"no hang reports (rank-*.json) in {stacks_dir}: nothing to triage")
    any_report = next(iter([*reports.values(), *observed.values()]))
    world = int(any_report.get("world_size") or (max([*reports, *observed]) + 1))
    hosts = list(any_report.get("hosts") or [])
    hosts += ["?"] * (world - len(hosts))
    silent = sorted(r for r in range(world) if r not in reports)
    step = max((rep.get("step", 0) for rep in reports.values()), default=0)
    lines = []
    if reports:
        first = min(reports.values(), key=lambda rep: rep.get("time", 0))
        lines.append(
            f"hang in step {step}: rank {first['rank']} noticed after {first.get('waited_s', 0):.2f} s without "
            f"progress in {first.get('phase')} (budget {first.get('budget_s', 0):.2f} s: {first.get('derivation')})"
        )
    opened = first_in_program_order(reports, open_collectives(reports))
    culprits: list[int] = []
    if opened:
        c = opened[0]
        label = _group_label(c.group, reports)
        culprits = c.missing
        lines.append(
            f"verdict: rank {_ranks(c.missing, hosts)} never entered collective #{c.seq} ({c.name} on {label}), "
            f"which rank {_ranks(c.waiting, hosts)} wait{'s' if len(c.waiting) == 1 else ''} in"
        )
        later = {r: o for o in opened[1:] for r in o.waiting if r in c.missing}
        for r in c.missing:
            rep = reports[r]
            text = f"rank {r} on {hosts[r]} is {where(rep.get('main_thread', []), rep.get('wchan'))}"
            if r in later:
                o = later[r]
                text += f"; it skipped #{c.seq} and went on to collective #{o.seq} ({o.name} on {_group_label(o.group, reports)})"
            lines.append(text)
    for r in silent:
        lines.append(
            ("verdict: " if not opened and r == silent[0] else "") + _silent_line(r, hosts[r], observed.get(r))
        )
    if not opened and not silent:
        lines.append(
            "verdict: every rank reported and none is missing from a collective: all wait in the same place "
            "(a slow or broken link, or a deadlock outside collectives)"
        )
    for r in sorted(reports):
        if r not in culprits:
            rep = reports[r]
            lines.append(f"  rank {r} on {hosts[r]}: {where(rep.get('main_thread', []), rep.get('wchan'))}")
    lines.append(f"stacks: {stacks_dir} (Python and native stacks per rank in rank-<r>-<host>.txt)")
    return "\n".join(lines)
