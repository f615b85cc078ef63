"""The hang watchdog's calibration and budgets (a real thread, short budgets), and the resume certificate's
sample accounting."""

from __future__ import annotations

import re
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.observe.certificate import consumed
from ddptrain.observe.watchdog import Budgets, Hang, HangWatchdog, percentile


def _watchdog(budgets: Budgets) -> tuple[HangWatchdog, list[Hang], list[str], threading.Event]:
    fired: list[Hang] = []
    logged: list[str] = []
    done = threading.Event()

    def on_hang(h: Hang) -> None:
        fired.append(h)
        done.set()

    return HangWatchdog(budgets, on_hang, logged.append), fired, logged, done


@given(st.lists(st.floats(0.0, 100.0), min_size=1, max_size=300), st.floats(0.0, 1.0))
def test_percentile_is_an_observed_value_with_enough_below_it(values: list[float], q: float) -> None:
    p = percentile(values, q)
    assert p in values
    assert sum(v <= p for v in values) >= q * len(values) - 1e-9


@pytest.mark.timeout(30)
def test_budget_is_k_times_p99_plus_margin_after_warmup_and_fires_on_a_stall() -> None:
    wd, fired, logged, done = _watchdog(
        Budgets(True, k=3.0, margin_s=0.3, warmup_steps=5, max_s=60.0, eval_s=60.0, checkpoint_s=60.0)
    )
    for step in range(1, 10):  # 2 uncounted + 7 timed steps of at least 20 ms
        wd.arm(step)
        time.sleep(0.02)
        wd.disarm()
    derivation = re.fullmatch(
        r"3 x p99 (\d+\.\d{3}) s \+ margin 0\.3 s = (\d+\.\d\d) s, p99 of the last 5 steps", wd.derivation
    )
    assert derivation and logged == [f"watchdog: step budget {wd.derivation}"], (wd.derivation, logged)
    p99 = float(derivation[1])
    assert p99 >= 0.02 and wd.step_budget_s == pytest.approx(3 * p99 + 0.3, abs=0.002)
    with wd.phase("evaluation"):
        time.sleep(wd.step_budget_s + 0.3)  # an evaluation longer than a step budget: its own budget applies
    assert not fired
    wd.arm(10)
    assert done.wait(60), "the watchdog did not fire"
    wd.stop()
    hang = fired[0]
    assert (hang.step, hang.phase, hang.budget_s, hang.derivation) == (10, "step", wd.step_budget_s, wd.derivation)
    assert hang.waited_s > hang.budget_s  # it fired on the stall, once the step had outlasted its budget


@pytest.mark.timeout(30)
def test_before_warmup_the_collective_timeout_applies_and_disabled_never_fires() -> None:
    wd, fired, _, _ = _watchdog(Budgets(False, 3.0, 0.0, 5, max_s=0.2, eval_s=0.2, checkpoint_s=0.2))
    wd.arm(1)
    time.sleep(0.5)
    assert not fired and wd.step_budget_s == pytest.approx(0.2) and "not calibrated" in wd.derivation
    wd.stop()


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(8, 200),
    gb=st.sampled_from([2, 4, 8]),
    world=st.sampled_from([1, 2]),
    steps_done=st.integers(1, 60),
    window=st.integers(1, 12),
)
def test_consumed_names_exactly_the_ids_the_ranks_read(
    n: int, gb: int, world: int, steps_done: int, window: int
) -> None:
    samplers = [ResumableDistributedSampler(n, gb, r, world, seed=3) for r in range(world)]
    if samplers[0].steps_per_epoch < 1:
        return
    read: list[list[int]] = []
    for _ in range(steps_done):  # what the ranks really read, step by step, as the trainer drives them
        if samplers[0].epoch_done:
            for s in samplers:
                s.set_epoch(s.epoch + 1)
        ids = []
        for s in samplers:
            ids += list(s)[: s.per_rank]
            s.advance()
        read.append(ids)
    window = min(window, steps_done)
    segments, _ = consumed(samplers[0], window)
    named = [int(i) for e, a, b in segments for i in samplers[0].epoch_order(e)[a:b]]
    assert named == [i for step in read[-window:] for i in step]
