"""Goodput under a fault schedule: today's restart mode and the in-place mode, the same job side by side.

Each mode trains the same job on 3 namespace hosts x 1 rank (bench/ft_jobs.py; needs root) while a
random host's training process is SIGKILLed every `--fault-every` seconds for `--fault-for` seconds,
counted from the first committed step; then the job is stopped. The restart mode's agents restart
every worker from the last checkpoint; in place, the survivors go on and the killed group is started
again at once (what `ddptrain launch --fault-tolerance torchft --max-restarts` does) and heals.

Per mode: goodput (review/membership.py: steps committed after the first, times the median interval
between consecutive steps, over the window), steps per minute, per-failure cost (kill to the next
committed step; kill to the first step past the one reached before the kill, which in the restart mode
includes its re-done steps; in place, a replacement's start to full membership), discarded steps, and
lost and repeated samples: the certificate's steps against a fault-free single-process run of the same
data stream (a 1-layer model of the same block size: the sample ids depend on the data, the seed and
the global batch only). Repeated = samples of steps trained again after a rollback; lost = steps of the
committed history missing or with other samples than the fault-free run's.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, Options, Row, chosen_modes, summary
from bench.ft_jobs import InPlaceJob, Job, Kill, RestartJob, child_env, read_jsonl
from ddptrain.review.membership import step_goodput

HOSTS = 3
GLOBAL_BATCH = 48  # 6 micro-batches of 8: 2 per rank at 3 ranks, 3 at 2 (either mode, any membership)
JOB = [
    "train.global_batch_size=48",
    "data.micro_batch_size=8",
    "train.max_steps=100000",  # the job is stopped at the end of the window
    "train.warmup_steps=20",
    "train.eval_every=0",
    "log.every_steps=1",  # a record (and certificate line) per committed step
    "ckpt.every_steps=10",  # the restart mode's rollback: at most 10 steps re-done per failure
    "dist.timeout_s=10",
    "dist.startup_timeout_s=120",
    "dist.ft_timeout_s=10",
    "dist.watchdog=false",
]
REFERENCE_MODEL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32"]
# The modes (--modes picks some) and what each adds to JOB. In-place DiLoCo: the replica groups are the DiLoCo
# groups, with a quorum at outer syncs only; a group lost mid-interval takes its share of the interval's samples.
MODES: dict[str, list[str]] = {"restart": [], "in-place": [], "in-place DiLoCo H=10": ["train.diloco.every_steps=10"]}


def _after(train: list[dict[str, Any]], t: float, past_step: int = 0) -> float | None:
    """Seconds from t to the first step committed after t (beyond `past_step`)."""
    later = [r["time"] for r in train if r["time"] > t and r["step"] > past_step]
    return later[0] - t if later else None


def failure_costs(records: list[dict[str, Any]], kills: list[Kill]) -> dict[str, Any]:
    """Per kill: to the next committed step, to the first step past the one reached before it; replacements."""
    train = [r for r in records if r["kind"] == "train"]
    # Full membership: a quorum of every group. (Not "the replaced group joined": a replacement that heals
    # in the first quorum after the kill never shows in a quorum's `joined`, since it never left one.)
    everyone = max((len(q["groups"]) for q in records if q.get("event") == "quorum"), default=0)
    next_step, past_before, full = [], [], []
    for k in kills:
        reached = max((r["step"] for r in train if r["time"] <= k.time), default=0)
        for out, value in ((next_step, _after(train, k.time)), (past_before, _after(train, k.time, reached))):
            if value is not None:
                out.append(value)
        if k.restarted is not None:
            joins = [
                q["time"] - k.restarted
                for q in records
                if q.get("event") == "quorum" and len(q["groups"]) == everyone and q["time"] > k.restarted
            ]
            if joins:
                full.append(joins[0])
    quorums = [r for r in records if r.get("event") == "quorum" and r["left"]]
    return {
        "kill_to_next_step_s": next_step,
        "kill_to_past_reached_s": past_before,
        "replacement_to_full_s": full,
        "discarded_steps": [q["discarded_steps"] for q in quorums],
        "heal_s": [r["seconds"] for r in records if r.get("event") == "heal" and r["verified"]],
        "recovery_phases": [r["phases"] for r in records if r.get("event") == "recovery"],
    }


def sample_accounting(run_dir: Path, reference: dict[int, int]) -> dict[str, int]:
    """Repeated and lost samples of the run's certificate against the fault-free run's (step -> ids CRC)."""
    seen: dict[int, list[int]] = {}
    for c in read_jsonl(run_dir / "certificate.jsonl"):
        seen.setdefault(c["step"], []).append(c["ids_crc32"])
    last = max(seen, default=0)
    repeated = sum(len(crcs) - 1 for crcs in seen.values())
    lost = sum(1 for s in range(1, last + 1) if s not in seen or seen[s][-1] != reference.get(s))
    differs = sum(1 for crcs in seen.values() if len(set(crcs)) > 1)  # a re-done step that read other samples
    return {
        "last_step": last,
        "repeated_samples": repeated * GLOBAL_BATCH,
        "lost_samples": (lost + differs) * GLOBAL_BATCH,
    }


def interval_shares_lost(records: list[dict[str, Any]], every: int) -> int:
    """DiLoCo in place: samples of the intervals whose group was lost. A group that leaves at an outer sync (dead
    mid-interval or inside the sync) takes its share of that interval's global batches, every sample of its H
    steps' micro-batches: its pseudo-gradient is not in the outer step, and no one else trained them."""
    lost, members = 0, 0
    for q in (r for r in records if r.get("event") == "quorum"):
        if members:
            lost += len(q["left"]) * every * GLOBAL_BATCH // members
        members = len(q["groups"])
    return lost


def reference_ids(folder: Path, data_dir: Path, steps: int) -> dict[int, int]:
    """step -> CRC-32 of the sample ids of a fault-free single-process run (a small model, the same stream)."""
    run_dir = folder / "reference"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [sys.executable, "-m", "ddptrain", "train", *JOB, *REFERENCE_MODEL, f"data.dir={data_dir}"]
    argv += [f"train.max_steps={max(steps, 1)}", "ckpt.every_steps=100000", f"run.dir={run_dir}"]
    subprocess.run(argv, env=child_env(), cwd=REPO, check=True, capture_output=True, timeout=1800)
    return {c["step"]: c["ids_crc32"] for c in read_jsonl(run_dir / "certificate.jsonl")}


def run_mode(job: Job, every: float, duration: float, seed: int) -> dict[str, Any]:
    """Train under the schedule: a kill every `every` s for `duration` s from the first step; then stop."""
    rng = random.Random(seed)
    kills: list[Kill] = []
    revived: list[tuple[int, float]] = []
    try:
        job.start()
        first = job.first_step_time(timeout=300)
        end = first + duration
        next_kill = first + every
        while time.time() < end:
            if time.time() >= next_kill and next_kill < end:
                kill = job.kill(rng)
                if kill is not None:
                    kills.append(kill)
                    next_kill += every
                    print(
                        f"goodput: {job.mode}: killed host {kill.host} at +{kill.time - first:.1f} s", file=sys.stderr
                    )
            revived += [(host, time.time()) for host in job.revive()]
            time.sleep(0.05)
    finally:
        job.close()
    records = job.records()
    g = step_goodput(records, end)
    assert g is not None, f"{job.mode}: fewer than two steps in the window"
    every = int(next((a.split("=")[1] for a in job.train if a.startswith("train.diloco.every_steps=")), 0))
    lost = interval_shares_lost([r for r in records if r["time"] <= end], every) if every else 0
    return {
        "goodput": g.ratio,
        # DiLoCo: the steps' samples that counted (the lost groups' interval shares taken off), as a goodput
        "sample_goodput": g.ratio * (1 - lost / (g.steps * GLOBAL_BATCH)) if every else None,
        "interval_samples_lost": lost,
        "steps": g.steps,
        "step_s": g.step_s,
        "wall_s": g.wall_s,
        "kills": [k.__dict__ for k in kills],
        "exited_on_their_own": revived,  # (host, when restarted): failures the schedule did not cause
        **failure_costs(records, kills),
    }


def _row(figure: str, metric: str, values: list[float], unit: str, note: str, target: str = "", ok: Any = None) -> Row:
    stats = summary(values) if values else None
    met = bool(ok(stats["median"])) if (stats and ok is not None) else None
    return Row(figure, metric, stats, unit, target, met, note)


def _rows(results: dict[str, dict[str, Any]], every: float, duration: float) -> list[Row]:
    note = f"kill every {every:.0f} s for {duration / 60:.1f} min"
    rows = []
    for mode, r in results.items():
        fig = f"goodput ({mode})"
        if mode == "in-place":  # the targets are the in-place mode's
            targets: dict[str, tuple[str, Any]] = {
                "goodput": (">= 90%", lambda m: m >= 90),
                "next": ("<= 1.5 s", lambda m: m <= 1.5),
                "lost": ("0", lambda m: m == 0),
            }
        elif mode == "in-place DiLoCo H=10":  # issue 37's: inner steps pay nothing for fault tolerance
            targets = {"goodput": (">= 95%", lambda m: m >= 95)}
        else:
            targets = {}
        none: tuple[str, Any] = ("", None)
        rows += [
            _row(fig, "goodput", [100 * r["goodput"]], "%", note, *targets.get("goodput", none)),
            *(
                [_row(fig, "goodput of the samples that counted", [100 * r["sample_goodput"]], "%", note)]
                if r.get("sample_goodput") is not None
                else []
            ),
            _row(fig, "steps per minute", [60 * r["steps"] / r["wall_s"]], "", note),
            _row(fig, "kill -> next committed step", r["kill_to_next_step_s"], "s", note, *targets.get("next", none)),
            _row(fig, "kill -> past the step reached", r["kill_to_past_reached_s"], "s", note),
            _row(fig, "repeated samples", [r["repeated_samples"]], "", note),
            _row(fig, "lost samples", [r["lost_samples"]], "", note, *targets.get("lost", none)),
        ]
        if r.get("sample_goodput") is not None:
            rows.append(_row(fig, "samples of lost groups' intervals", [r["interval_samples_lost"]], "", note))
        if mode == "in-place":
            rows += [
                _row(fig, "discarded steps per kill", r["discarded_steps"], "", note, "<= 1", lambda m: m <= 1),
                _row(
                    fig,
                    "replacement start -> full membership",
                    r["replacement_to_full_s"],
                    "s",
                    note,
                    "<= 5 s",
                    lambda m: m <= 5,
                ),
            ]
    return rows


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Rows per mode; data: the kills, every per-failure cost and the sample accounting."""
    every, duration = (5.0, 12.0) if opts.smoke else (opts.fault_every_s, opts.fault_for_s)
    folder = opts.work_dir / "goodput"
    shutil.rmtree(folder, ignore_errors=True)
    train = [*JOB, f"data.dir={opts.data_dir}"]
    results: dict[str, dict[str, Any]] = {}
    for mode in chosen_modes(opts, MODES, "goodput"):
        (folder / mode).mkdir(parents=True)
        job = RestartJob(folder / mode, HOSTS, train, HOSTS - 1) if mode == "restart" else None
        job = job or InPlaceJob(folder / mode, HOSTS, [*train, *MODES[mode]])
        print(f"goodput: {mode} mode, {duration:.0f} s ...", file=sys.stderr, flush=True)
        results[mode] = run_mode(job, every, duration, seed=25)
    last = max(
        max((c["step"] for c in read_jsonl(folder / m / "run" / "certificate.jsonl")), default=0) for m in results
    )
    reference = reference_ids(folder, opts.data_dir, last)
    for mode, r in results.items():
        r.update(sample_accounting(folder / mode / "run", reference))
    return _rows(results, every, duration), {"modes": results, "hosts": HOSTS, "job": JOB}
