"""`ddptrain lighthouse --bind HOST:PORT`: torchft's Lighthouse, the quorum service of in-place recovery.

Each replica group's torchft Manager heartbeats to the Lighthouse and asks it for a quorum every
step; a group that stops heartbeating for `--heartbeat-timeout-ms` leaves the quorum and the others
go on without it. It runs here in-process (torchft's `LighthouseServer`), bound to the address given:
the node's address or loopback, never all interfaces, since anyone who reaches it can join or stall a
job (it has no authentication). It serves until SIGTERM or Ctrl-C.

Defaults, measured on these machines (docs/multinode.md): with 2 groups the Lighthouse refuses a
quorum of one until the dead group's heartbeat expires, so the heartbeat timeout is the survivors'
stall: 1 s here (torchft's own default, 5 s, stalled them 5.1 s); the join timeout bounds how long a
quorum waits for a straggling group before it forms without it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ddptrain.cli_options import REQUIRED, option
from ddptrain.endpoints import format_endpoint, host_port
from ddptrain.errors import LaunchError, UserError

ALL_INTERFACES = ("0.0.0.0", "::", "*", "")


@dataclass(frozen=True)
class LighthouseOptions:
    """What `ddptrain lighthouse` reads from its command line."""

    bind: str = option(REQUIRED, "HOST:PORT to serve on: this node's address or 127.0.0.1 (never all interfaces)")
    min_replicas: int = option(1, "replica groups a quorum needs at least")
    heartbeat_timeout_ms: int = option(1000, "a group silent this long has left (the survivors' stall after a loss)")
    join_timeout_ms: int = option(1000, "how long a quorum waits for groups still joining")
    quorum_tick_ms: int = option(100, "how often a pending quorum is reconsidered")


def lighthouse(options: LighthouseOptions) -> int:
    """Serve torchft's Lighthouse on --bind until SIGTERM or Ctrl-C."""
    host, port = host_port("--bind", options.bind)
    if host in ALL_INTERFACES:
        raise LaunchError(
            f"--bind {options.bind!r} listens on all interfaces: give this node's address or 127.0.0.1 "
            "(the Lighthouse has no authentication)"
        )
    for name in ("min_replicas", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
        if getattr(options, name) < 1:
            raise LaunchError(f"--{name.replace('_', '-')} must be at least 1")
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise UserError("ddptrain lighthouse needs torchft: pip install 'ddptrain[ft]'") from None
    # Blocked before the server starts: its threads inherit the mask, and only sigwait below takes them.
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        server = LighthouseServer(
            bind=format_endpoint((host, port)),
            min_replicas=options.min_replicas,
            join_timeout_ms=options.join_timeout_ms,
            quorum_tick_ms=options.quorum_tick_ms,
            heartbeat_timeout_ms=options.heartbeat_timeout_ms,
        )
    except RuntimeError as e:  # the address is not this node's, or the port is taken
        raise LaunchError(f"cannot serve the Lighthouse on {options.bind}: {str(e).strip().splitlines()[0]}") from None
    url = f"http://{format_endpoint((host, port))}"  # as given: server.address() names the host by its name
    print(f"lighthouse serving on {url} (min replicas {options.min_replicas}); stop with Ctrl-C", flush=True)
    try:
        received = signal.sigwait(stop)
    finally:
        server.shutdown()
    print(f"lighthouse stopped ({signal.Signals(received).name})", flush=True)
    return 0
