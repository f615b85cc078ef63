"""etcd endpoints for the rendezvous: parsing `HOST[:PORT],...` and asking a member whether it is healthy.

`ddptrain launch`, the SLURM and Kubernetes generators and `ddptrain doctor` all read etcd
members the same way, and bad syntax exits 2 with one line naming the flag. (One `HOST:PORT`
with its port required is ddptrain/endpoints.py's.)
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

from ddptrain.endpoints import MAX_PORT, Endpoint, format_endpoint
from ddptrain.errors import LaunchError

ETCD_BACKENDS = ("etcd-v2", "etcd")  # torchrun's two etcd rendezvous; etcd-v2 is torch's current one
DEFAULT_PORT = 2379  # etcd's registered client port
EXTRA = "pip install 'ddptrain[etcd]'"  # the extra that installs PyPI's python-etcd
ETCD_ENV = "DDPTRAIN_ETCD_ENDPOINTS"  # set by `ddptrain launch` for its workers: `ddptrain doctor` checks them
MAX_ENDPOINTS = 16  # an etcd cluster has 3, 5 or 7 members; more is a typo or a paste of something else
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _host(flag: str, item: str, host: str) -> str:
    if host.startswith("[") and host.endswith("]"):
        try:
            return str(ipaddress.IPv6Address(host[1:-1]))
        except ValueError:
            raise LaunchError(f"{flag}: {item!r} has an invalid IPv6 address") from None
    if re.fullmatch(r"[0-9.]+", host):
        try:
            return str(ipaddress.IPv4Address(host))
        except ValueError:
            raise LaunchError(f"{flag}: {item!r} has an invalid IPv4 address") from None
    if len(host) > 253 or not all(_LABEL.match(label) for label in host.split(".")):
        raise LaunchError(f"{flag}: {item!r}: {host!r} is not a host name, IPv4 or [IPv6] address")
    return host


def parse_endpoints(flag: str, value: str) -> tuple[Endpoint, ...]:
    """(host, port) pairs from `HOST[:PORT][,HOST[:PORT]...]` (port 2379 when left out); LaunchError when malformed.

    An `http://` prefix is accepted (etcd prints its URLs that way); anything else of a URL is not.
    """
    items = [item.strip() for item in value.split(",")]
    if not value.strip() or any(not item for item in items):
        raise LaunchError(f"{flag} {value!r} must be HOST[:PORT][,HOST[:PORT]...] (e.g. 10.0.0.1:2379,10.0.0.2:2379)")
    if len(items) > MAX_ENDPOINTS:
        raise LaunchError(f"{flag}: {len(items)} endpoints; at most {MAX_ENDPOINTS} (one per etcd member)")
    out: list[Endpoint] = []
    for item in items:
        rest = item.removeprefix("http://")
        if "/" in rest or "@" in rest or any(c.isspace() for c in rest):
            raise LaunchError(f"{flag}: {item!r} must be HOST[:PORT], without a scheme other than http:// or a path")
        if rest.startswith("["):
            close = rest.find("]") + 1
            host, tail = (rest[:close], rest[close:]) if close else (rest, "")
        elif rest.count(":") > 1:
            raise LaunchError(f"{flag}: {item!r}: write an IPv6 address in brackets, e.g. [fd00::1]:2379")
        else:
            colon = rest.find(":")
            host, tail = (rest, "") if colon < 0 else (rest[:colon], rest[colon:])
        port = tail[1:] if tail.startswith(":") else None
        if tail and (port is None or not port.isdigit() or not 0 < int(port) <= MAX_PORT):
            raise LaunchError(f"{flag}: {item!r} has no valid port (1-65535)")
        endpoint = (_host(flag, item, host), int(port) if port else DEFAULT_PORT)
        if endpoint in out:
            raise LaunchError(f"{flag}: {item!r} is given twice")
        out.append(endpoint)
    return tuple(out)


def format_endpoints(endpoints: Sequence[Endpoint]) -> str:
    """The comma-separated form parse_endpoints reads."""
    return ",".join(format_endpoint(e) for e in endpoints)


def require_client() -> None:
    """LaunchError (exit 2) naming the extra to install when PyPI's python-etcd is not importable."""
    try:
        import etcd  # noqa: F401
    except ImportError:
        raise LaunchError(f"the etcd rendezvous needs PyPI's python-etcd, which is not installed: {EXTRA}") from None


def _get(url: str, timeout_s: float) -> tuple[int, bytes]:
    """(HTTP status, start of the body) of a GET; OSError (URLError, timeouts) when there is no answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - http only, built here
            return response.status, response.read(4096)
    except urllib.error.HTTPError as e:
        return e.code, e.read(4096)


def health(endpoint: Endpoint, timeout_s: float) -> str | None:
    """None when the member can serve torch's rendezvous, else why not (each request waits at most timeout_s).

    Healthy means: `GET /health` says true, which etcd (3.x) answers only while the member sees a
    leader, so a member cut off from its quorum is not healthy; and the v2 API answers, which torch's
    etcd rendezvous speaks and etcd 3.4 serves only when started with --enable-v2.
    """
    base = f"http://{format_endpoint(endpoint)}"
    try:
        status, body = _get(f"{base}/health", timeout_s)
        try:
            healthy = json.loads(body).get("health") in ("true", True)
        except (ValueError, AttributeError):
            return f"HTTP {status} from /health, not etcd's answer: {body[:80]!r}"
        if not healthy:
            return f"unhealthy (no leader: quorum lost?): {body.decode(errors='replace').strip()[:200]}"
        status, _ = _get(f"{base}/v2/keys/", timeout_s)
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, socket.timeout | TimeoutError):
            return f"no answer within {timeout_s:g} s"
        return getattr(reason, "strerror", None) or str(reason)
    if status != 200:
        return f"the v2 API is off (HTTP {status}): start etcd with --enable-v2, torch's etcd rendezvous speaks v2"
    return None


def wait_healthy(endpoints: Sequence[Endpoint], timeout_s: float) -> dict[Endpoint, str | None]:
    """Ask every member until one is healthy or timeout_s has passed; each endpoint's last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        answers = {e: health(e, max(0.2, min(2.0, left))) for e in endpoints}
        if any(why is None for why in answers.values()) or deadline - time.monotonic() <= 0:
            return answers
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
