"""`ddptrain lighthouse --bind HOST:PORT`: torchft's Lighthouse, the quorum service of in-place recovery.

Each replica group's torchft Manager heartbeats to the Lighthouse and asks it for a quorum every
step; a group that stops heartbeating for `--heartbeat-timeout-ms` leaves the quorum and the others
go on without it. It runs here in-process (torchft's `LighthouseServer`), bound to the address given:
the node's address or loopback, never all interfaces, since anyone who reaches it can join or stall a
job (it has no authentication). It serves until SIGTERM or Ctrl-C.

Defaults, measured on these machines (docs/multinode.md): with 2 groups the Lighthouse refuses a
quorum of one until the dead group's heartbeat expires, so the heartbeat timeout is the survivors'
stall: 1 s here (torchft's own default, 5 s, stalled them 5.1 s). The join timeout bounds how long a
quorum waits for a group that heartbeats but has not asked yet (one busy saving, or starting) before it
forms without it: 5 s, so that groups starting a few seconds apart meet in one quorum instead of
training apart (a group's Manager starts heartbeating only when it is ready to ask).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from ddptrain.cli_options import REQUIRED, option
from ddptrain.endpoints import format_endpoint
from ddptrain.errors import LaunchError
from ddptrain.launch.lighthouse_server import DEFAULTS, LighthouseSettings, serve_lighthouse, serving_endpoint


@dataclass(frozen=True)
class LighthouseOptions:
    """What `ddptrain lighthouse` reads from its command line."""

    bind: str = option(REQUIRED, "HOST:PORT to serve on: this node's address or 127.0.0.1 (never all interfaces)")
    min_replicas: int = option(DEFAULTS.min_replicas, "replica groups a quorum needs at least")
    heartbeat_timeout_ms: int = option(
        DEFAULTS.heartbeat_timeout_ms, "a group silent this long has left (the survivors' stall after a loss)"
    )
    join_timeout_ms: int = option(DEFAULTS.join_timeout_ms, "how long a quorum waits for groups still joining")
    quorum_tick_ms: int = option(DEFAULTS.quorum_tick_ms, "how often a pending quorum is reconsidered")


def lighthouse(options: LighthouseOptions) -> int:
    """Serve torchft's Lighthouse on --bind until SIGTERM or Ctrl-C."""
    host, port = serving_endpoint("--bind", options.bind)
    for name in ("min_replicas", "heartbeat_timeout_ms", "join_timeout_ms", "quorum_tick_ms"):
        if getattr(options, name) < 1:
            raise LaunchError(f"--{name.replace('_', '-')} must be at least 1")
    settings = LighthouseSettings(
        options.min_replicas, options.heartbeat_timeout_ms, options.join_timeout_ms, options.quorum_tick_ms
    )
    # Blocked for good here: only sigwait below takes them (the server's threads never do).
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    server = serve_lighthouse((host, port), settings, stop)
    url = f"http://{format_endpoint((host, port))}"  # as given: server.address() names the host by its name
    print(f"lighthouse serving on {url} (min replicas {options.min_replicas}); stop with Ctrl-C", flush=True)
    try:
        received = signal.sigwait(stop)
    finally:
        server.shutdown()
    print(f"lighthouse stopped ({signal.Signals(received).name})", flush=True)
    return 0
