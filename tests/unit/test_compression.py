"""Compressed gradients (dist.grad_compression): the config's refusals, and the hooks' math on 2 real gloo ranks.

The ranks are two processes forked from the test (a file store, gloo): DDP takes a real process group, and a
comm hook only runs inside DDP's backward.
"""

from __future__ import annotations

import datetime
import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddptrain.config import Config, load_config
from ddptrain.config.system import DistConfig
from ddptrain.errors import ConfigError
from ddptrain.observe.perf import StepTimer
from ddptrain.train.compression import PowerSgd, attach, check_backend, payload_bytes
from ddptrain.train.parallel import mixed_precision
from ddptrain.train.sync.in_place import check_in_place


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dist.grad_compression=int4"], "pick one of none, fp16, bf16, powersgd"),
        (["dist.grad_compression=powersgd", "dist.strategy=fsdp"], "dist.strategy=fsdp reduces gradients without"),
        (["dist.grad_compression=powersgd", "dist.strategy=hsdp", "dist.shard_size=1"], "dist.strategy=hsdp"),
        (["dist.powersgd_rank=0"], "dist.powersgd_rank"),
        (["dist.powersgd_start_step=2"], "dist.powersgd_start_step"),
        (["dist.grad_compression=powersgd", "train.precision=fp16"], "changing loss scale; use train.precision=bf16"),
    ],
)
def test_combinations_that_cannot_work_are_one_line_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_every_mode_loads_and_bf16_is_refused_on_gloo_only() -> None:
    for mode in ("none", "fp16", "bf16", "powersgd"):
        assert load_config(None, [f"dist.grad_compression={mode}"]).dist.grad_compression == mode
    bf16 = DistConfig(grad_compression="bf16")
    with pytest.raises(ConfigError, match="gloo has no bfloat16 all-reduce"):
        check_backend(bf16, "gloo")
    check_backend(bf16, "nccl")
    check_backend(DistConfig(grad_compression="fp16"), "gloo")


def test_fsdp_reduces_in_the_compression_dtype() -> None:
    for strategy in ("dist.strategy=fsdp", "dist.strategy=hsdp dist.shard_size=1"):
        cfg = load_config(None, [*strategy.split(), "dist.grad_compression=fp16"])
        assert cfg.dist.grad_compression == "fp16"
    assert mixed_precision("fp32", "fp16").reduce_dtype == torch.float16
    assert mixed_precision("bf16", "bf16").reduce_dtype == torch.bfloat16
    assert mixed_precision("bf16", "bf16").param_dtype == torch.bfloat16
    assert mixed_precision("bf16").reduce_dtype == torch.float32  # no compression: fp32 as before
    assert mixed_precision("fp32").reduce_dtype is None


def test_the_in_place_mode_refuses_compression() -> None:
    with pytest.raises(ConfigError, match="outside DDP's communication hooks"):
        check_in_place(Config.model_validate({"dist": {"grad_compression": "fp16"}}))


def test_no_compression_registers_nothing_of_its_own() -> None:
    model = nn.Linear(2, 2)  # no DDP (one process): nothing to compress whatever the mode
    assert attach(DistConfig(grad_compression="powersgd"), model, StepTimer(torch.device("cpu"), False)) is None


def test_bytes_per_step_by_hand() -> None:
    params = list(_model().parameters())  # three 32 x 32 matrices, two 32-long biases
    assert payload_bytes(params, "none", 0) == (3 * 32 * 32 + 2 * 32) * 4
    assert payload_bytes(params, "fp16", 0) == payload_bytes(params, "bf16", 0) == (3 * 32 * 32 + 2 * 32) * 2
    # rank 2: each matrix as (32 + 32) x 2 values; the biases whole (a 32 x 1 matrix gains nothing)
    assert payload_bytes(params, "powersgd", 2) == (3 * 64 * 2 + 2 * 32) * 4
    # rank 16: (32 + 32) x 16 is not under half of 32 x 32: sent whole
    assert payload_bytes(params, "powersgd", 16) == payload_bytes(params, "none", 0)


# ---- two ranks ------------------------------------------------------------------------------------------


def _rank(fn: Callable[[int], Any], rank: int, store: str, queue: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        queue.put((rank, fn(rank)))
    finally:
        dist.destroy_process_group()


def on_two_ranks(fn: Callable[[int], Any], tmp_path: Path) -> list[Any]:
    """fn(rank) on 2 forked gloo ranks; their results (plain Python values) in rank order."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(fn, r, str(tmp_path / "store"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return [results[r] for r in range(2)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Matrices PowerSGD compresses at rank 2 ((32 + 32) * 2 * 2 < 32 * 32), a bias it sends whole; small buckets
    # (one per matrix or so) so that several buckets' state is saved and laid out again.
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32, bias=False), nn.Tanh(), nn.Linear(32, 32))


def _ddp(cfg: DistConfig) -> tuple[DDP, Any]:
    ddp = DDP(_model(), bucket_cap_mb=0.004)
    timer = StepTimer(torch.device("cpu"), True)
    timer.attach(ddp)
    return ddp, attach(cfg, ddp, timer)


def _backward(ddp: DDP, rank: int, step: int) -> list[torch.Tensor]:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + rank))
    ddp.zero_grad(set_to_none=True)
    ddp(x).square().mean().backward()
    return [p.grad.clone() for p in ddp.parameters()]  # type: ignore[union-attr]


def _fp16_step(rank: int) -> tuple[list[list[float]], list[list[float]]]:
    ddp, compression = _ddp(DistConfig(grad_compression="fp16"))
    assert compression is not None
    local = [g.flatten().tolist() for g in _local_grads(rank)]
    return local, [g.flatten().tolist() for g in _backward(ddp, rank, 0)]


def _local_grads(rank: int) -> list[torch.Tensor]:
    model = _model()
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    return [p.grad for p in model.parameters()]  # type: ignore[misc]


def test_fp16_gives_the_fp16_rounded_mean(tmp_path: Path) -> None:
    (local0, reduced0), (local1, reduced1) = on_two_ranks(_fp16_step, tmp_path)
    assert reduced0 == reduced1
    for a, b, got in zip(local0, local1, reduced0):
        a16, b16 = torch.tensor(a).half() / 2, torch.tensor(b).half() / 2
        assert torch.equal(torch.tensor(got), (a16 + b16).float())  # each rank's half, summed in fp16
        assert not torch.equal(torch.tensor(got), (torch.tensor(a) + torch.tensor(b)) / 2)  # fp32's is not


def _powersgd_resume(rank: int) -> dict[str, Any]:
    """Steps 1-4, save; steps 5-7 on, against a fresh DDP (new buckets) resumed from the saved state."""
    cfg = DistConfig(grad_compression="powersgd", powersgd_rank=2, powersgd_start_step=3)
    ddp, compression = _ddp(cfg)
    assert isinstance(compression, PowerSgd)
    for step in range(4):
        _backward(ddp, rank, step)
    saved, weights = compression.state_dict(), ddp.module.state_dict()
    straight = [_backward(ddp, rank, step) for step in range(4, 7)]
    runs = {}
    for name, state in (("resumed", saved), ("fresh", None)):
        again, resumed = _ddp(cfg)
        again.module.load_state_dict(weights)
        assert resumed is not None
        resumed.load_state_dict(state, 4)
        runs[name] = [_backward(again, rank, step) for step in range(4, 7)]
    exact = all(torch.equal(a, b) for x, y in zip(straight, runs["resumed"]) for a, b in zip(x, y))
    fresh = all(torch.equal(a, b) for x, y in zip(straight, runs["fresh"]) for a, b in zip(x, y))
    plain = [g for g in _local_grads(rank)]
    return {"exact": exact, "fresh_differs": not fresh, "errors": sorted(saved["error"]), "q": sorted(saved["q"]),
            "iter": saved["iter"], "compressed": not torch.equal(straight[0][0], plain[0])}  # fmt: skip


def test_powersgd_state_resumes_bit_exact_in_new_buckets(tmp_path: Path) -> None:
    for got in on_two_ranks(_powersgd_resume, tmp_path):
        assert got["exact"], "a resumed PowerSGD must reproduce the uninterrupted steps bit for bit"
        assert got["fresh_differs"], "without its state PowerSGD computes other gradients (the test can fail)"
        assert got["iter"] == 4
        assert got["errors"] == ["0.bias", "0.weight", "2.weight", "4.bias", "4.weight"]  # per parameter, by name
        assert got["q"] == ["0.weight", "2.weight", "4.weight"]  # the compressed matrices
