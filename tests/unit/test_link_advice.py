"""doctor's link advice: the all-reduce line fitted to a sweep, each mode's seconds per step, the choice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.review.link_advice import LinkModel, choose, fit_link, format_advice, mode_costs

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


def test_the_issues_link_and_model_get_diloco_with_an_interval_that_fits() -> None:
    """2 hosts at 50 Mbit/s, 3.2M parameters, 0.29 s of compute per step (issue 37's measurement): an fp32
    all-reduce of 12.8 MB takes ~2 s, 7x the compute; fp16 halves it; DiLoCo fits once it is under 5%."""
    costs = {c.setting: c.link_s for c in mode_costs(LinkModel(0.0, 1 / MBIT_50), 3.2e6)}
    assert costs["(the default)"] == pytest.approx(2.048)
    assert costs["dist.grad_compression=fp16"] == pytest.approx(1.024)
    assert costs["train.diloco.every_steps=50"] == pytest.approx(2.048 / 50)
    best = choose(mode_costs(LinkModel(0.0, 1 / MBIT_50), 3.2e6), 0.29)
    assert best is not None and best.setting == "train.diloco.every_steps=200"  # 0.0102 s, 3.5%; 100 would be 7%
    text = format_advice(sweep(0.0, MBIT_50), 3.2e6, 0.29)
    assert text.splitlines()[-1] == "choose: train.diloco.every_steps=200: the link adds <= 5% to each step's compute"


def test_a_link_too_slow_for_any_mode_says_so_and_without_a_step_time_asks_for_one() -> None:
    assert "choose: none fits: even DiLoCo every 500 steps" in format_advice(sweep(0.0, 1e3), 1e9, 0.1)
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
