"""Which way of synchronizing fits a link: doctor's bandwidth sweep turned into seconds per step per mode.

An all-reduce of B bytes takes about `latency + B x seconds_per_byte` once messages are large; both
come from the sweep's two largest sizes, and a model's gradients (4 bytes per parameter in fp32) are
usually larger than the sweep, so the line is extended past it. Each mode sends a known share of those
bytes: synchronous DDP all of them every step, fp16/bf16 compression half, DiLoCo all of them once
every H steps. With a step's compute time the advice names the first mode whose link time is a small
share of it (PowerSGD's bytes depend on the shapes of the weight matrices, so it is not estimated here).
"""

from __future__ import annotations

from dataclasses import dataclass

SYNC_SHARE = 0.10  # every-step modes fit when the link adds at most this share of a step's compute
OUTER_SHARE = 0.05  # DiLoCo's outer sync: at most this share, averaged over its H steps
DILOCO_EVERY = (10, 20, 50, 100, 200, 500)  # the intervals considered, shortest (closest to synchronous) first


@dataclass(frozen=True)
class LinkModel:
    """All-reduce time as a line in the message size: latency_s + bytes x s_per_byte."""

    latency_s: float
    s_per_byte: float

    def seconds(self, n_bytes: float) -> float:
        """The time of one all-reduce of n_bytes."""
        return self.latency_s + n_bytes * self.s_per_byte


def fit_link(rows: list[dict[str, float]]) -> LinkModel | None:
    """The line through the sweep's two largest sizes (rows as bandwidth_sweep gives them); None without rows."""
    if not rows:
        return None
    points = sorted((r["bytes"], r["time_us"] * 1e-6) for r in rows)
    if len(points) == 1:
        size, seconds = points[0]
        return LinkModel(0.0, seconds / size)
    (b1, t1), (b2, t2) = points[-2:]
    slope = max((t2 - t1) / (b2 - b1), 0.0) or t2 / b2  # a noisy sweep can flatten the line: use the average
    return LinkModel(max(t1 - slope * b1, 0.0), slope)


@dataclass(frozen=True)
class ModeCost:
    """One way to synchronize: the setting that selects it and the link's seconds per optimizer step."""

    setting: str
    what: str
    link_s: float


def mode_costs(link: LinkModel, params: float) -> list[ModeCost]:
    """Seconds per step on this link for a model of `params` parameters, in the order the advice tries them."""
    fp32 = link.seconds(4 * params)
    return [
        ModeCost("(the default)", "synchronous, fp32 gradients every step", fp32),
        ModeCost("dist.grad_compression=fp16", "fp16 gradients every step (bf16 on NCCL)", link.seconds(2 * params)),
        *(
            ModeCost(f"train.diloco.every_steps={h}", f"DiLoCo: fp32 weights every {h} steps", fp32 / h)
            for h in DILOCO_EVERY
        ),
    ]


def choose(costs: list[ModeCost], step_s: float) -> ModeCost | None:
    """The first mode whose link time fits beside `step_s` of compute; None when even the sparsest does not."""
    for cost in costs:
        share = OUTER_SHARE if cost.setting.startswith("train.diloco") else SYNC_SHARE
        if cost.link_s <= share * step_s:
            return cost
    return None


def format_advice(rows: list[dict[str, float]], params: float, step_s: float | None) -> str:
    """The advice block of doctor's report: each mode's link time (and its ratio to compute), then the choice."""
    link = fit_link(rows)
    if link is None:
        return "link advice: no sweep to measure the link with (raise --max-mb)"
    costs = mode_costs(link, params)
    header = f"link advice for {params / 1e6:.4g}M parameters ({4 * params / 2**20:.4g} MiB of fp32 gradients)"
    lines = [f"{header}, {step_s:g} s of compute per step:" if step_s else f"{header}:"]
    for c in costs:
        ratio = f"{c.link_s / step_s:>9.3f}x" if step_s else ""
        lines.append(f"  {c.setting:<30} {c.what:<42} {c.link_s:>9.4f} s/step {ratio}")
    if not step_s:
        lines.append("choose: give --step-s (a step's compute time, e.g. step_s from a one-node run) to get advice")
        return "\n".join(lines)
    best = choose(costs, step_s)
    if best is None:
        lines.append(
            f"choose: none fits: even DiLoCo every {DILOCO_EVERY[-1]} steps spends "
            f"{costs[-1].link_s / step_s:.0%} of a step on the link: a faster link, or more compute per step"
        )
    else:
        budget = OUTER_SHARE if best.setting.startswith("train.diloco") else SYNC_SHARE
        name = f"{best.what} {best.setting}" if best.setting.startswith("(") else best.setting
        lines.append(f"choose: {name}: the link adds <= {budget:.0%} to each step's compute")
    return "\n".join(lines)
