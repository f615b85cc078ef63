"""etcd rendezvous options: endpoint syntax, what `launch --rdzv-backend etcd*` stands for, exit 2 on bad input."""

from __future__ import annotations

import shlex
import socket
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddptrain.cli import main
from ddptrain.errors import LaunchError
from ddptrain.launch.etcd_endpoints import DEFAULT_PORT, ETCD_ENV, format_endpoints, parse_endpoints
from ddptrain.observe.doctor import check_etcd, doctor

_labels = st.text("abz09", min_size=1, max_size=4) | st.tuples(
    st.text("az", min_size=1, max_size=2), st.text("-", max_size=2), st.text("z9", min_size=1, max_size=2)
).map("".join)
_names = st.lists(_labels, min_size=1, max_size=3).map(".".join).filter(lambda h: not h.replace(".", "").isdigit())
_ipv4 = st.ip_addresses(v=4).map(str)
_ipv6 = st.ip_addresses(v=6).map(str)
_endpoint = st.tuples(st.one_of(_names, _ipv4, _ipv6), st.integers(1, 65535))


@settings(max_examples=60, deadline=None)
@given(st.lists(_endpoint, min_size=1, max_size=4, unique=True))
def test_endpoints_round_trip(endpoints: list[tuple[str, int]]) -> None:
    assert parse_endpoints("--x", format_endpoints(endpoints)) == tuple(endpoints)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
def test_any_text_parses_to_valid_endpoints_or_one_line_naming_the_flag(text: str) -> None:
    try:
        parsed = parse_endpoints("--rdzv-endpoint", text)
    except LaunchError as e:
        assert str(e).startswith("--rdzv-endpoint") and "\n" not in str(e)
        return
    assert 1 <= len(parsed) <= 16 and len(set(parsed)) == len(parsed)
    for host, port in parsed:
        assert 0 < port < 65536 and host and not any(c in host for c in " /@,[]")


def test_port_defaults_and_http_prefix() -> None:
    assert parse_endpoints("--x", "etcd-0, http://10.0.0.2:4001") == (("etcd-0", DEFAULT_PORT), ("10.0.0.2", 4001))


def _dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[dict[str, str], list[str]]:
    assert main(["launch", "--dry-run", "--nnodes", "2:3", *args, "--", "train"]) == 0
    words = shlex.split(capsys.readouterr().out.splitlines()[0])
    at = words.index("torchrun")
    return dict(w.split("=", 1) for w in words[:at]), words[at + 1 :]


@pytest.mark.parametrize(("backend", "join_key"), [("etcd-v2", "join_timeout"), ("etcd", "timeout")])
def test_etcd_dry_run(capsys: pytest.CaptureFixture[str], backend: str, join_key: str) -> None:
    env, argv = _dry_run(
        capsys, "--rdzv-backend", backend, "--rdzv-endpoint", "e1,e2:2479", "--run-id", "j1", "--node-addr", "127.0.0.1"
    )
    option = dict(zip(argv[::2], argv[1::2]))
    assert option["--rdzv-backend"] == backend and option["--rdzv-endpoint"] == "e1:2379,e2:2479"
    assert option["--rdzv-conf"].startswith(f"{join_key}=600,") and "is_host" not in option["--rdzv-conf"]
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # what lets the job outlive its rank-0 host
    assert env[ETCD_ENV] == "e1:2379,e2:2479" and "DDPTRAIN_TRIAGE_STORE" not in env


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rdzv-backend", "etcd-v2", "--run-id", "j"], "--rdzv-backend etcd-v2 needs --rdzv-endpoint"),
        (["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1"], "needs --run-id"),
        (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e1:99999", "--run-id", "j"], "has no valid port"),
        (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "e1 e2", "--run-id", "j"], "--rdzv-endpoint: 'e1 e2'"),
        (["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "fd00::1", "--run-id", "j"], "IPv6 address in brackets"),
    ],
)
def test_bad_etcd_options_exit_2(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["launch", "--nnodes", "2", *args, "--", "train"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_missing_client_library_exits_2_naming_the_extra(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "etcd", None)  # what `import etcd` meets where python-etcd is not installed
    args = ["--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:1", "--run-id", "j"]
    assert main(["launch", "--nnodes", "2", *args, "--", "train"]) == 2
    err = capsys.readouterr().err
    assert "python-etcd" in err and "pip install 'ddptrain[etcd]'" in err and err.count("\n") == 1, err


def test_doctor_fails_a_closed_etcd_endpoint_in_bounded_time() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check = check_etcd(parse_endpoints("--etcd", f"127.0.0.1:{port}"), 1.0)
    assert check.verdict == "FAIL" and "0 of 1 healthy" in check.detail and f"127.0.0.1:{port}: " in check.detail


def test_doctor_under_an_etcd_launch_checks_its_members(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher hands its workers the members (ETCD_ENV): `launch ... -- doctor` checks them unasked."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv(ETCD_ENV, closed)
    assert doctor(timeout_s=1.0, max_bytes=0) == 1
    out = capsys.readouterr().out
    assert "FAIL  etcd        0 of 1 healthy" in out and "verdict: FAIL (etcd)" in out, out
