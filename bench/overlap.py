"""Overlap of gradient communication with backward, on a simulated slow link.

On 2 shared CPU cores a real all-reduce competes with backward for the same cores, so overlap
cannot show. Instead a DDP comm hook hands every bucket to ONE background thread (a link sends one
bucket after another) that sleeps bytes / bandwidth and then completes the bucket's future:
communication that costs wall time but no CPU. The hook does not reduce (each rank keeps its own
gradient); only timing is measured here.

    exposed fraction = link time after backward / link time, per step

DDP hands over the last bucket when backward ends and waits for all buckets before the step goes
on, so the link time after the last bucket was ready is exactly what the step waits for. This is
read from the link's own timestamps, step by step; the same figure from step times (step with the
link - step with an infinitely fast link) is also recorded, but on a shared machine the difference
of two noisy step times is mostly noise.

With small buckets the link starts while backward still runs (exposed << 1); with one bucket it
starts only when backward is over (exposed ~ 1). The bandwidth is set so that one step's
gradients take LINK_SHARE of a no-communication step on the link.
"""

import argparse
import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.build import DEFAULT_MODEL, SMOKE_MODEL, bench_config, build_trainer
from bench.common import Options, Row, Variant, run_job, summary
from ddptrain.dist import close_distributed, init_distributed
from ddptrain.train.trainer import Trainer

LINK_SHARE = 0.4
BUCKETS_MB = {"small buckets": 0.25, "one bucket": 1000.0}


class SlowLink:
    """A simulated link: one thread, buckets sent in order, each taking nbytes / bandwidth seconds."""

    def __init__(self) -> None:
        self.bytes_per_s = math.inf
        self.busy_s = 0.0  # simulated send time since the last reset
        self.buckets = 0
        self.events: list[tuple[float, float, float, int]] = []  # (queued, started, sent, nbytes) per bucket
        self._queue: queue.SimpleQueue[tuple[torch.Tensor, torch.futures.Future, float]] = queue.SimpleQueue()
        threading.Thread(target=self._send, name="slow-link", daemon=True).start()

    # Annotations stay real objects here (no `from __future__ import annotations`): DDP checks them.
    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """DDP comm hook: queue the bucket; its future completes when the link has 'sent' it."""
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._queue.put((bucket.buffer(), fut, time.perf_counter()))
        return fut

    def _send(self) -> None:
        while True:
            buf, fut, queued = self._queue.get()
            nbytes = buf.numel() * buf.element_size()
            seconds = nbytes / self.bytes_per_s
            start = time.perf_counter()
            if seconds > 0:
                time.sleep(seconds)
            self.events.append((queued, start, time.perf_counter(), nbytes))
            self.busy_s += seconds
            self.buckets += 1
            fut.set_result(buf)

    def reset(self) -> tuple[float, int]:
        """(link seconds, buckets) since the previous reset."""
        out = (self.busy_s, self.buckets)
        self.busy_s, self.buckets = 0.0, 0
        self.events.clear()
        return out

    def take_step(self, t0: float) -> tuple[float, list[dict[str, float]]]:
        """(exposed seconds, bucket timeline in ms from t0) of the step just finished.

        DDP hands over the last bucket when backward ends and waits for every bucket before the
        step goes on: the link time after the last bucket was ready is what the step waits for.
        """
        events, self.events = self.events, []
        if not events:
            return 0.0, []
        exposed = max(0.0, max(e for _, _, e, _ in events) - max(q for q, _, _, _ in events))
        return exposed, [
            {"ready_ms": (q - t0) * 1e3, "start_ms": (s - t0) * 1e3, "sent_ms": (e - t0) * 1e3, "MB": n / 1e6}
            for q, s, e, n in events
        ]


def worker(out: Path, rounds: int, steps: int, smoke: bool, data: Path, run_dir: Path) -> None:
    """Inside torchrun: two Trainers (small buckets, one bucket) sharing one slow link."""
    model = SMOKE_MODEL if smoke else DEFAULT_MODEL
    cfgs = {
        name: bench_config(model, data, run_dir / name.replace(" ", "-"), [f"dist.bucket_cap_mb={mb}"])
        for name, mb in BUCKETS_MB.items()
    }
    ctx = init_distributed(next(iter(cfgs.values())).dist)
    link = SlowLink()
    trainers: dict[str, Trainer] = {}
    for name, cfg in cfgs.items():
        trainers[name] = build_trainer(cfg, ctx)
        trainers[name].timer.send_through(trainers[name].ddp, link.hook)  # after the trainer's own stamping hook

    timelines: dict[str, list[dict[str, float]]] = {}

    def timed(trainer: Trainer, bytes_per_s: float) -> dict[str, float]:
        link.bytes_per_s = bytes_per_s
        dist.barrier(group=ctx.group)
        link.reset()
        exposed = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            t_step = time.perf_counter()
            trainer.train_step()
            step_exposed, timeline = link.take_step(t_step)
            exposed += step_exposed
        seconds = (time.perf_counter() - t0) / steps
        busy, buckets = link.reset()
        timelines[trainer.cfg.run.dir or ""] = timeline  # the last step's, for the JSON
        return {"step_s": seconds, "link_s": busy / steps, "buckets": buckets / steps, "exposed_s": exposed / steps}

    for t in trainers.values():  # warm-up: first steps build DDP's buckets
        timed(t, math.inf)
    base = timed(trainers["one bucket"], math.inf)["step_s"]
    grad_bytes = sum(p.numel() * p.element_size() for p in trainers["one bucket"].model.parameters())
    bandwidth = torch.tensor([grad_bytes / (LINK_SHARE * base)], dtype=torch.float64)
    dist.broadcast(bandwidth, 0, group=ctx.group)  # both ranks simulate the same link
    rows: dict[str, list[dict[str, float]]] = {}
    names = list(trainers)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            fast = timed(trainers[name], math.inf)
            slow = timed(trainers[name], float(bandwidth))
            rows.setdefault(name, []).append(
                {
                    "fast_step_s": fast["step_s"],
                    "slow_step_s": slow["step_s"],
                    "link_s": slow["link_s"],
                    "buckets": slow["buckets"],
                    "exposed": slow["exposed_s"] / slow["link_s"],
                    "step_time_exposed": (slow["step_s"] - fast["step_s"]) / slow["link_s"],
                }
            )
    if ctx.is_main:
        last = {name: timelines[cfgs[name].run.dir or ""] for name in names}
        out.write_text(
            json.dumps(
                {
                    "bandwidth_MBps": float(bandwidth) / 1e6,
                    "grad_MB": grad_bytes / 1e6,
                    "rounds": rows,
                    "last_step_timeline": last,
                }
            )
        )
    close_distributed(ctx)


def run(opts: Options) -> tuple[list[Row], dict[str, Any]]:
    """Launch the 2-rank job; exposed fraction per bucket setting."""
    out = opts.work_dir / "overlap.json"
    args = [
        "--out",
        str(out),
        "--rounds",
        str(opts.rounds),
        "--steps",
        "2" if opts.smoke else "8",
        "--data",
        str(opts.data_dir),
        "--run-dir",
        str(opts.work_dir / "runs" / "overlap"),
    ]
    run_job(
        Variant("overlap", "bench.overlap", args + (["--smoke"] if opts.smoke else []), nproc=2, forked=opts.smoke),
        opts.work_dir / "overlap.log",
    )
    data = json.loads(out.read_text())
    rows = []
    for name, rounds in data["rounds"].items():
        s = summary([r["exposed"] for r in rounds])
        target, met = ("<= 0.4", s["median"] <= 0.4) if name == "small buckets" else ("~1", s["median"] >= 0.8)
        buckets = summary([r["buckets"] for r in rounds])["median"]
        link_ms = summary([r["link_s"] for r in rounds])["median"] * 1000
        by_time = summary([r["step_time_exposed"] for r in rounds])["median"]
        rows.append(
            Row(
                "overlap",
                f"exposed communication fraction, {name} ({BUCKETS_MB[name]:g} MB cap)",
                s,
                "",
                target,
                met,
                f"{buckets:.0f} buckets/step, link {link_ms:.0f} ms/step "
                f"({data['bandwidth_MBps']:.0f} MB/s); from step times (noisy): {by_time:.2f}",
            )
        )
    return rows, data


def main() -> None:
    """Worker entry point (under torchrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    worker(a.out, a.rounds, a.steps, a.smoke, a.data, a.run_dir)


if __name__ == "__main__":
    main()
