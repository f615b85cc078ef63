"""The torch internals `ddptrain launch` relies on, pinned, and the supported range enforced.

launch/agent.py subclasses torchelastic's LocalElasticAgent and overrides private methods; a
torch upgrade that renames one or changes its parameters would silently skip our override (the
job would then restart preempted workers, or wait 300 s in the exit barrier). These tests fail
loudly instead, in CI rather than on a cluster.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest
import tomllib
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.launcher.api import LaunchConfig
from torch.distributed.run import get_args_parser

from ddptrain.errors import LaunchError
from ddptrain.launch.agent import Agent
from ddptrain.launch.torch_support import SUPPORTED_TORCH, check_torch

ROOT = Path(__file__).resolve().parents[2]

# method -> the parameter names (after self) our override is written against
OVERRIDDEN = {
    "_monitor_workers": ["worker_group"],
    "_rendezvous": ["worker_group"],
    "_exit_barrier": [],
    "_stop_workers": ["worker_group"],
    "_shutdown": ["death_sig", "timeout"],
}


@pytest.mark.parametrize("method, params", OVERRIDDEN.items())
def test_overridden_agent_methods_exist_with_these_parameters(method: str, params: list[str]) -> None:
    base = getattr(LocalElasticAgent, method)
    assert list(inspect.signature(base).parameters)[1:] == params, f"LocalElasticAgent.{method} changed"
    ours = getattr(Agent, method)
    assert list(inspect.signature(ours).parameters)[1:] == params


def test_private_attributes_and_constructors_the_launcher_uses() -> None:
    init = inspect.signature(LocalElasticAgent.__init__).parameters
    for name in (
        "spec",
        "logs_specs",
        "start_method",
        "exit_barrier_timeout",
        "log_line_prefix_template",
        "shutdown_timeout",
    ):
        assert name in init, f"LocalElasticAgent() lost {name}"
    # attributes read or written by the launcher
    sources = inspect.getsource(SimpleElasticAgent) + inspect.getsource(LocalElasticAgent)
    for attr in ("self._remaining_restarts", "self._pcontext", "self._exit_barrier_timeout", "self._shutdown_timeout"):
        assert attr in sources, f"{attr} is gone from torchelastic's agent"
    spec = inspect.signature(WorkerSpec).parameters
    for name in (
        "role",
        "local_world_size",
        "entrypoint",
        "args",
        "rdzv_handler",
        "max_restarts",
        "monitor_interval",
        "local_addr",
    ):
        assert name in spec
    fields = {f.name for f in dataclasses.fields(LaunchConfig)}
    assert {
        "rdzv_backend",
        "rdzv_endpoint",
        "run_id",
        "min_nodes",
        "max_nodes",
        "local_addr",
        "rdzv_configs",
        "signals_to_handle",
        "role",
        "nproc_per_node",
        "max_restarts",
        "monitor_interval",
        "logs_specs",
        "start_method",
        "log_line_prefix_template",
        "shutdown_timeout",
    } <= fields


def test_torchrun_accepts_every_option_the_launcher_passes() -> None:
    flags = {s for a in get_args_parser()._actions for s in a.option_strings}
    for flag in (
        "--nnodes",
        "--nproc-per-node",
        "--rdzv-backend",
        "--rdzv-endpoint",
        "--rdzv-id",
        "--rdzv-conf",
        "--max-restarts",
        "--monitor-interval",
        "--signals-to-handle",
        "--shutdown-timeout",
        "--local-addr",
    ):
        assert flag in flags, f"torchrun lost {flag}"


def test_supported_range_matches_pyproject_and_this_torch() -> None:
    requirement = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("torch")
    )
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_TORCH
    assert requirement == f"torch>={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"
    check_torch()  # the torch these tests run on is in the range
    for bad in ("2.4.1", "2.12.0+cpu", f"{hi_major}.{hi_minor}.0"):
        with pytest.raises(LaunchError, match="not supported"):
            check_torch(bad)
