"""Training across a slow link: samples/s of each way to synchronize on 2 namespace hosts whose links
are limited with `tc tbf`, against synchronous DDP on the unlimited link (the compute-bound rate).

Each job is issue 37's setting: one rank per host (gloo), the 3.2M-parameter GPT (`model.n_layer=4
model.n_head=4 model.n_embd=256`), global batch 32, started as a user would (`ddptrain launch` on each
host, bench/ft_jobs.py's RestartJob). Its rate is read from metrics.jsonl: samples between the first
logged step after warm-up and the last, over the time between them (start-up and the first steps'
warm-up excluded). Rounds alternate the order of the modes. Needs root (network namespaces); run only
when named: `python -m bench slow_links`.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Options, Row, summary
from bench.ft_jobs import RestartJob, read_jsonl

GPT_3M = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=64"]
GPT_TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
JOB = [
    "data.micro_batch_size=16",
    "train.global_batch_size=32",
    "train.eval_every=0",
    "ckpt.every_steps=0",
    "log.every_steps=1",
    "train.warmup_steps=5",
]
WARM_STEPS = 4  # the first steps build DDP's buckets; PowerSGD compresses from step 3 on: not measured
MODES = {
    "sync fp32": [],
    "fp16": ["dist.grad_compression=fp16"],
    "powersgd r=4": [
        "dist.grad_compression=powersgd",
        "dist.powersgd_rank=4",
        f"dist.powersgd_start_step={WARM_STEPS - 1}",
    ],
}
UNLIMITED = "sync fp32, unlimited link"
RATE = "50mbit"
HOSTS = 2


def samples_per_s(records: list[dict[str, Any]], warm: int) -> float:
    """Samples per second from the train records after step `warm` (global batch x steps / elapsed)."""
    train = [r for r in records if r.get("kind") == "train" and r["step"] > warm]
    assert len(train) >= 2, f"fewer than two logged steps after step {warm}"
    first, last = train[0], train[-1]
    return float((last["step"] - first["step"]) * last["global_batch_size"] / (last["time"] - first["time"]))


def run_job(folder: Path, train: list[str], rate: str | None, timeout_s: float) -> float:
    """One job to its end on fresh hosts (rate-limited unless rate is None); its samples/s."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job = RestartJob(folder, HOSTS, train, HOSTS)
    try:
        if rate:
            for node in job.cluster.nodes:
                node.rate_limit(rate)
        job.start()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in job.procs.values()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"slow_links: {folder.name} did not finish in {timeout_s:.0f} s")
            time.sleep(0.2)
        failed = {h: p.returncode for h, p in job.procs.items() if p.returncode != 0}
        if failed:
            tail = job.log(min(failed)).read_text()[-2000:]
            raise RuntimeError(f"slow_links: {folder.name}: hosts exited {failed}\n{tail}")
    finally:
        job.close()
    return samples_per_s(read_jsonl(job.run_dir / "metrics.jsonl"), WARM_STEPS)


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Rows: each mode's samples/s on the limited link and its ratio to the unlimited-link synchronous rate."""
    steps = WARM_STEPS + (3 if opts.smoke else 30)
    model = GPT_TINY if opts.smoke else GPT_3M
    base = [*JOB, *model, f"train.max_steps={steps}", f"data.dir={opts.data_dir}"]
    variants = {UNLIMITED: (base, None), **{m: ([*base, *extra], RATE) for m, extra in MODES.items()}}
    rates: dict[str, list[float]] = {name: [] for name in variants}
    folder = opts.work_dir / "slow_links"
    for r in range(opts.warmup + opts.rounds if not opts.smoke else 1):
        for name in opts.order(list(variants), r):
            train, rate = variants[name]
            print(f"slow_links: round {r}: {name} ...", file=sys.stderr, flush=True)
            value = run_job(folder / name.replace(" ", "_").replace("=", ""), train, rate, timeout_s=900)
            if opts.smoke or r >= opts.warmup:
                rates[name].append(value)
    figure = f"slow links ({HOSTS} hosts, {RATE})"
    reference = summary(rates[UNLIMITED])["median"]
    rows = [Row(figure, f"{UNLIMITED}: samples/s", summary(rates[UNLIMITED]), "samples/s")]
    for name in MODES:
        rows.append(Row(figure, f"{name}: samples/s", summary(rates[name]), "samples/s"))
        ratio = summary([v / reference for v in rates[name]])
        rows.append(Row(figure, f"{name}: vs unlimited sync", ratio, "x", note="per round, against the median"))
    return rows, {"samples_per_s": rates, "rate": RATE, "steps": steps, "model": model}
