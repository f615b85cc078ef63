"""Training across a slow link: each way to synchronize on 2 namespace hosts whose links are limited with
`tc tbf`, against synchronous DDP on the unlimited link (the compute-bound rate).

Each job is issue 37's setting: one rank per host (gloo), the 3.2M-parameter GPT (`model.n_layer=4
model.n_head=4 model.n_embd=256`), global batch 32, STEPS steps on the same samples, started as a user
would (`ddptrain launch` on each host, bench/ft_jobs.py's RestartJob); DiLoCo makes a group of each host
with its default outer settings, once in 4 fragments sent as int8, and once streamed (issue 37's streaming
DiLoCo: 4 int8 fragments, each sync overlapping delay_steps=1 inner step). Per job: samples/s between the first
logged step after the warm-up and the last (start-up excluded), the validation loss at the last step (an outer
sync for every H here), DiLoCo's outer syncs, the payload bytes it sent per step (against fp32 DDP's, which is one
fp32 DiLoCo sync's: every trainable parameter in 4 bytes) and its seconds blocked on the link per step (the wait
for the exchanges, against the step's time). Rounds alternate the order of the modes. Needs root (network
namespaces); run only when named: `python -m bench slow_links` (the synchronous fp32 job alone takes ~5 minutes a
round). Smoke: a tiny GPT, 6 steps, DiLoCo H=2, and H=6 streamed in 3 int8 fragments with delay_steps=1, no limit.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Options, Row, chosen_modes, summary
from bench.ft_jobs import RestartJob, read_jsonl

GPT_3M = ["model.n_layer=4", "model.n_head=4", "model.n_embd=256", "model.block_size=64"]
GPT_TINY = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.block_size=32"]
STEPS = 100  # a multiple of every DiLoCo H below (--steps: keep it one): the last step evaluates at an outer sync
WARM_STEPS = 4  # the first steps build DDP's buckets; PowerSGD compresses from step 3 on: not measured
MODES = {
    "sync fp32": [],
    "fp16": ["dist.grad_compression=fp16"],
    "powersgd r=4": [
        "dist.grad_compression=powersgd",
        "dist.powersgd_rank=4",
        f"dist.powersgd_start_step={WARM_STEPS - 1}",
    ],
    "DiLoCo H=20": ["train.diloco.every_steps=20"],
    "DiLoCo H=50": ["train.diloco.every_steps=50"],
    "DiLoCo H=50 int8": ["train.diloco.every_steps=50", "train.diloco.outer_dtype=int8"],
    "DiLoCo H=50 P=4 int8": [
        "train.diloco.every_steps=50",
        "train.diloco.fragments=4",
        "train.diloco.outer_dtype=int8",
    ],
    "streaming H=50 P=4 tau=1 int8": [
        "train.diloco.every_steps=50",
        "train.diloco.fragments=4",
        "train.diloco.outer_dtype=int8",
        "train.diloco.delay_steps=1",
    ],
    "DiLoCo H=100": ["train.diloco.every_steps=100"],
    "streaming H=100 P=4 tau=1 int8": [
        "train.diloco.every_steps=100",
        "train.diloco.fragments=4",
        "train.diloco.outer_dtype=int8",
        "train.diloco.delay_steps=1",
    ],
}
SMOKE_MODES = {
    "sync fp32": [],
    "DiLoCo H=2": ["train.diloco.every_steps=2"],
    "streaming H=6 P=3 tau=1 int8": [
        "train.diloco.every_steps=6",
        "train.diloco.fragments=3",
        "train.diloco.outer_dtype=int8",
        "train.diloco.delay_steps=1",
    ],
}
FP32_DILOCO = {
    "DiLoCo H=50",
    "DiLoCo H=100",
    "DiLoCo H=2",
}  # one sync: every trainable parameter in fp32, fp32 DDP's bytes per step
STREAMED = {
    "streaming H=50 P=4 tau=1 int8",
    "streaming H=100 P=4 tau=1 int8",
}  # issue 37's targets: >= 400x fewer bytes, <= 5% blocked
UNLIMITED = "sync fp32, unlimited link"
RATE = "50mbit"
HOSTS = 2


def job_args(opts: Options) -> list[str]:
    """The training job every mode runs (modes add their own settings)."""
    steps = 6 if opts.smoke else opts.steps or STEPS
    return [
        f"data.dir={opts.data_dir}",
        *(GPT_TINY if opts.smoke else GPT_3M),
        f"data.micro_batch_size={32 // (opts.hosts or HOSTS)}",  # one micro-batch a rank: 16 on 2 hosts, 8 on 4
        "train.global_batch_size=32",
        "train.warmup_steps=5",
        f"train.max_steps={steps}",
        f"train.eval_every={steps}",
        f"log.every_steps={2 if opts.smoke else 10}",
        "ckpt.every_steps=0",
        "log.certificate=false",
        "dist.startup_timeout_s=120",
    ]


def measured_from(extra: list[str], steps: int) -> int:
    """The step after which a mode's rate is measured: past the warm-up, and for DiLoCo with at least two intervals
    from the record of its first outer sync on (step H, logged after it), so that the window holds one sync per H
    steps (a window from the warm-up to the last step's sync would charge a sync to fewer than H steps)."""
    every = next((int(a.split("=")[1]) for a in extra if a.startswith("train.diloco.every_steps=")), 0)
    return every - 1 if every and steps >= 2 * every else WARM_STEPS


def samples_per_s(records: list[dict[str, Any]], warm: int) -> float:
    """Samples per second from the train records after step `warm` (global batch x steps / elapsed)."""
    train = [r for r in records if r.get("kind") == "train" and r["step"] > warm]
    assert len(train) >= 2, f"fewer than two logged steps after step {warm}"
    first, last = train[0], train[-1]
    return float((last["step"] - first["step"]) * last["global_batch_size"] / (last["time"] - first["time"]))


def run_job(
    folder: Path, train: list[str], rate: str | None, warm: int, timeout_s: float, hosts: int = HOSTS
) -> dict[str, Any]:
    """One job to its end on fresh hosts (rate-limited unless rate is None): samples/s, val loss, outer syncs."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    job = RestartJob(folder, hosts, train, hosts)
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
    return job_figures(read_jsonl(job.run_dir / "metrics.jsonl"), warm)


def job_figures(records: list[dict[str, Any]], warm: int) -> dict[str, Any]:
    """A job's figures from its metrics: samples/s past `warm`, the last validation loss, and DiLoCo's outer syncs,
    one sync's bytes (largest fragment), payload bytes sent per step and seconds blocked on the link per step (both
    over every step, as logged since the previous logged step) and the share of the steps' time blocked."""
    train_rows = [r for r in records if r["kind"] == "train"]
    steps = train_rows[-1]["step"]
    blocked = sum(r.get("outer_sync_s", 0.0) for r in train_rows)
    previous = [0] + [r["step"] for r in train_rows[:-1]]
    stepping = sum(r["step_time_s"] * (r["step"] - before) for r, before in zip(train_rows, previous))
    return {
        "samples_per_s": samples_per_s(records, warm),
        "val_loss": [r for r in records if r["kind"] == "eval"][-1]["val_loss"],
        "outer_syncs": train_rows[-1].get("outer_syncs", 0),
        "outer_sync_s": blocked,
        "outer_sync_bytes": train_rows[-1].get("outer_sync_bytes", 0),
        "bytes_per_step": sum(r.get("outer_sent_bytes", 0) for r in train_rows) / steps,
        "blocked_s_per_step": blocked / steps,
        "blocked_share": blocked / stepping,
    }


def _rows(results: dict[str, list[dict[str, Any]]], smoke: bool, rate: str, hosts: int) -> list[Row]:
    figure = f"slow links ({hosts} hosts, {'no limit: smoke' if smoke else rate})"
    free = summary([r["samples_per_s"] for r in results[UNLIMITED]])["median"]
    sync_loss = results[UNLIMITED][0]["val_loss"]  # every synchronous mode computes the same losses
    ddp_bytes = next((runs[0]["outer_sync_bytes"] for name, runs in results.items() if name in FP32_DILOCO), 0)
    rows = [Row(figure, f"{UNLIMITED}: samples/s", summary([r["samples_per_s"] for r in results[UNLIMITED]]),
                "samples/s", note=f"val loss {sync_loss:.4f}")]  # fmt: skip
    for name, runs in results.items():
        if name == UNLIMITED:
            continue
        h50 = name == "DiLoCo H=50"
        loss = runs[0]["val_loss"] / sync_loss
        note = f"val loss {loss:.3f}x synchronous DDP's"
        if runs[0]["outer_syncs"]:
            note += f"; {runs[0]['outer_syncs']} outer syncs, {runs[0]['outer_sync_s']:.1f} s blocked in them"
        ratio = summary([r["samples_per_s"] / free for r in runs])
        rows.append(Row(figure, f"{name}: samples/s", summary([r["samples_per_s"] for r in runs]), "samples/s"))
        rows.append(Row(figure, f"{name}: vs unlimited sync", ratio, "x", target=">= 0.9" if h50 else "",
                        met=ratio["median"] >= 0.9 if h50 else None, note=note))  # fmt: skip
        if runs[0]["outer_syncs"] and ddp_bytes:  # with an fp32 DiLoCo mode run beside: its sync is fp32 DDP's step
            rows.extend(_link_rows(figure, name, runs, ddp_bytes))
    return rows


def _link_rows(figure: str, name: str, runs: list[dict[str, Any]], ddp_bytes: float) -> list[Row]:
    """A DiLoCo mode's bytes per step (and how many times fewer than fp32 DDP's) and its time blocked per step."""
    streamed = name in STREAMED
    fewer = summary([ddp_bytes / max(r["bytes_per_step"], 1e-9) for r in runs])
    share = summary([r["blocked_share"] for r in runs])
    per_step = summary([r["bytes_per_step"] for r in runs])
    blocked = summary([r["blocked_s_per_step"] for r in runs])
    return [
        Row(figure, f"{name}: bytes sent per step", per_step, "B", note=f"fp32 DDP: {ddp_bytes:,.0f} B a step"),
        Row(figure, f"{name}: fewer bytes than fp32 DDP", fewer, "x", target=">= 400" if streamed else "",
            met=fewer["median"] >= 400 if streamed else None),
        Row(figure, f"{name}: share of step time blocked on the link", share, "", target="<= 0.05 (at 20 Mbit/s)"
            if streamed else "", note=f"{blocked['median']:.4f} s a step"),
    ]  # fmt: skip


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Rows: each mode's samples/s on the limited link, its ratio to the unlimited-link synchronous rate and its
    validation loss against synchronous DDP's; data: every job's figures."""
    modes = SMOKE_MODES if opts.smoke else {m: MODES[m] for m in chosen_modes(opts, MODES, "slow_links")}
    rate, hosts = opts.rate or RATE, opts.hosts or HOSTS
    variants = {UNLIMITED: ([], None), **{m: (extra, None if opts.smoke else rate) for m, extra in modes.items()}}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    folder = opts.work_dir / "slow_links"
    for r in range(1 if opts.smoke else opts.warmup + opts.rounds):
        for name in opts.order(list(variants), r):
            extra, limit = variants[name]
            print(f"slow_links: round {r}: {name} ...", file=sys.stderr, flush=True)
            slug = name.replace(" ", "_").replace("=", "").replace(",", "")
            timeout_s = max(
                900, 2 * (opts.steps or STEPS)
            )  # the synchronous fp32 job on the limited link: ~2.3 s a step
            warm = 0 if opts.smoke else measured_from(extra, opts.steps or STEPS)
            result = run_job(folder / slug, [*job_args(opts), *extra], limit, warm, timeout_s, hosts)
            if opts.smoke or r >= opts.warmup:
                results[name].append(result)
    return _rows(results, opts.smoke, rate, hosts), {"results": results, "rate": rate, "hosts": hosts}
