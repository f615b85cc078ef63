"""LR schedules: their shapes, and how each continues when a resumed run gets a larger max_steps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import make_trainer, read_metrics
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.config import load_config
from ddptrain.errors import ConfigError
from ddptrain.train.schedules import Plan, PlannedSchedule, config_plan, continued

NAMES = ["cosine", "wsd", "linear", "constant"]
# A small regression model, one micro-batch per step: these tests are about the optimizer, not the model.
TOY = [
    "model.target=toy:build_model",
    "data.target=toy:build_datasets",
    "data.micro_batch_size=8",
    "train.global_batch_size=8",
]


def plan(name: str, warmup: int, max_steps: int, floor: float = 0.1, decay_fraction: float = 0.2) -> Plan:
    cfg = load_config(
        None,
        [
            f"schedule.name={name}",
            f"train.warmup_steps={warmup}",
            f"train.max_steps={max_steps}",
            f"train.min_lr_ratio={floor}",
            f"schedule.decay_fraction={decay_fraction}",
        ],
    )
    return config_plan(cfg)


def warmup_then_cosine(step: int, warmup: int, max_steps: int, floor: float) -> float:
    """The schedule every run used before schedules were configurable (checkpoints resume onto it)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@given(warmup=st.integers(0, 50), max_steps=st.integers(1, 400), floor=st.floats(0, 1))
def test_default_cosine_is_the_schedule_runs_always_had(warmup: int, max_steps: int, floor: float) -> None:
    p = plan("cosine", warmup, max_steps, floor)
    assert all(p.factor(s) == warmup_then_cosine(s, warmup, max_steps, floor) for s in range(max_steps + 2))


@given(
    name=st.sampled_from(NAMES),
    warmup=st.integers(0, 30),
    max_steps=st.integers(1, 300),
    floor=st.floats(0, 1),
    decay_fraction=st.floats(0.01, 1),
)
def test_shapes(name: str, warmup: int, max_steps: int, floor: float, decay_fraction: float) -> None:
    p = plan(name, warmup, max_steps, floor, decay_fraction)
    factors = [p.factor(s) for s in range(max_steps + 1)]
    after_warmup = factors[warmup:]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:])), "no rise after the warm-up"
    if warmup < max_steps:
        assert factors[-1] == pytest.approx(1.0 if name == "constant" else floor)
    if name == "wsd":
        decay_start = max(warmup, max_steps - max(1, round(decay_fraction * max_steps)))
        assert all(f == 1.0 for f in factors[warmup : decay_start + 1]), "wsd is stable at the peak until its decay"


@settings(max_examples=300)
@given(
    name=st.sampled_from(NAMES),
    warmup=st.integers(0, 20),
    old_max=st.integers(2, 200),
    extra=st.integers(1, 200),
    data=st.data(),
)
def test_a_larger_max_steps_continues_without_a_jump(
    name: str, warmup: int, old_max: int, extra: int, data: st.DataObject
) -> None:
    step = data.draw(st.integers(0, old_max - 1), label="resumed at")
    old, new_max = plan(name, warmup, old_max), old_max + extra
    got = continued(old, plan(name, warmup, new_max), step)
    assert got.factor(step) == old.factor(step), "the first LR after the resume is the one the old plan gave"
    rest = [got.factor(s) for s in range(max(step, warmup), new_max + 1)]
    assert all(a >= b for a, b in zip(rest, rest[1:])), "and it only decays from there"
    if name != "constant" and warmup < new_max:
        assert rest[-1] == old.floor, "to the floor at the new max_steps"


@given(warmup=st.integers(0, 20), old_max=st.integers(10, 200), extra=st.integers(1, 200), data=st.data())
def test_wsd_extended_in_its_stable_phase_just_stays_stable_longer(
    warmup: int, old_max: int, extra: int, data: st.DataObject
) -> None:
    old = plan("wsd", warmup, old_max)
    step = data.draw(st.integers(warmup, max(warmup, old.decay_start - 1)), label="resumed at")
    new = plan("wsd", warmup, old_max + extra)
    assert continued(old, new, step) == new


def test_schedule_state_round_trip_and_old_checkpoints() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    p = plan("wsd", 2, 20)
    optimizer = torch.optim.SGD(params, lr=1.0)
    first = PlannedSchedule(optimizer, p)
    for _ in range(7):
        optimizer.step()
        first.step()
    first.follow(plan("wsd", 2, 40))
    state = first.state_dict()
    second = PlannedSchedule(torch.optim.SGD(params, lr=1.0), p)
    second.load_state_dict(state)
    assert (second.last_epoch, second.plan, second.source) == (7, first.plan, first.source)
    # A checkpoint from before plans existed holds a LambdaLR's state: the step comes back, the plan is the config's.
    optimizer = torch.optim.SGD(params, lr=1.0)
    legacy = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: p.factor(s))
    for _ in range(5):
        optimizer.step()
        legacy.step()
    third = PlannedSchedule(torch.optim.SGD(params, lr=1.0), p)
    third.load_state_dict(legacy.state_dict())
    assert third.last_epoch == 5 and third.get_lr() == legacy.get_last_lr()


@pytest.mark.parametrize("name", ["cosine", "wsd"])
def test_resume_with_a_larger_max_steps_continues_the_lr(corpus_dir: Path, tmp_path: Path, name: str) -> None:
    """Saved at step 4 of 10, resumed with max_steps=20: step 5 uses the LR step 5 would have used."""
    common = [*TOY, f"schedule.name={name}", "train.warmup_steps=2", "ckpt.every_steps=0", "log.every_steps=1"]
    first = make_trainer(corpus_dir, tmp_path, [*common, "train.max_steps=10"])
    for _ in range(4):
        first.train_step()
    next_lr = first.optimizer.param_groups[0]["lr"]
    first.save_checkpoint()
    first.checkpointer.wait()
    second = make_trainer(corpus_dir, tmp_path, [*common, "train.max_steps=20"])
    assert second.step == 4
    used: list[float] = []
    step = second.train_step

    def recording_step():  # type: ignore[no-untyped-def]
        used.append(second.optimizer.param_groups[0]["lr"])
        return step()

    second.train_step = recording_step
    second.fit()
    assert used[0] == next_lr
    assert all(a >= b for a, b in zip(used, used[1:])) and len(used) == 16
    if name == "wsd":  # stable at step 4 of 10: the stable phase stretches; steps 5-17 at the peak, then decay
        assert used[:13] == [3e-3] * 13 and used[13] < 3e-3
    lrs = [r["lr"] for r in read_metrics(tmp_path)]
    assert lrs[-1] == pytest.approx(0.1 * 3e-3)  # min_lr_ratio x lr, reached at the new max_steps


def test_custom_optimizer_and_schedule_factories(corpus_dir: Path, tmp_path: Path) -> None:
    custom = [
        *TOY,
        "optim.target=custom_optim:build_sgd",
        "schedule.target=custom_optim:build_step_lr",
        "train.max_steps=6",
    ]
    trainer = make_trainer(corpus_dir, tmp_path, [*custom, "optim.kwargs={momentum: 0.5}"])
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0 and decay["momentum"] == 0.5
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    trainer.fit()
    assert trainer.scheduler.get_last_lr()[0] == pytest.approx(3e-3 * 0.5**3)  # halved at steps 2, 4, 6
    resumed = make_trainer(corpus_dir, tmp_path, [*custom, "optim.kwargs={momentum: 0.5}"])
    assert resumed.step == 6 and resumed.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert resumed.optimizer.state_dict()["state"].keys() == trainer.optimizer.state_dict()["state"].keys()


@pytest.mark.parametrize(
    ("key", "target"), [("optim", "custom_optim:not_an_optimizer"), ("schedule", "custom_optim:nope")]
)
def test_a_bad_factory_is_a_config_error(corpus_dir: Path, tmp_path: Path, key: str, target: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}.target="):
        make_trainer(corpus_dir, tmp_path, [*TOY, f"{key}.target={target}"])
