"""In-place fault tolerance on torchft: this replica group's Manager, its quorum, and the cross-group reductions.

Each step starts with a quorum from the Lighthouse (synchronous: the step's data split depends on who
is in it). A group that is behind (a replacement) receives the live state from a peer during the quorum
and checks it before it trains (`heal`). Gradients cross the groups in one fixed layout of buckets
(train/cross_group.py) through `cross_sum`, whose errors are reported to the Manager, never raised: a
peer dying mid all-reduce makes
`should_commit()` discard the step instead of crashing the survivors (torchft's own DDP comm hook asserts
there, field notes). Every server binds the node's address (FaultToleranceEnv.bind), never all interfaces.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddptrain.dist import DistContext, broadcast_object, listening_store, probe_store
from ddptrain.endpoints import host_port
from ddptrain.errors import LaunchError, UserError
from ddptrain.ft_env import LIGHTHOUSE_ENV, FaultToleranceEnv, quiet_torchft

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, Any]]
LoadFn = Callable[[dict[str, Any]], None]


# gloo's and torchft's error texts: a C++ source location, emoji, then advice for whoever reads a crash.
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|h|rs):\d+\]\s*")
_ADVICE = (". This is typically", ". Check the logs")


def plain_error(line: str) -> str:
    """A transport error's first line as a user reads it: no source location, no emoji, no advice, bounded."""
    text = _SOURCE.sub("", line).encode("ascii", "ignore").decode().strip()
    for advice in _ADVICE:
        text = text.split(advice)[0]
    return " ".join(text.split())[:200]


@dataclass(frozen=True)
class Heal:
    """What this group received from a live peer in this step's quorum."""

    seconds: float  # quorum + transfer + verification + load
    bytes: int
    verified: bool  # the digest the donor sent matched what arrived
    error: str | None = None  # why the state was refused (verified is False)


@dataclass(frozen=True)
class View:
    """This step's quorum as this group sees it."""

    rank: int  # this group's rank among the participating groups
    groups: int  # participating groups
    heal: Heal | None  # set when this group healed in this quorum


def tree_digest(state: Any) -> str:
    """SHA-256 over a state tree: every tensor's dtype, shape and bytes, every other leaf's pickle, in key order."""
    h = hashlib.sha256()

    def visit(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            h.update(b"D%d" % len(obj))
            for k in sorted(obj, key=repr):
                h.update(repr(k).encode())
                visit(obj[k])
        elif isinstance(obj, (list, tuple)):
            h.update(b"L%d" % len(obj))
            for v in obj:
                visit(v)
        else:
            h.update(pickle.dumps(obj, protocol=4))

    visit(state)
    return h.hexdigest()


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in a state tree."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(v) for v in state)
    return 0


def _flip_one_byte(state: Any) -> Any:
    """A copy of the state tree whose first non-empty floating-point tensor has one byte flipped (a fault drill)."""
    flipped = False

    def visit(obj: Any) -> Any:
        nonlocal flipped
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.numel() and not flipped:
            flipped = True
            copy = obj.detach().clone().contiguous()
            copy.reshape(-1).view(torch.uint8)[0] ^= 0x01
            return copy
        if isinstance(obj, dict):
            return {k: visit(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [visit(v) for v in obj]
        return obj

    return visit(state)


@contextmanager
def _lighthouse_named(lighthouse: str, timeout: timedelta) -> Iterator[None]:
    """A Lighthouse that cannot be reached becomes one line naming it (torchft raises a RuntimeError with the
    gRPC details; the group's rank 0 connects, the others wait on the group's store)."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [""])[0]
        if "failed to connect" not in first and "Lighthouse" not in first:
            raise
        cause = "connection refused" if "refused" in first else "no answer"
        raise LaunchError(
            f"cannot reach the Lighthouse at {lighthouse} within {timeout.total_seconds():g} s ({cause}); "
            "start it with `ddptrain lighthouse --bind HOST:PORT` and pass that address"
        ) from None


_server_lock = threading.Lock()


@contextmanager
def _manager_server_bound(host: str) -> Iterator[None]:
    """torchft 0.2.0's Manager builds its gRPC server on `[::]` (every interface) with no way to say otherwise:
    while the Manager is made, its ManagerServer is built on `host` instead (an ephemeral port)."""
    import torchft.manager as manager_module

    original = manager_module.ManagerServer

    def bound(**kwargs: Any) -> Any:
        kwargs["bind"] = f"[{host}]:0" if ":" in host else f"{host}:0"
        return original(**kwargs)

    with _server_lock:
        manager_module.ManagerServer = bound
        try:
            yield
        finally:
            manager_module.ManagerServer = original


class InPlaceSession:
    """This rank's share of its replica group's torchft Manager. `start` (a collective in the group) makes it."""

    def __init__(self, env: FaultToleranceEnv, ctx: DistContext, timeout_s: float, outage_s: float) -> None:
        """timeout_s: one collective, vote, transfer or quorum; outage_s: how long quorums are retried while the
        Lighthouse is away (the job pauses, then this group fails)."""
        self.env, self.ctx = env, ctx
        self.timeout = timedelta(seconds=timeout_s)
        self.outage_s = outage_s
        self.manager: Any = None
        self.pg: Any = None
        self._store: Any = None
        self._state_fn: StateFn | None = None
        self._load_fn: LoadFn | None = None
        self._heal: Heal | None = None
        self._reported = False  # this step was failed by report() (a check of ours), not by a collective
        self._drill = env.inject

    def reach(self) -> None:
        """Before anything is written: LaunchError (exit 2, one line) when the Lighthouse does not answer a TCP
        connection within dist.ft_timeout_s, or when torchft is not installed (UserError)."""
        quiet_torchft()
        try:
            import torchft.manager  # noqa: F401
        except ImportError:
            raise UserError("in-place fault tolerance needs torchft: pip install 'ddptrain[ft]'") from None
        host, port = host_port(LIGHTHOUSE_ENV, self.env.lighthouse.removeprefix("http://"))
        why = probe_store(host, port, time.monotonic() + self.timeout.total_seconds(), poll_s=0.2)
        if why is not None:
            raise LaunchError(
                f"cannot reach the Lighthouse at {self.env.lighthouse} within {self.timeout.total_seconds():g} s "
                f"({why}); start it with `ddptrain lighthouse --bind HOST:PORT` and pass that address"
            )

    def start(self, step: int, state_fn: StateFn, load_fn: LoadFn) -> None:
        """All ranks of the group, once the run resumed at `step`: the group's store (rank 0 serves it on the bind
        address), then the Manager, which heartbeats to the Lighthouse from then on (so a group still loading
        its checkpoint never holds up the others' quorum). state_fn/load_fn: the live state a donor sends and a
        joiner loads (after its digest is checked)."""
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        self._state_fn, self._load_fn = state_fn, load_fn
        bind = self.env.bind
        port = 0
        if self.ctx.rank == 0:
            # A store of its own per incarnation: a restarted group never reads the last one's keys.
            self._store = listening_store(bind, 0, self.timeout)
            port = self._store.port
        port = broadcast_object(self.ctx, port)
        pg_class = ProcessGroupNCCL if self.ctx.device.type == "cuda" else ProcessGroupGloo
        self.pg = pg_class(timeout=self.timeout)
        with _manager_server_bound(bind), _lighthouse_named(self.env.lighthouse, self.timeout):
            self.manager = Manager(
                pg=self.pg,
                load_state_dict=self._load,
                state_dict=self._send,
                min_replica_size=1,
                use_async_quorum=False,  # the step's data split depends on the quorum: know it first
                timeout=self.timeout,
                quorum_timeout=self.timeout,
                connect_timeout=self.timeout,
                rank=self.ctx.rank,
                world_size=self.ctx.world_size,
                store_addr=bind,
                store_port=port,
                lighthouse_addr=self.env.lighthouse,
                replica_id=f"g{self.env.replica_group}",
                hostname=bind,  # what the other groups dial to heal from us: an address, not a host name
                checkpoint_transport=PGTransport(self.pg, self.timeout, self.ctx.device),
                init_sync=False,  # every group builds the same initial weights from run.seed
                max_retries=20,
            )
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def _send(self) -> dict[str, Any]:
        """The donor's side of a heal: the live state and its digest (the joiner checks it before loading)."""
        assert self._state_fn is not None
        state = self._state_fn()
        sent = {"state": state, "digest": tree_digest(state)}
        drill, self._drill = self._drill, None  # a drill fires once
        if drill == "die_in_send":
            log.warning("fault drill: this group dies while it is the donor of a heal")
            os.kill(os.getpid(), signal.SIGKILL)
        if drill == "corrupt_send":
            log.warning("fault drill: one byte of the state sent to the joining group is flipped")
            sent["state"] = _flip_one_byte(state)
        return sent

    def _load(self, received: dict[str, Any]) -> None:
        """The joiner's side: load the received state only when its bytes hash to the digest the donor sent."""
        assert self._load_fn is not None
        state, digest = received["state"], received["digest"]
        size = tensor_bytes(state)
        got = tree_digest(state)
        if got != digest:
            self._heal = Heal(0.0, size, False, f"received state digest {got[:12]} != donor's {digest[:12]}")
            return
        self._load_fn(state)
        self._heal = Heal(0.0, size, True)

    def quorum(self, committed_step: int, still_waiting: Callable[[str], None]) -> View:
        """This step's quorum (healing this group from a peer when it is behind).

        A quorum that fails (the Lighthouse lost, or restarting) is asked again until the Lighthouse answers,
        for up to `outage_s`; still_waiting(why) is called before each new attempt.
        """
        self._heal, self._reported = None, False
        t0 = time.perf_counter()
        self._start_quorum(still_waiting)
        heal = self._heal
        if heal is not None:
            heal = Heal(time.perf_counter() - t0, heal.bytes, heal.verified, heal.error)
            if not heal.verified:
                # Stay behind the others, so that the next quorum heals this group again.
                self.manager.load_state_dict({"step": committed_step, "batches_committed": 0})
        rank = self.manager.participating_rank()
        return View(rank if rank is not None else -1, self.manager.num_participants(), heal)

    def _start_quorum(self, still_waiting: Callable[[str], None]) -> None:
        give_up = time.monotonic() + self.outage_s
        while True:
            try:
                self.manager.start_quorum(timeout=self.timeout)
                return
            except Exception as e:  # torchft raises the quorum's own failure: a gRPC error, a timeout
                why = plain_error((str(e).strip().splitlines() or [type(e).__name__])[0])
                if time.monotonic() > give_up:
                    raise RuntimeError(
                        f"no quorum for {self.outage_s:g} s (dist.timeout_s) from the Lighthouse at "
                        f"{self.env.lighthouse}: {why}"
                    ) from None
                # torchft 0.2.0 keeps the failed quorum and raises it again from every later start_quorum; a
                # restarted Lighthouse would never be asked. Dropping it lets the next attempt ask anew.
                self.manager._quorum_future = None
                still_waiting(why)
                time.sleep(0.5)

    def errored(self) -> bool:
        """True when a collective of this step failed (the step will be discarded)."""
        return self.manager.errored() is not None

    def error_line(self) -> str:
        """This step's failure in a short line ("" when none): plain_error() of its first line."""
        error = self.manager.errored()
        return plain_error((str(error).strip().splitlines() or [""])[0]) if error is not None else ""

    def heal_again(self) -> None:
        """Fall behind every other group, so that the next quorum heals this one again."""
        self.manager.load_state_dict({"step": 0, "batches_committed": 0})

    def report(self, why: str) -> None:
        """Mark this step failed: should_commit() then discards it."""
        self._reported = True
        self.manager.report_error(RuntimeError(why))

    def abandon_collectives(self) -> None:
        """After a discarded step whose collective failed (a peer gone): abort the cross-group process group now.

        A survivor can be waiting in that collective for another survivor rather than for the dead group (a ring
        all-reduce's next hop), and gloo has no deadline short of dist.ft_timeout_s: it would sit there until the
        other survivor's next quorum replaced the group, after the Lighthouse's join timeout had run out waiting
        for it (the 5 s stalls of docs/goodput.md). Aborting here closes this rank's connections, so such a
        peer fails at once and asks for the next quorum, whose new membership configures a new process group.
        A step failed by a check of ours (report) leaves the group as it is: its collectives all completed.
        """
        if self.errored() and not self._reported:
            self.pg.abort()

    def should_commit(self) -> bool:
        """The group's verdict on this step (a round trip to its Manager): commit, or discard and retry."""
        return bool(self.manager.should_commit())

    def cross_sum(self, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
        """Sum `tensor` over the participating groups (in place); errors go to the Manager, never raised."""
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # torch's stubs type the field narrowly
        try:
            fut = self.pg.allreduce([tensor], opts).get_future()
        except Exception as e:  # a process group already broken by a lost peer
            self.manager.report_error(e)
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(tensor)
            return done
        waited: torch.futures.Future[Any] = self.manager.wrap_future(fut, [tensor], timeout=self.timeout)
        return waited.then(lambda _f: tensor)  # reduced in place, or left as it was after a reported failure

    def sum_over_all_ranks(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor` summed over every rank of every participating group; None when the reduction failed."""
        if self.ctx.world_size > 1:
            dist.all_reduce(tensor, group=self.ctx.group)
        self.cross_sum(tensor).wait()
        return None if self.errored() else tensor

    def close(self) -> None:
        """Stop the Manager's server and threads, and the group's store."""
        if self.manager is not None:
            try:
                self.manager.shutdown(wait=False)
            except Exception as e:  # closing after a failure: say it, do not mask the failure
                log.warning("torchft manager shutdown: %s", e)
            self.manager = None
        self._store = None
