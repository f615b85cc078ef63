"""The optimizer: a non-finite step leaves parameters and state untouched, decided on the device."""

from __future__ import annotations

import pytest
import torch

from ddptrain.config import load_config
from ddptrain.train.optim import (
    build_optimizer,
    load_optimizer_state,
    param_groups,
    skips_on_device,
    step_unless_nonfinite,
)


def model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [t.clone() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in model.parameters()] + state


@pytest.mark.parametrize("target", [None, "custom_optim:build_sgd"])
def test_found_inf_skips_the_update_and_the_state(target: str | None) -> None:
    cfg = load_config(None, [f"optim.target={target}"] if target else [])
    model = model_with_grads()
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    assert skips_on_device(optimizer) == (target is None)  # the default AdamW is fused on CPU too
    step_unless_nonfinite(optimizer, torch.zeros(()))  # a first real step creates the state
    before = snapshot(model, optimizer)
    step_unless_nonfinite(optimizer, torch.ones(()))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))
    step_unless_nonfinite(optimizer, torch.zeros(()))
    assert not all(torch.equal(a, b) for a, b in zip(before, snapshot(model, optimizer)))


def test_a_checkpoint_of_an_unfused_adamw_loads_into_the_fused_one() -> None:
    """Checkpoints written before the CPU AdamW was fused resume; the run keeps its fused kernel."""
    model, cfg = model_with_grads(), load_config(None, [])
    unfused = torch.optim.AdamW(param_groups(model, cfg), fused=False)
    unfused.step()
    fused = build_optimizer(model, cfg, torch.device("cpu"))
    load_optimizer_state(fused, unfused.state_dict())
    assert all(g["fused"] for g in fused.param_groups) and skips_on_device(fused)
    step_unless_nonfinite(fused, torch.zeros(()))
    assert all(s["step"].item() == 2 for s in fused.state.values())
