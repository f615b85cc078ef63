"""doctor's link advice: the all-reduce line fitted to a sweep, each mode's seconds per step, the choice; the real
doctor output in docs/slow-links.md is what the advice says for its sweep."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.config.train import outer_payload_bytes as payload_bytes
from ddptrain.review.link_advice import STREAMING, LinkModel, choose, fit_link, format_advice, mode_costs

MBIT_50 = 50e6 / 8  # bytes per second


def sweep(latency_s: float, bytes_per_s: float, sizes: tuple[int, ...] = (1024, 4096, 16384, 65536)) -> list[dict]:
    """Rows as doctor's bandwidth_sweep gives them, for a link that is exactly a line."""
    return [{"bytes": b, "time_us": (latency_s + b / bytes_per_s) * 1e6} for b in sizes]


def test_the_line_through_the_sweep_is_the_links_latency_and_bandwidth() -> None:
    link = fit_link(sweep(0.002, MBIT_50))
    assert link is not None
    assert link.latency_s == pytest.approx(0.002) and link.s_per_byte == pytest.approx(1 / MBIT_50)
    assert fit_link([]) is None
    assert fit_link(sweep(0.0, 1e9, (4096,))) == LinkModel(0.0, pytest.approx(1e-9))


STREAMED = "train.diloco.outer_dtype=int8 train.diloco.fragments=4 train.diloco.delay_steps=1"


def test_the_issues_link_and_model_get_diloco_with_an_interval_that_fits() -> None:
    """2 hosts at 50 Mbit/s, 3.2M parameters, 0.29 s of compute per step (issue 37's measurement): an fp32
    all-reduce of 12.8 MB takes ~2 s, 7x the compute; fp16 halves it; fp32 DiLoCo fits once it is under 5% (every
    200 steps), int8 DiLoCo at a quarter of the bytes every 50, and streaming DiLoCo's quarter of that, 0.13 s,
    fits in the one step of compute it overlaps: blocked 0, from the shortest interval on."""
    link = LinkModel(0.0, 1 / MBIT_50)
    costs = {c.setting: c for c in mode_costs(link, 3.2e6)}
    assert costs["(the default)"].link_s == pytest.approx(2.048)
    assert costs["dist.grad_compression=fp16"].link_s == pytest.approx(1.024)
    assert costs["train.diloco.every_steps=50"].link_s == pytest.approx(2.048 / 50)
    int8 = payload_bytes(3_200_000, "int8") / MBIT_50
    assert costs["train.diloco.every_steps=50 train.diloco.outer_dtype=int8"].link_s == pytest.approx(int8 / 50)
    streamed = costs[f"train.diloco.every_steps=10 {STREAMED}"]
    assert STREAMING == (4, 1) and streamed.sync_s == pytest.approx(payload_bytes(800_000, "int8") / MBIT_50)
    assert streamed.link_s == pytest.approx(streamed.sync_s * 4 / 10) and streamed.blocked_s(0.29) == 0.0
    assert streamed.blocked_s(0.1) == pytest.approx((streamed.sync_s - 0.1) * 4 / 10)  # 0.128 s: 0.028 blocked
    fp32_only = [c for c in costs.values() if "=int8" not in c.setting]
    assert [c.setting for c in fp32_only if c is choose(fp32_only, 0.29)] == ["train.diloco.every_steps=200"]
    int8_only = [c for c in costs.values() if "fragments" not in c.setting]
    best = choose(int8_only, 0.29)  # every 50 steps: 0.0103 s a step, 3.5%; every 20: 8.8%
    assert best is not None and best.setting == "train.diloco.every_steps=50 train.diloco.outer_dtype=int8"
    text = format_advice(sweep(0.0, MBIT_50), 3.2e6, 0.29).splitlines()
    assert "  streaming DiLoCo: 1/4 in int8 every 2.5 steps, 1 overlapped" in text[6]
    assert text[-1] == f"choose: train.diloco.every_steps=10 {STREAMED}: the link adds <= 5% to each step's compute"


def test_a_fast_link_gets_synchronous_training_and_a_middling_one_fp32_diloco_first() -> None:
    fast = choose(mode_costs(LinkModel(0.0, 1 / 500e6), 3.2e6), 0.29)  # 4 Gbit/s: 12.8 MB every step is 8.8%
    assert fast is not None and fast.setting == "(the default)"
    middling = choose(mode_costs(LinkModel(0.0, 1 / 100e6), 3.2e6), 0.29)  # 800 Mbit/s: fp32 every 10 steps, 4.4%
    assert middling is not None and middling.setting == "train.diloco.every_steps=10"


def test_a_link_too_slow_for_any_mode_says_so_and_without_a_step_time_asks_for_one() -> None:
    assert "choose: none fits: even streaming DiLoCo: 1/4 in int8 every 125 steps" in format_advice(
        sweep(0.0, 1e3), 1e9, 0.1
    )
    assert format_advice(sweep(0.0, MBIT_50), 1e6, None).splitlines()[-1].startswith("choose: give --step-s")
    assert format_advice([], 1e6, 1.0).startswith("link advice: no sweep")


@given(
    st.floats(1e-6, 1e-2),
    st.floats(1e5, 1e11),
    st.floats(1e3, 1e11),
    st.floats(1e-3, 1e3),
    st.floats(1.0, 100.0),
)
def test_a_faster_link_or_more_compute_never_chooses_a_sparser_mode(
    latency: float, bandwidth: float, params: float, step_s: float, factor: float
) -> None:
    order = [c.setting for c in mode_costs(LinkModel(0.0, 1.0), 1.0)] + ["none"]

    def rank(link: LinkModel, step: float) -> int:
        best = choose(mode_costs(link, params), step)
        return order.index(best.setting if best else "none")

    slow = LinkModel(latency, 1 / bandwidth)
    assert rank(LinkModel(latency / factor, 1 / (bandwidth * factor)), step_s) <= rank(slow, step_s)
    assert rank(slow, step_s * factor) <= rank(slow, step_s)


def _documented_doctor_output() -> tuple[list[dict[str, float]], str]:
    """The sweep rows and the advice of the real doctor output in docs/slow-links.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "slow-links.md").read_text()
    block = text[text.index("all_reduce bandwidth (gloo, 2 ranks") :]
    block = block[: block.index("```")].strip()
    table, advice = block.split("\n\n", 1)
    units = {"KiB": 1024, "MiB": 2**20}
    rows = [
        {"bytes": float(m[1]) * units[m[2]], "time_us": float(m[3])}
        for m in re.finditer(r"^\s+(\d+) (KiB|MiB)\s+\d+\s+([\d.]+)", table, re.M)
    ]
    return rows, advice


def test_the_documented_doctor_advice_is_what_the_advice_says_for_its_sweep() -> None:
    """docs/slow-links.md's doctor example (3.2M parameters, 0.29 s per step, 2 hosts at 50 Mbit/s): the sweep is
    real, the advice under it the one the advice computes from it today."""
    rows, advice = _documented_doctor_output()
    assert len(rows) == 7
    assert advice == format_advice(rows, 3.2e6, 0.29)
