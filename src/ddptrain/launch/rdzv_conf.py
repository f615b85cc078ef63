"""`ddptrain launch --rdzv-conf KEY=VALUE,...`: the rendezvous options, checked before anything starts.

torch reads these keys only when the rendezvous is created (torch/distributed/elastic/rendezvous:
`dynamic_rendezvous.create_handler` for c10d and etcd-v2, `c10d_rendezvous_backend`, and here
launch/etcd_rdzv.py for both etcd backends), with `int()` and its own reading of booleans: a bad
value passed `--dry-run` and failed the real launch with a traceback, and `read_timeout=-1` was
taken. Each key is checked here for the backend in use (exit 2, one line naming it).

A key the backend does not read is refused as well: torch ignores it without a word, so a
misspelt `keep_alive_intervall=1` would leave the default in force. The keys that have their own
option (`join_timeout`, the etcd backend's `timeout`, `last_call_timeout`) are refused too, so one
setting is never given twice with the later one silently winning.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddptrain.config import MAX_TIMEOUT_S
from ddptrain.errors import LaunchError

# The values of is_host that torch's get_as_bool and the launcher's own reading of it agree on.
_BOOLEANS = ("true", "false", "1", "0")


Spec = tuple[str | int, ...]  # ("int", low, high), ("choice", value, ...), ("file",) or ("prefix",)


def _seconds(least: int) -> Spec:
    return ("int", least, int(MAX_TIMEOUT_S))


# DynamicRendezvousHandler's keys (c10d and etcd-v2), with what each may be.
_DYNAMIC: dict[str, Spec] = {
    "close_timeout": _seconds(1),
    "heartbeat_timeout": _seconds(1),
    "keep_alive_interval": _seconds(1),
    "keep_alive_max_attempt": ("int", 1, 1000),
}
_ETCD: dict[str, Spec] = {
    "read_timeout": _seconds(1),
    "protocol": ("choice", "http", "https"),
    "ssl_cert": ("file",),
    "ssl_cert_key": ("file",),
    "ca_cert": ("file",),
}
KEYS: dict[str, dict[str, Spec]] = {
    "c10d": {**_DYNAMIC, "read_timeout": _seconds(1), "is_host": ("choice", *_BOOLEANS)},
    "etcd-v2": {**_DYNAMIC, **_ETCD},
    "etcd": {**_ETCD, "etcd_prefix": ("prefix",)},
}
OWN_OPTIONS = {"join_timeout": "--rdzv-timeout", "timeout": "--rdzv-timeout", "last_call_timeout": "--rdzv-last-call"}


def parse_rdzv_conf(backend: str, conf: str) -> dict[str, str]:
    """The KEY=VALUE items of --rdzv-conf for `backend`, each checked; LaunchError naming the first bad one."""
    known = KEYS[backend]
    items: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in conf.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise LaunchError(f"--rdzv-conf item {item!r} must look like KEY=VALUE")
        if key in OWN_OPTIONS:
            raise LaunchError(f"--rdzv-conf {key}: give it as {OWN_OPTIONS[key]}, the launcher's own option for it")
        if key not in known:
            raise LaunchError(
                f"--rdzv-conf {key!r} is not a {backend} rendezvous option (torch would ignore it); "
                f"known: {', '.join(sorted(known))}"
            )
        if key in items:
            raise LaunchError(f"--rdzv-conf {key} is given twice")
        _check_value(key, value, known[key])
        items[key] = value
    return items


def _check_value(key: str, value: str, spec: Spec) -> None:
    kind = spec[0]
    if kind == "int":
        low, high = int(spec[1]), int(spec[2])
        if not re.fullmatch(r"[0-9]+", value) or not low <= int(value) <= high:
            raise LaunchError(f"--rdzv-conf {key}={value!r} must be a whole number from {low} to {high}")
    elif kind == "choice" and value not in spec[1:]:
        raise LaunchError(f"--rdzv-conf {key}={value!r} must be one of {', '.join(map(str, spec[1:]))}")
    elif kind == "file" and not Path(value).is_file():
        raise LaunchError(f"--rdzv-conf {key}={value!r}: no such file on this node")
    elif kind == "prefix" and not re.fullmatch(r"/[\x21-\x7e]*", value):
        raise LaunchError(f"--rdzv-conf {key}={value!r} must be an etcd key prefix starting with '/'")
