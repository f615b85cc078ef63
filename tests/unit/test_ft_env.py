"""The in-place mode's variables (ft_env.py): read as the launcher writes them, refused in one line otherwise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddptrain.errors import LaunchError
from ddptrain.ft_env import read_ft_env
from ddptrain.train.in_place import plain_error


def test_absent_means_the_plain_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPTRAIN_REPLICA_GROUP", raising=False)
    assert read_ft_env() is None


@given(group=st.integers(0, 999_999), port=st.integers(1, 65535))
def test_what_the_launcher_writes_is_read_back(group: int, port: int) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPTRAIN_REPLICA_GROUP", str(group))
        mp.setenv("TORCHFT_LIGHTHOUSE", f"http://10.0.0.1:{port}")
        mp.setenv("DDPTRAIN_BIND_ADDR", "10.0.0.2")
        mp.delenv("DDPTRAIN_FT_INJECT", raising=False)
        env = read_ft_env()
    assert env is not None
    assert (env.replica_group, env.lighthouse, env.bind, env.inject) == (
        group,
        f"http://10.0.0.1:{port}",
        "10.0.0.2",
        None,
    )


@pytest.mark.parametrize(
    ("variables", "says"),
    [
        ({"DDPTRAIN_REPLICA_GROUP": "first"}, "DDPTRAIN_REPLICA_GROUP='first' must be a small non-negative integer"),
        ({"DDPTRAIN_REPLICA_GROUP": "-1"}, "DDPTRAIN_REPLICA_GROUP='-1' must be"),
        ({"DDPTRAIN_REPLICA_GROUP": "12345678"}, "DDPTRAIN_REPLICA_GROUP='12345678' must be"),
        ({"TORCHFT_LIGHTHOUSE": ""}, "DDPTRAIN_REPLICA_GROUP is set but TORCHFT_LIGHTHOUSE is not"),
        ({"TORCHFT_LIGHTHOUSE": "nowhere"}, "TORCHFT_LIGHTHOUSE 'nowhere' must look like HOST:PORT"),
        ({"TORCHFT_LIGHTHOUSE": "http://h:0"}, "must look like HOST:PORT"),
        ({"DDPTRAIN_FT_INJECT": "explode"}, "DDPTRAIN_FT_INJECT='explode' is not a fault drill"),
    ],
)
def test_bad_variables_are_one_line(monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], says: str) -> None:
    monkeypatch.setenv("DDPTRAIN_REPLICA_GROUP", "0")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:29510")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError) as e:
        read_ft_env()
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_transport_error_is_shown_as_a_user_reads_it() -> None:
    """Issue 38, item 14: gloo's source location and advice, and emoji, stay out of the in-place mode's warnings."""
    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:11138. This is typically caused by a remote worker crashing. Check the logs of the remote worker"
    )
    assert plain_error(gloo) == "Connection closed by peer [127.0.0.1]:11138"
    assert plain_error("\u274c quorum failed [/src/lib.rs:40] \U0001f525 deadline") == "quorum failed deadline"
    assert len(plain_error("x" * 5000)) == 200
