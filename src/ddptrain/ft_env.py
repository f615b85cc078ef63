"""The contract between `ddptrain launch --fault-tolerance torchft` and its workers: three variables.

The launcher sets them on every worker of a replica group (one node's ranks by default); a worker that
finds REPLICA_GROUP_ENV set trains in the in-place fault-tolerant mode (train/in_place.py), with its
group's ranks doing DDP among themselves and the groups all-reducing through torchft.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

from ddptrain.endpoints import host_port
from ddptrain.errors import LaunchError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # http://HOST:PORT of the Lighthouse (torchft's own variable name)
REPLICA_GROUP_ENV = "DDPTRAIN_REPLICA_GROUP"  # this group's id: a small integer, distinct per group
BIND_ENV = "DDPTRAIN_BIND_ADDR"  # the address this node's servers bind (the node's address or loopback)
# Fault drills (docs/multinode.md): "corrupt_send" flips a byte of the first state this group sends to a joining
# group, after its digest; "die_in_send" SIGKILLs this group's process when it is first asked to send one;
# "die_in_outer_sync" (train.diloco) SIGKILLs it in the first outer sync it contributes to, once every group is in.
INJECT_ENV = "DDPTRAIN_FT_INJECT"
INJECTIONS = ("corrupt_send", "die_in_send", "die_in_outer_sync")


@dataclass(frozen=True)
class FaultToleranceEnv:
    """Where the Lighthouse is, which replica group this worker belongs to, and the address to serve on."""

    lighthouse: str  # http://HOST:PORT
    replica_group: int
    bind: str
    inject: str | None = None  # a fault drill (INJECT_ENV)


def read_ft_env() -> FaultToleranceEnv | None:
    """The in-place mode's settings from the environment; None when this worker is not in that mode."""
    group = os.environ.get(REPLICA_GROUP_ENV)
    if group is None:
        return None
    if not group.isdigit() or len(group) > 6:
        raise LaunchError(f"{REPLICA_GROUP_ENV}={group!r} must be a small non-negative integer (the group's id)")
    lighthouse = os.environ.get(LIGHTHOUSE_ENV, "")
    if not lighthouse:
        raise LaunchError(
            f"{REPLICA_GROUP_ENV} is set but {LIGHTHOUSE_ENV} is not: launch with "
            "`ddptrain launch --fault-tolerance torchft --lighthouse HOST:PORT`"
        )
    address = lighthouse.removeprefix("http://")
    host_port(LIGHTHOUSE_ENV, address)  # one line naming the variable when it is not HOST:PORT
    inject = os.environ.get(INJECT_ENV) or None
    if inject is not None and inject not in INJECTIONS:
        raise LaunchError(f"{INJECT_ENV}={inject!r} is not a fault drill; use one of {', '.join(INJECTIONS)}")
    return FaultToleranceEnv(f"http://{address}", int(group), os.environ.get(BIND_ENV, "127.0.0.1"), inject)


def quiet_torchft() -> None:
    """Before torchft is imported: its Rust side logs every quorum and commit at INFO (a line per step and group),
    its manager a traceback per failed collective, and its checkpoint transport warns on every heal. ddptrain
    says each of those events in one line of its own (and records them in metrics.jsonl); RUST_LOG=info and
    the "torchft" logger's level bring torchft's back."""
    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", module=r"torchft\.checkpointing\.")
