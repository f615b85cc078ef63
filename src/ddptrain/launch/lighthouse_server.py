"""torchft's Lighthouse served in this process, bound to one address (never all interfaces).

`ddptrain lighthouse` serves one for a job's replica groups; `ddptrain launch --fault-tolerance torchft`
without --lighthouse serves one on loopback for the groups of a one-node job, with the same settings.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ddptrain.endpoints import Endpoint, format_endpoint, host_port, split_host_port
from ddptrain.errors import LaunchError, UserError
from ddptrain.ft_env import quiet_torchft

ALL_INTERFACES = ("0.0.0.0", "::", "*", "")
FT_EXTRA = "pip install 'ddptrain[ft]'"


@dataclass(frozen=True)
class LighthouseSettings:
    """The quorum timing a Lighthouse runs with (docs/multinode.md says why these values)."""

    min_replicas: int = 1
    heartbeat_timeout_ms: int = 1000
    join_timeout_ms: int = 5000
    quorum_tick_ms: int = 100


DEFAULTS = LighthouseSettings()


def serving_endpoint(flag: str, text: str) -> Endpoint:
    """(host, port) of a HOST:PORT a Lighthouse serves on or is reached at; LaunchError (one line) when it is
    malformed or names all interfaces (the Lighthouse has no authentication)."""
    host, port = host_port(flag, text)
    if host in ALL_INTERFACES:
        raise LaunchError(
            f"{flag} {text!r} listens on all interfaces: give this node's address or 127.0.0.1 "
            "(the Lighthouse has no authentication)"
        )
    return host, port


def require_torchft(what: str) -> None:
    """UserError (exit 2, one line) when torchft, the ft extra, is not installed."""
    quiet_torchft()
    try:
        import torchft.coordination  # noqa: F401
    except ImportError:
        raise UserError(f"{what} needs torchft: {FT_EXTRA}") from None


def serve_lighthouse(endpoint: Endpoint, settings: LighthouseSettings, signals: Iterable[signal.Signals]) -> Any:
    """Start torchft's LighthouseServer on `endpoint` (port 0: a free one); returns the server (`.shutdown()`).

    `signals` are blocked while its threads start, so that they stay with this process's main thread
    (the caller's handlers or sigwait), then the previous mask comes back.
    """
    require_torchft("the Lighthouse")
    from torchft.coordination import LighthouseServer

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        return LighthouseServer(
            bind=format_endpoint(endpoint),
            min_replicas=settings.min_replicas,
            join_timeout_ms=settings.join_timeout_ms,
            quorum_tick_ms=settings.quorum_tick_ms,
            heartbeat_timeout_ms=settings.heartbeat_timeout_ms,
        )
    except RuntimeError as e:  # the address is not this node's, or the port is taken
        where = format_endpoint(endpoint)
        raise LaunchError(f"cannot serve the Lighthouse on {where}: {str(e).strip().splitlines()[0]}") from None
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def served_port(server: Any) -> int:
    """The port a server started on port 0 listens on (its address names the host by name, not as bound)."""
    endpoint = split_host_port(str(server.address()).removeprefix("http://"))
    if endpoint is None:
        raise LaunchError(f"the Lighthouse reports an address without a port: {server.address()}")
    return endpoint[1]
