"""DiLoCo's outer step against a hand computation (two groups simulated in this process), and the sample stream:
at any number of groups, the groups together take each sample of every global batch once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.config import load_config
from ddptrain.config.train import DiLoCoConfig
from ddptrain.data.sampler import ResumableDistributedSampler
from ddptrain.errors import ConfigError
from ddptrain.train.in_place_trainer import check_in_place
from ddptrain.train.sync.diloco import outer_optimizer, outer_update, pseudo_gradient


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


def test_groups_divide_the_world_and_the_in_place_mode_refuses_diloco() -> None:
    cfg = load_config(None, ["train.diloco.every_steps=4", "train.eval_every=8", "data.micro_batch_size=4"])
    cfg.check_world_size(4, 2)  # groups=0: one per node of 2 ranks
    with pytest.raises(
        ConfigError, match="groups=0 \\(one per node\\): 3 ranks per node does not divide the world size 4"
    ):
        cfg.check_world_size(4, 3)
    assert cfg.train.diloco is not None and cfg.train.diloco.group_count(8, 8) == 1
    with pytest.raises(ConfigError, match="train.diloco is not supported with it yet"):
        check_in_place(cfg)
