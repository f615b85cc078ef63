"""Doctor's single-machine checks, run in this process with real environment variables and sockets."""

from __future__ import annotations

import socket

import pytest

from ddptrain.review.doctor import check_interface, doctor, route_to


@pytest.fixture(autouse=True)
def _no_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "GLOO_SOCKET_IFNAME",
        "NCCL_SOCKET_IFNAME",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        monkeypatch.delenv(var, raising=False)


def test_alone_passes_the_single_machine_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(max_bytes=0) == 0
    out = capsys.readouterr().out
    assert "(single machine)" in out and "PASS  device" in out and out.rstrip().endswith("verdict: PASS")


def test_loopback_master_addr_routes_via_lo(monkeypatch: pytest.MonkeyPatch) -> None:
    assert route_to("127.0.0.1") == ("127.0.0.1", "lo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    check = check_interface()
    assert check.verdict == "PASS" and check.detail == "MASTER_ADDR 127.0.0.1 is reached via lo (127.0.0.1)"


def test_a_missing_socket_interface_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif9")
    check = check_interface()
    assert (
        check.verdict == "FAIL" and "GLOO_SOCKET_IFNAME=nosuchif9 but this host has no such interface" in check.detail
    )


def test_an_incomplete_launch_env_fails(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    assert doctor() == 1
    out = capsys.readouterr().out
    assert "FAIL  launch env  incomplete torchrun environment" in out and "verdict: FAIL (launch env)" in out


@pytest.mark.timeout(60)  # a hang guard: a refused connection is reported as refused, not after a timeout
def test_a_closed_endpoint_fails_as_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert doctor(timeout_s=1.0, endpoint=f"127.0.0.1:{port}") == 1
    out = capsys.readouterr().out
    assert f"FAIL  endpoint    cannot connect to 127.0.0.1:{port} within 1s (connection refused" in out
    assert "verdict: FAIL (endpoint)" in out


def test_an_open_endpoint_passes(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert doctor(endpoint=f"127.0.0.1:{s.getsockname()[1]}") == 0
    assert "PASS  endpoint" in capsys.readouterr().out
