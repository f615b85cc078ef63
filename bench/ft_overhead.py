"""Per-step cost of the in-place fault-tolerant mode against plain DDP, 2 ranks on loopback, no faults.

Variants, each a whole `ddptrain train` job per round, in alternating order (A B, then B A ...):
- ddp: `torchrun --standalone --nproc-per-node 2` (one DDP group of 2 ranks);
- in-place: a Lighthouse on 127.0.0.1 and 2 replica groups of 1 rank (train/in_place.py: a quorum per
  step, gradients summed across the groups through torchft, a stats sum, a commit vote).
A round's step time is the median interval between consecutive steps' records after the first
`SKIP` (log.every_steps=1 in both: a record per step); the figure is the per-round ratio in-place /
ddp, for the default model and for the tiny model (where the loop's own costs show). A third pair trains DiLoCo
(H=10, the default model) in both, plain DiLoCo in 2 groups of 1 rank: the ratio of their inner steps is what
fault tolerance costs a step without a quorum, vote or cross-group traffic (issue 37's <= 1%). One last
in-place run of each model times group 0's session calls (bench/ft_session_timer.py): the median
milliseconds per step of the quorum, the wait for the cross-group gradient sums after backward, the
stats sum and the commit vote say where a cost above the target goes (the gradient sum replaces DDP's
own all-reduce; the rest is
what the mode adds).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.build import DEFAULT_MODEL, TINY_MODEL
from bench.common import REPO, Options, Row, summary
from bench.ft_jobs import child_env, read_jsonl

LIGHTHOUSE = "127.0.0.1:29520"
RUN = ["train.eval_every=0", "ckpt.every_steps=0", "log.every_steps=1", "dist.watchdog=false"]
SKIP = 5  # warm-up steps left out of the median
DILOCO_H = 10


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def _ddp(run_dir: Path, args: list[str], log: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    proc = _start([*argv, "ddptrain", "train", *args, f"run.dir={run_dir}"], child_env(), log)
    if proc.wait(timeout=900) != 0:
        raise RuntimeError(f"plain DDP run failed: {log.read_text()[-2000:]}")


def _in_place(run_dir: Path, args: list[str], log: Path, timings: Path | None = None) -> None:
    lighthouse = _start([sys.executable, "-m", "ddptrain", "lighthouse", "--bind", LIGHTHOUSE], child_env(), log)
    try:
        time.sleep(1.0)
        groups = []
        for g in (0, 1):
            env = child_env(
                {"DDPTRAIN_REPLICA_GROUP": str(g), "TORCHFT_LIGHTHOUSE": f"http://{LIGHTHOUSE}"}
                | {"DDPTRAIN_BIND_ADDR": "127.0.0.1"}
            )
            timer = ["bench.ft_session_timer", str(timings)] if timings and g == 0 else ["ddptrain", "train"]
            groups.append(_start([sys.executable, "-m", *timer, *args, f"run.dir={run_dir}"], env, log))
        if [p.wait(timeout=900) for p in groups] != [0, 0]:
            raise RuntimeError(f"in-place run failed: {log.read_text()[-2000:]}")
    finally:
        lighthouse.terminate()
        lighthouse.wait(timeout=30)


def step_time(run_dir: Path) -> float:
    """Median interval between consecutive steps' records, after the warm-up steps."""
    times = [r["time"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"][SKIP:]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def session_costs(timings: Path) -> dict[str, float]:
    """Median milliseconds per call of each in-place session call, warm-up steps left out."""
    seconds = json.loads(timings.read_text())
    return {name: 1000 * statistics.median(v[SKIP:]) for name, v in seconds.items() if len(v) > SKIP}


def _measure(
    folder: Path, model: list[str], steps: int, opts: Options, diloco: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    """Per-round step times of plain DDP and the in-place mode; with `diloco` (train.diloco settings) both train
    DiLoCo, plain DDP in 2 groups of 1 rank (the in-place mode's replica groups are its groups), and the median
    interval between steps is an inner step's."""
    args = [*RUN, *model, f"train.max_steps={steps}", f"data.dir={opts.data_dir}", *diloco]
    folder.mkdir(parents=True, exist_ok=True)
    groups = ["train.diloco.groups=2"] if diloco else []
    variants: dict[str, Callable[[Path, list[str], Path], None]] = {
        "ddp": lambda run_dir, a, log: _ddp(run_dir, [*a, *groups], log),
        "in-place": _in_place,
    }
    out: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(opts.rounds):
        for name in opts.order(list(variants), r):
            run_dir = folder / f"{name}-{r}"
            shutil.rmtree(run_dir, ignore_errors=True)
            variants[name](run_dir, args, folder / f"{name}.log")
            out[name].append(step_time(run_dir))
    return out


def _diloco_row(folder: Path, opts: Options) -> tuple[Row, dict[str, list[float]]]:
    """Issue 37's figure: an inner step of in-place DiLoCo against one of plain DiLoCo (the default model, H=10):
    what fault tolerance costs a step that has no quorum, vote or cross-group traffic."""
    seconds = _measure(folder / "diloco", DEFAULT_MODEL, 40, opts, (f"train.diloco.every_steps={DILOCO_H}",))
    stats = summary([100 * (a / b - 1) for a, b in zip(seconds["in-place"], seconds["ddp"])])
    note = f"default model, H={DILOCO_H}, plain DiLoCo inner step {1000 * statistics.median(seconds['ddp']):.1f} ms"
    row = Row(
        "in-place overhead (2 ranks)",
        "DiLoCo inner step vs plain DiLoCo",
        stats,
        "%",
        "<= 1%",
        stats["median"] <= 1,
        note,
    )
    return row, seconds


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Rows: in-place / ddp step-time overhead for the default and the tiny model; data: per-round seconds."""
    folder = opts.work_dir / "ft_overhead"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    sizes = {"tiny": (TINY_MODEL, 20)} if opts.smoke else {"default": (DEFAULT_MODEL, 40), "tiny": (TINY_MODEL, 150)}
    rows, data = [], {}
    for label, (model, steps) in sizes.items():
        seconds = _measure(folder / label, model, steps, opts)
        ratios = [100 * (a / b - 1) for a, b in zip(seconds["in-place"], seconds["ddp"])]
        stats = summary(ratios)
        target = "<= 2%" if label == "default" else ""
        met = stats["median"] <= 2 if target else None
        ddp_ms = 1000 * statistics.median(seconds["ddp"])
        note = f"{label} model, plain DDP step {ddp_ms:.1f} ms"
        rows.append(
            Row("in-place overhead (2 ranks)", f"step time vs plain DDP, {label}", stats, "%", target, met, note)
        )
        data[label] = seconds
        profiled = folder / label / "timed"
        _in_place(
            profiled,
            [*RUN, *model, f"train.max_steps={steps}", f"data.dir={opts.data_dir}"],
            folder / "timed.log",
            folder / f"{label}-session.json",
        )
        data[f"{label}_session_ms"] = costs = session_costs(folder / f"{label}-session.json")
        data[f"{label}_timed_step_s"] = step_time(profiled)
        rows += [
            Row("in-place overhead (2 ranks)", f"{label}: {call} per step", summary([ms]), "ms", note="group 0, median")
            for call, ms in costs.items()
        ]
    if not opts.smoke:
        row, data["diloco"] = _diloco_row(folder, opts)
        rows.append(row)
    return rows, data
