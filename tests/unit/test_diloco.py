"""DiLoCo's outer step against a hand computation (two groups simulated in this process), and the sample stream:
at any number of groups, the groups together take each sample of every global batch once; the outer dtype's
rounding and the mean over groups (simulated), the fragments' schedule, and how an optimizer's state is mapped for
a checkpoint under FSDP."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.config import load_config
from ddptrain.config.train import INT8_CHUNK as CHUNK
from ddptrain.config.train import DiLoCoConfig
from ddptrain.config.train import outer_payload_bytes as payload_bytes
from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.dist import DistContext
from ddptrain.errors import ConfigError
from ddptrain.ft_env import FaultToleranceEnv
from ddptrain.train.sync import build_sync
from ddptrain.train.sync.diloco import outer_optimizer, outer_update, pseudo_gradient
from ddptrain.train.sync.diloco_shards import local_tree, map_optimizer_state
from ddptrain.train.sync.fragments import fragments_due, split_fragments, sync_plan
from ddptrain.train.sync.in_place import check_in_place
from ddptrain.train.sync.outer_dtype import (
    decode,
    dequantize_int8,
    encode,
    mean_of_payloads,
    quantize_int8,
)
from ddptrain.train.sync.outer_dtype import start as start_exchange


def _drift(params: list[torch.Tensor], seed: int) -> None:
    """A group's inner steps, as far as the outer step sees them: its weights moved its own way."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.add_(torch.randn(p.shape, generator=g) * 0.1)


def _syncs(lr: float, momentum: float, rounds: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(global weights after `rounds` outer steps of 2 groups, the same computed by hand)."""
    torch.manual_seed(0)
    start = [torch.randn(3, 2), torch.randn(4)]
    global_params = [t.clone() for t in start]
    outer = outer_optimizer(global_params, DiLoCoConfig(every_steps=2, outer_lr=lr, outer_momentum=momentum))
    hand, buffers = [t.clone() for t in start], [torch.zeros_like(t) for t in start]
    for sync in range(rounds):
        groups = [[t.clone() for t in global_params] for _ in range(2)]  # local := global, then inner steps
        for g, params in enumerate(groups):
            _drift(params, 10 * sync + g)
        deltas = [pseudo_gradient(global_params, params) for params in groups]
        outer_update(outer, global_params, (deltas[0] + deltas[1]) / 2)
        for i, w in enumerate(hand):
            d = w - (groups[0][i] + groups[1][i]) / 2  # global - the groups' mean local weights
            buffers[i] = momentum * buffers[i] + d if sync else d.clone()  # torch's SGD: no dampening at first
            w -= lr * (d + momentum * buffers[i]) if momentum else lr * d
    return global_params, hand


def test_outer_step_is_nesterov_sgd_on_the_groups_mean_pseudo_gradient() -> None:
    got, hand = _syncs(lr=0.7, momentum=0.9, rounds=3)
    for a, b in zip(got, hand):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    moved, plain = _syncs(lr=0.7, momentum=0.0, rounds=3)  # no momentum: another path (nesterov off)
    for a, b in zip(moved, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got[0], moved[0])  # momentum changed the outcome


def test_plain_averaging_is_the_mean_of_the_groups_weights() -> None:
    torch.manual_seed(1)
    global_params = [torch.randn(5)]
    outer = outer_optimizer(global_params, DiLoCoConfig(every_steps=2, outer_lr=1.0, outer_momentum=0.0))
    a, b = [global_params[0] + 1.0], [global_params[0] - 3.0]
    outer_update(outer, global_params, (pseudo_gradient(global_params, a) + pseudo_gradient(global_params, b)) / 2)
    torch.testing.assert_close(global_params[0], (a[0] + b[0]) / 2)


@settings(max_examples=40, deadline=None)
@given(
    groups=st.integers(1, 4),
    per_group=st.integers(1, 3),
    micro=st.integers(1, 3),
    accum=st.integers(1, 2),
    every=st.integers(1, 5),
)
def test_the_groups_take_each_sample_of_a_global_batch_once(
    groups: int, per_group: int, micro: int, accum: int, every: int
) -> None:
    world = groups * per_group
    batch = world * micro * accum
    steps = 2 * every + 1  # across outer syncs and into a new interval
    samplers = [ResumableDistributedSampler(batch * steps + 3, batch, r, world, seed=5) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    order = samplers[0].epoch_order(0).tolist()
    share = micro * accum
    for step in range(steps):
        taken = [per_rank[r][step * share : (step + 1) * share] for r in range(world)]
        by_group = [sum(taken[g * per_group : (g + 1) * per_group], []) for g in range(groups)]
        assert all(len(ids) == batch // groups for ids in by_group)  # each group: global batch / groups
        together = sorted(i for ids in by_group for i in ids)
        assert together == sorted(order[step * batch : (step + 1) * batch])  # each sample once, none other


def test_groups_divide_the_world_and_the_in_place_mode_refuses_what_it_cannot_sync() -> None:
    cfg = load_config(None, ["train.diloco.every_steps=4", "train.eval_every=8", "data.micro_batch_size=4"])
    cfg.check_world_size(4, 2)  # groups=0: one per node of 2 ranks
    with pytest.raises(
        ConfigError, match="groups=0 \\(one per node\\): 3 ranks per node does not divide the world size 4"
    ):
        cfg.check_world_size(4, 3)
    assert cfg.train.diloco is not None and cfg.train.diloco.group_count(8, 8) == 1
    check_in_place(load_config(None, ["train.diloco.every_steps=4", "ckpt.every_steps=8", "train.eval_every=0"]))
    for bad, says in [
        ("train.diloco.groups=2", "train.diloco.groups=2 must be 0"),
        ("train.diloco.fragments=2", "train.diloco.fragments=2 must be 1"),
        ("train.diloco.outer_dtype=int8", "in fp32, not int8"),
        ("ckpt.every_steps=6", "ckpt.every_steps=6 must be a multiple of train.diloco.every_steps=4"),
    ]:
        args = ["train.diloco.every_steps=4", "ckpt.every_steps=8", "train.eval_every=0", bad]
        with pytest.raises(ConfigError, match=f"in-place fault tolerance with train.diloco .*{says}"):
            check_in_place(load_config(None, args))


def test_build_sync_builds_each_kind_from_the_same_arguments_without_a_collective() -> None:
    plain = load_config(None, [])
    diloco = load_config(None, ["train.diloco.every_steps=4", "train.eval_every=8"])
    ft = FaultToleranceEnv("http://127.0.0.1:9", replica_group=1, bind="127.0.0.1")
    assert type(build_sync(plain, DistContext())).__name__ == "EveryStep"
    assert type(build_sync(diloco, DistContext())).__name__ == "DiLoCo"
    in_place = build_sync(plain, DistContext(), ft)
    assert type(in_place).__name__ == "InPlace" and in_place.event_fields() == {"replica_group": 1}
    in_place.close()


# ---- outer_dtype: what crosses the groups ---------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3 * CHUNK + 5),
    scale=st.floats(1e-6, 1e4),
    seed=st.integers(0, 2**16),
    zeros=st.booleans(),
)
def test_int8_rounds_each_value_within_half_its_chunks_step(n: int, scale: float, seed: int, zeros: bool) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    if zeros:
        x[: min(n, CHUNK)] = 0.0  # a chunk of zeros: scale 0, values 0
    q, scales = quantize_int8(x)
    assert q.dtype == torch.int8 and scales.numel() == -(-n // CHUNK) and int(q.abs().max()) <= 127
    back = dequantize_int8(q, scales)
    for c in range(scales.numel()):
        part = slice(c * CHUNK, (c + 1) * CHUNK)
        absmax = float(x[part].abs().max())
        assert float(scales[c]) == pytest.approx(absmax / 127)
        assert float((back[part] - x[part]).abs().max()) <= absmax / 254 * (1 + 1e-5)
    payload = encode(x, "int8")
    assert payload.dtype == torch.uint8 and payload.numel() == payload_bytes(n, "int8") == n + 4 * scales.numel()
    assert torch.equal(decode(payload, "int8", n), back)


def _hand_int8(x: torch.Tensor) -> torch.Tensor:
    """Quantize and dequantize by hand, value by value's chunk."""
    out = torch.empty_like(x)
    for start in range(0, x.numel(), CHUNK):
        part = x[start : start + CHUNK]
        step = float(part.abs().max()) / 127
        out[start : start + CHUNK] = torch.round(part / step) * step if step else 0.0
    return out


def group_mean(delta: torch.Tensor, dtype: str, groups: int) -> torch.Tensor:
    """The mean of an exchange with nobody across (what crosses is only encoded and decoded): launch, wait, mean."""
    exchange = start_exchange(delta, dtype, None, groups)
    exchange.wait()
    return exchange.mean()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8"])
def test_the_mean_over_groups_is_the_hand_computation_and_the_same_bits_anywhere(dtype: str) -> None:
    """3 simulated groups: each encodes its pseudo-gradient, the mean of the decoded values is computed as by hand
    (in group order, fp32); every group computing it from the gathered payloads gets the same bits."""
    g = torch.Generator().manual_seed(3)
    n = 2 * CHUNK + 17
    deltas = [torch.randn(n, generator=g) * (10.0**k) for k in (-2, 0, 1)]
    if dtype == "fp32":
        got = group_mean(torch.stack(deltas).sum(0), dtype, 3)  # what the all-reduce's sum gives each rank
        torch.testing.assert_close(got, (deltas[0] + deltas[1] + deltas[2]) / 3)
        return
    payloads = [encode(d, dtype) for d in deltas]
    assert all(p.numel() == payload_bytes(n, dtype) for p in payloads)
    rounded = [d.to(torch.bfloat16).float() if dtype == "bf16" else _hand_int8(d) for d in deltas]
    hand = ((rounded[0] + rounded[1]) + rounded[2]) / 3
    means = [mean_of_payloads([p.clone() for p in payloads], dtype, n) for _ in range(3)]
    torch.testing.assert_close(means[0], hand, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(m, means[0]) for m in means)  # deterministic: the same bits on every rank
    assert torch.equal(group_mean(deltas[1].clone(), dtype, 1), mean_of_payloads(payloads[1:2], dtype, n))


# ---- fragments: which parameters sync when -----------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(1, 500), min_size=1, max_size=12), data=st.data())
def test_fragments_are_contiguous_balanced_runs_of_every_parameter(sizes: list[int], data: st.DataObject) -> None:
    parts = data.draw(st.integers(1, len(sizes)))
    frags = split_fragments(sizes, parts)
    assert len(frags) == parts and all(len(f) > 0 for f in frags)
    assert [i for f in frags for i in f] == list(range(len(sizes)))  # contiguous, each parameter once, in order
    if all(s == sizes[0] for s in sizes) and len(sizes) % parts == 0:
        assert {len(f) for f in frags} == {len(sizes) // parts}  # equal sizes: equal fragments


@settings(max_examples=80, deadline=None)
@given(every=st.integers(1, 12), data=st.data())
def test_every_fragment_syncs_once_per_interval_and_all_at_the_last_step(every: int, data: st.DataObject) -> None:
    parts = data.draw(st.integers(1, every))
    last = data.draw(st.integers(1, 5 * every))
    due = {step: fragments_due(step, every, parts, last) for step in range(1, last + 1)}
    assert due[last] == list(range(parts))  # the run ends on the global weights
    assert all(len(d) <= 1 for s, d in due.items() if s != last)  # staggered: ~1/P of the bytes per sync
    for start in range(1, last - every + 1):  # every window of H steps before the last: each fragment once
        window = [p for s in range(start, start + every) for p in due[s]]
        assert sorted(window) == list(range(parts))
    if parts == 1:
        assert [s for s, d in due.items() if d] == [s for s in due if s % every == 0 or s == last]  # plain DiLoCo


def test_one_outer_optimizer_steps_each_fragment_as_its_own_optimizer_would() -> None:
    """A sync of some fragments leaves the others' weights and momentum untouched: exact per fragment."""
    cfg = DiLoCoConfig(every_steps=4, fragments=2, outer_lr=0.7, outer_momentum=0.9)
    torch.manual_seed(2)
    start = [torch.randn(3), torch.randn(2, 2), torch.randn(5)]
    shared = [t.clone() for t in start]
    outer = outer_optimizer(shared, cfg)
    apart = [t.clone() for t in start]
    frags = split_fragments([t.numel() for t in start], 2)
    own = [outer_optimizer([apart[i] for i in f], cfg) for f in frags]
    for step in range(1, 9):
        for f in fragments_due(step, 4, 2, 8):
            locals_ = [shared[i] + 0.1 * step * (i + 1) for i in frags[f]]
            outer_update(outer, [shared[i] for i in frags[f]], pseudo_gradient([shared[i] for i in frags[f]], locals_))
            theirs = [apart[i] for i in frags[f]]
            outer_update(own[f], theirs, pseudo_gradient(theirs, [apart[i] + 0.1 * step * (i + 1) for i in frags[f]]))
    assert all(torch.equal(a, b) for a, b in zip(shared, apart))


def test_an_optimizer_state_maps_its_parameters_shaped_tensors_and_keeps_the_rest() -> None:
    """What a DiLoCo checkpoint under FSDP gathers, cuts or rebuilds of an optimizer's state (diloco_shards.py):
    the tensors shaped like their parameter's part (SGD's momentum, AdamW's moments), never a step count; and a
    rank's own state keeps its structure (a state dict's _metadata) when its DTensors become local tensors."""
    params = [torch.zeros(3, 2), torch.zeros(1)]
    step, moment = torch.tensor(5.0), torch.ones(1)
    state = {
        "state": {0: {"step": step, "exp_avg": torch.ones(3, 2), "momentum_buffer": None}, 1: {"exp_avg": moment}},
        "param_groups": [{"params": [0, 1], "lr": 0.1}],
    }
    mapped = map_optimizer_state(state, params, lambda t, p: t + p.numel(), lambda p: p.shape)
    assert mapped["param_groups"] == state["param_groups"]
    assert mapped["state"][0]["step"] is step and mapped["state"][0]["momentum_buffer"] is None
    assert torch.equal(mapped["state"][0]["exp_avg"], torch.full((3, 2), 7.0))
    assert torch.equal(mapped["state"][1]["exp_avg"], torch.full((1,), 2.0))  # a 1-value moment, not a step
    assert torch.equal(state["state"][1]["exp_avg"], moment) and moment.item() == 1.0  # the input is unchanged
    model = torch.nn.Linear(2, 3).state_dict()
    kept = local_tree({"model": model, "order": (1, [2])})
    assert kept["model"]._metadata == model._metadata and kept["order"] == (1, [2])
    assert all(kept["model"][k] is v for k, v in model.items())  # no DTensor: the same tensors


# ---- delay_steps: a sync overlapping inner steps ------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(every=st.integers(1, 16), data=st.data())
def test_each_sync_is_applied_delay_steps_after_its_start_one_at_a_time_and_all_by_the_last_step(
    every: int, data: st.DataObject
) -> None:
    parts = data.draw(st.integers(1, every))
    delay = data.draw(st.integers(0, every // parts - 1))
    last = data.draw(st.integers(1, 5 * every))
    plans = {step: sync_plan(step, every, parts, delay, last) for step in range(1, last + 1)}
    if delay == 0:  # today's schedule, bit for bit: everything due synced at once
        assert all(p.apply == p.start == [] and p.now == fragments_due(s, every, parts, last) for s, p in plans.items())
    in_flight: dict[int, int] = {}  # fragment -> the step its sync started
    applied: dict[int, list[int]] = {f: [] for f in range(parts)}  # fragment -> the steps its syncs were applied
    for step, plan in plans.items():
        assert sorted(plan.apply) == sorted(f for f, s in in_flight.items() if s + delay == step)
        for f in plan.apply:
            applied[f].append(in_flight.pop(f))
        assert not (plan.start and in_flight)  # one sync in flight at a time
        in_flight.update({f: step for f in plan.start})
        assert len(plan.start) <= 1 and not (plan.start and plan.now)
        for f in plan.now:
            applied[f].append(step)
    assert not in_flight  # nothing travels past the run
    assert sorted(plans[last].apply + plans[last].now) == list(range(parts))  # the run ends on the global weights
    for f, steps in applied.items():  # each fragment's syncs start once per H steps (before the last)
        regular = [s for s in range(1, last) if f in fragments_due(s, every, parts, last) and s + delay <= last]
        assert steps == regular + ([last] if f in plans[last].now else [])
