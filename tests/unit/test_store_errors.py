"""A job store that cannot be reached or joined is one line naming the rank, host:port and the cause.

With a hand-set environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun would set
them) it is bad input: exit 2, bounded by dist.startup_timeout_s. Under torchrun's agent
(TORCHELASTIC_RUN_ID set) it is exit 1, so the agent may restart the workers.
"""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist

from ddptrain.config import DistConfig
from ddptrain.dist import BIND_ADDR_ENV, init_distributed
from ddptrain.errors import DdptrainError, LaunchError, UserError

AGENT_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", BIND_ADDR_ENV, "LOCAL_WORLD_SIZE")


def hand_set(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, port: int) -> None:
    for name in AGENT_VARS:
        monkeypatch.delenv(name, raising=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}
    for name, value in {**env, "LOCAL_RANK": str(rank)}.items():
        monkeypatch.setenv(name, value)


def test_a_port_in_use_on_the_serving_rank_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        hand_set(monkeypatch, 0, 2, port)
        with pytest.raises(LaunchError) as err:
            init_distributed(DistConfig(backend="gloo", startup_timeout_s=1))
    text = str(err.value)
    assert text.startswith(f"rank 0 of 2 failed serving the job's store on port {port}")
    assert "EADDRINUSE" in text and "\n" not in text and not dist.is_initialized()


def test_ranks_that_never_join_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:  # a free port for rank 0 to serve on (the fixture's is bound)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hand_set(monkeypatch, 0, 2, port)
    with pytest.raises(LaunchError) as err:
        init_distributed(DistConfig(backend="gloo", startup_timeout_s=1))
    assert "rank 0 of 2 failed serving the job's store" in str(err.value) and "1/2 clients joined" in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize("launcher_store", [False, True])
def test_under_an_agent_the_same_line_is_a_failure_it_may_restart(
    monkeypatch: pytest.MonkeyPatch, closed_port: int, launcher_store: bool
) -> None:
    hand_set(monkeypatch, 0 if not launcher_store else 1, 2, closed_port)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    if launcher_store:
        monkeypatch.setenv(BIND_ADDR_ENV, "127.0.0.1")  # `ddptrain launch`: rank 0 serves, the others poll
    else:
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")  # torchrun: even rank 0 is a client
    with pytest.raises(DdptrainError) as err:
        init_distributed(DistConfig(backend="gloo", startup_timeout_s=0.5))
    assert not isinstance(err.value, UserError) and err.value.exit_code == 1
    assert f"cannot reach the job's store at 127.0.0.1:{closed_port}" in str(err.value)
