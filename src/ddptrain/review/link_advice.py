"""Which way of synchronizing fits a link: doctor's bandwidth sweep turned into seconds per step per mode.

An all-reduce of B bytes takes about `latency + B x seconds_per_byte` once messages are large; both
come from the sweep's two largest sizes, and a model's gradients (4 bytes per parameter in fp32) are
usually larger than the sweep, so the line is extended past it. Each mode sends a known share of those
bytes: synchronous DDP all of them every step, fp16/bf16 compression half, DiLoCo all of them once
every H steps (in int8: a quarter, plus a scale per 2,048 values), streaming DiLoCo (P fragments, int8,
each sync overlapping `delay_steps` inner steps) 1/P of DiLoCo int8's every H/P steps, blocked only for
what of a sync does not fit in its delay_steps steps of compute. With a step's compute time the advice
names the first mode, in the order below (closest to synchronous training first: every step, then the
shortest DiLoCo interval, fp32 before int8 before streaming), whose time blocked on the link is a small
share of it (PowerSGD's bytes depend on the shapes of the weight matrices, so it is not estimated here).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddptrain.config.train import outer_payload_bytes

SYNC_SHARE = 0.10  # every-step modes fit when the link adds at most this share of a step's compute
OUTER_SHARE = 0.05  # DiLoCo's outer sync: at most this share, averaged over its H steps
DILOCO_EVERY = (10, 20, 50, 100, 200, 500)  # the intervals considered, shortest (closest to synchronous) first
STREAMING = (4, 1)  # streaming DiLoCo's fragments P and delay_steps (issue 37's setting, the paper's small delay)


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
    """One way to synchronize: the settings that select it, one sync's seconds on the link, the steps between two
    syncs (1: every step) and the inner steps each sync overlaps (train.diloco.delay_steps)."""

    setting: str
    what: str
    sync_s: float
    every: float = 1.0
    overlap: int = 0

    @property
    def link_s(self) -> float:
        """The link's seconds per optimizer step, overlapped or not."""
        return self.sync_s / self.every

    def blocked_s(self, step_s: float) -> float:
        """Seconds per step the ranks wait on the link with `step_s` of compute per step: what of each sync does not
        fit in the compute of the steps it overlaps."""
        return max(self.sync_s - self.overlap * step_s, 0.0) / self.every


def _diloco(link: LinkModel, params: float, h: int) -> list[ModeCost]:
    """DiLoCo every h steps: fp32, int8, and streaming in STREAMING's fragments with its delay (int8)."""
    parts, delay = STREAMING
    int8 = link.seconds(outer_payload_bytes(round(params), "int8"))
    streamed = link.seconds(outer_payload_bytes(round(params / parts), "int8"))
    every = f"train.diloco.every_steps={h}"
    return [
        ModeCost(every, f"DiLoCo: fp32 weights every {h} steps", link.seconds(4 * params), h),
        ModeCost(f"{every} train.diloco.outer_dtype=int8", f"DiLoCo: int8 weights every {h} steps", int8, h),
        ModeCost(
            f"{every} train.diloco.outer_dtype=int8 train.diloco.fragments={parts} train.diloco.delay_steps={delay}",
            f"streaming DiLoCo: 1/{parts} in int8 every {h / parts:g} steps, {delay} overlapped",
            streamed,
            h / parts,
            delay,
        ),
    ]


def mode_costs(link: LinkModel, params: float) -> list[ModeCost]:
    """Each mode's cost on this link for a model of `params` parameters, in the order the advice tries them."""
    return [
        ModeCost("(the default)", "synchronous, fp32 gradients every step", link.seconds(4 * params)),
        ModeCost("dist.grad_compression=fp16", "fp16 gradients every step (bf16 on NCCL)", link.seconds(2 * params)),
        *(cost for h in DILOCO_EVERY for cost in _diloco(link, params, h)),
    ]


def choose(costs: list[ModeCost], step_s: float) -> ModeCost | None:
    """The first mode whose time blocked on the link fits beside `step_s` of compute; None when none does."""
    for cost in costs:
        share = OUTER_SHARE if cost.setting.startswith("train.diloco") else SYNC_SHARE
        if cost.blocked_s(step_s) <= share * step_s:
            return cost
    return None


def format_advice(rows: list[dict[str, float]], params: float, step_s: float | None) -> str:
    """The advice block of doctor's report: each mode's link time per step (and, given the compute per step, the
    time blocked and its ratio to compute), then the choice: the settings that select it."""
    link = fit_link(rows)
    if link is None:
        return "link advice: no sweep to measure the link with (raise --max-mb)"
    costs = mode_costs(link, params)
    header = f"link advice for {params / 1e6:.4g}M parameters ({4 * params / 2**20:.4g} MiB of fp32 gradients)"
    lines = [f"{header}, {step_s:g} s of compute per step:" if step_s else f"{header}:"]
    width = max(len(c.what) for c in costs)
    blocked = "  blocked s/step  x compute" if step_s else ""
    lines.append(f"  {'mode':<{width}} {'link s/step':>11}{blocked}")
    for c in costs:
        ratio = f" {c.blocked_s(step_s):>15.4f} {c.blocked_s(step_s) / step_s:>10.3f}" if step_s else ""
        lines.append(f"  {c.what:<{width}} {c.link_s:>11.4f}{ratio}")
    if not step_s:
        lines.append("choose: give --step-s (a step's compute time, e.g. step_s from a one-node run) to get advice")
        return "\n".join(lines)
    best = choose(costs, step_s)
    if best is None:
        lines.append(
            f"choose: none fits: even {costs[-1].what} blocks "
            f"{costs[-1].blocked_s(step_s) / step_s:.0%} of a step on the link: a faster link, or more compute per step"
        )
    else:
        budget = OUTER_SHARE if best.setting.startswith("train.diloco") else SYNC_SHARE
        name = f"{best.what} {best.setting}" if best.setting.startswith("(") else best.setting
        lines.append(f"choose: {name}: the link adds <= {budget:.0%} to each step's compute")
    return "\n".join(lines)
