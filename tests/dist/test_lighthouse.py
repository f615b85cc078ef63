"""`ddptrain lighthouse`: torchft's Lighthouse bound to the address given (never all interfaces), forming a
quorum for a client, stopped by SIGTERM; bad binds refused with one line."""

from __future__ import annotations

import signal
import socket
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
from helpers import start_ddptrain

from ddptrain.cli import main

pytestmark = pytest.mark.dist
torchft = pytest.importorskip("torchft.coordination", reason="torchft is the ft extra (make installs it)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on port (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


@pytest.mark.timeout(60)
def test_the_lighthouse_binds_the_address_given_forms_a_quorum_and_stops_on_sigterm() -> None:
    port = free_port()
    proc = start_ddptrain(
        ["lighthouse", "--bind", f"127.0.0.1:{port}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith(f"lighthouse serving on http://127.0.0.1:{port} (min replicas 1)"), line
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0 or ::
        client = torchft.LighthouseClient(f"http://127.0.0.1:{port}", connect_timeout=timedelta(seconds=5))
        quorum = client.quorum(
            replica_id="group-0", timeout=timedelta(seconds=10), address="a", store_address="s", step=0, world_size=1
        )
        assert [m.replica_id for m in quorum.participants] == ["group-0"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert "lighthouse stopped (SIGTERM)" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--bind", "0.0.0.0:29510"], "listens on all interfaces: give this node's address or 127.0.0.1"),
        (["--bind", "[::]:29510"], "listens on all interfaces"),
        (["--bind", "lighthouse"], "--bind 'lighthouse' must look like HOST:PORT"),
        (["--bind", "127.0.0.1:29510", "--min-replicas", "0"], "--min-replicas must be at least 1"),
    ],
)
def test_binds_that_cannot_serve_safely_are_refused_with_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["lighthouse", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
