"""HOST:PORT, the one way: the rendezvous endpoint of `ddptrain launch`, the store a worker checks in
at, the endpoint `ddptrain doctor` probes. A leaf: launch code, the doctor and the live triage read
endpoints alike. (An etcd member list, HOST[:PORT],... with a default port, is etcd_endpoints.py's.)
"""

from __future__ import annotations

from ddptrain.errors import LaunchError

Endpoint = tuple[str, int]
MAX_PORT = 65535


def split_host_port(text: str) -> Endpoint | None:
    """(host, port) of `HOST:PORT` (an IPv6 host loses its brackets; port 0 asks for any free one), else None."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > MAX_PORT:
        return None
    return host.strip("[]"), int(port)


def host_port(flag: str, text: str) -> Endpoint:
    """(host, port) of a `HOST:PORT` the user gave with `flag`; LaunchError (exit 2) unless the port is 1-65535."""
    endpoint = split_host_port(text)
    if endpoint is None or endpoint[1] == 0:
        raise LaunchError(f"{flag} {text!r} must look like HOST:PORT (e.g. 10.0.0.1:29500)")
    return endpoint


def format_endpoint(endpoint: Endpoint) -> str:
    """HOST:PORT as etcd and torchrun write it (IPv6 in brackets)."""
    host, port = endpoint
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
