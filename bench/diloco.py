"""DiLoCo on a limited link: synchronous DDP against DiLoCo H=20 and H=50, the same job side by side.

2 namespace hosts (bench/ft_jobs.py, tests/cluster/netns.py: needs root), 1 rank each, every host's egress
limited with tc tbf to RATE (what issue 37 measured on); `ddptrain launch --nnodes 2` per host. DiLoCo runs one
group per host (train.diloco.groups=0: a group is a node's ranks) with ddptrain's default outer settings. Per
variant: samples/s (wall clock, from the first logged step to the last) and the validation loss after the same
samples (the last step evaluates), against synchronous DDP's on the same link and on an unlimited one (the
compute-bound rate; issue 37's target for H=50: >= 0.9x it). The default 0.84M GPT, STEPS steps: a short
measurement (a few minutes in all). Smoke: a tiny GPT, 6 steps, H=2 and 3, no limit.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from bench.common import Options, Row, summary
from bench.ft_jobs import RestartJob, read_jsonl

HOSTS = 2
RATE = "50mbit"
STEPS = 100  # a multiple of every H: the last step evaluates, at an outer sync
INTERVALS = (20, 50)  # smoke: 2 and 3, over 6 steps
UNLIMITED = "sync DDP, unlimited link"
TINY_MODEL = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]


def job_args(opts: Options, steps: int) -> list[str]:
    """The training job every variant runs (variants add their train.diloco)."""
    return [
        f"data.dir={opts.data_dir}",
        *(TINY_MODEL if opts.smoke else []),
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        "log.every_steps=10" if not opts.smoke else "log.every_steps=2",
        "ckpt.every_steps=0",
        "log.certificate=false",
        "dist.startup_timeout_s=120",
    ]


def run_variant(folder: Path, train: list[str], rate: str | None, timeout_s: float) -> dict[str, Any]:
    """One job to its end on fresh hosts: its steady samples/s, final validation loss and outer-sync figures."""
    job = RestartJob(folder, HOSTS, train, HOSTS)
    try:
        if rate is not None:
            for node in job.cluster.nodes:
                node.rate_limit(rate)
        job.start()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in job.procs.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{folder.name}: not done in {timeout_s:.0f} s")
            time.sleep(0.5)
        if any(p.returncode != 0 for p in job.procs.values()):
            tails = "\n".join(job.log(h).read_text()[-2000:] for h in job.procs)
            raise RuntimeError(f"{folder.name} failed:\n{tails}")
    finally:
        job.close()
    records = read_jsonl(job.run_dir / "metrics.jsonl")
    train_rows = [r for r in records if r["kind"] == "train"]
    first, last = train_rows[0], train_rows[-1]  # the first logged window left out: start-up
    evals = [r for r in records if r["kind"] == "eval"]
    return {
        "samples_per_s": (last["step"] - first["step"]) * last["global_batch_size"] / (last["time"] - first["time"]),
        "val_loss": evals[-1]["val_loss"],
        "outer_syncs": last.get("outer_syncs", 0),
        "outer_sync_s": sum(r.get("outer_sync_s", 0.0) for r in train_rows),
        "step_time_s": fmean(r["step_time_s"] for r in train_rows[1:] or train_rows),
    }


def _rows(results: dict[str, dict[str, Any]], rate: str | None, steps: int) -> list[Row]:
    base, free = results["sync DDP"], results[UNLIMITED]
    link = f"2 hosts, {rate or 'unlimited'} link"
    rows = [
        Row("diloco", f"samples/s, {UNLIMITED}", summary([free["samples_per_s"]]), "samples/s",
            note="the compute-bound rate"),
        Row("diloco", f"samples/s, sync DDP, {link}", summary([base["samples_per_s"]]), "samples/s",
            note=f"val loss {base['val_loss']:.4f} after {steps} steps"),
    ]  # fmt: skip
    for name, r in results.items():
        if not name.startswith("DiLoCo"):
            continue
        note = (
            f"{r['samples_per_s']:.1f} samples/s = {r['samples_per_s'] / base['samples_per_s']:.2f}x sync DDP's on "
            f"the same link; val loss {r['val_loss']:.4f} = {r['val_loss'] / base['val_loss']:.3f}x sync DDP's; "
            f"{r['outer_syncs']} outer syncs, {r['outer_sync_s']:.1f} s blocked in them"
        )
        speed = r["samples_per_s"] / free["samples_per_s"]
        h50 = name.endswith("=50")
        rows.append(Row("diloco", f"samples/s, {name}, {link} / {UNLIMITED}", summary([speed]), "x",
                        target=">= 0.9" if h50 else "", met=speed >= 0.9 if h50 else None, note=note))  # fmt: skip
    return rows


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Rows per variant; data: every variant's figures."""
    steps, rate, intervals = (6, None, (2, 3)) if opts.smoke else (STEPS, RATE, INTERVALS)
    folder = opts.work_dir / "diloco"
    shutil.rmtree(folder, ignore_errors=True)
    variants = {"sync DDP": [], **{f"DiLoCo H={h}": [f"train.diloco.every_steps={h}"] for h in intervals}}
    results: dict[str, dict[str, Any]] = {}
    for name, extra in {UNLIMITED: [], **variants}.items():
        slug = name.lower().replace(" ", "-").replace("=", "").replace(",", "")
        (folder / slug).mkdir(parents=True)
        print(f"diloco: {name}, {steps} steps ...", file=sys.stderr, flush=True)
        limit = None if name == UNLIMITED else rate
        results[name] = run_variant(folder / slug, [*job_args(opts, steps), *extra], limit, 900)
    return _rows(results, rate, steps), {"variants": results, "hosts": HOSTS, "rate": rate, "steps": steps}
