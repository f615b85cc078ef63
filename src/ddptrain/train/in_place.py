"""In-place fault tolerance on torchft: this replica group's Manager, its quorum, and the cross-group reductions.

Each step starts with a quorum from the Lighthouse (synchronous: the step's data split depends on who
is in it). A group that is behind (a replacement) receives the live state from a peer during the quorum
and checks it before it trains (`heal`); before a byte moves it reads the donor's recipe, and refuses a
donor of another one by exiting 2 (train/in_place_transport.py). Each quorum says whether its membership
is new to this group (`View.new`: the Trainer then admits it before its first step). Gradients cross the groups in one fixed layout of buckets
(train/cross_group.py) through `cross_sum`, whose errors are reported to the Manager, never raised: a
peer dying mid all-reduce makes
`should_commit()` discard the step instead of crashing the survivors (torchft's own DDP comm hook asserts
there, field notes). Every server binds the node's address (FaultToleranceEnv.bind), never all interfaces.
A group that stops answering is evicted from the step in flight (train/peer_watch.py).

The quorum is awaited from a thread of this session, so that the rank can leave the wait: a stop requested while
the Lighthouse is gone (it lived in the launcher that was killed) raises QuorumAbandoned, and the group stops at
its last committed step (the in-place sync's stop_at_last_commit, train/sync/in_place.py) instead of waiting out
dist.ft_timeout_s.
"""

from __future__ import annotations

import concurrent.futures
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
from ddptrain.train.agreement import another_recipe
from ddptrain.train.peer_watch import Eviction, PeerWatch, RecordingClient
from ddptrain.train.preemption import leave_without_teardown

log = logging.getLogger(__name__)

StateFn = Callable[[], dict[str, Any]]
LoadFn = Callable[[dict[str, Any]], None]
LEAVE_POLL_S = 0.2  # how often a pending quorum asks whether the rank should leave it
PROBE_S = 1.0  # a Lighthouse that does not accept a connection within this is gone


class QuorumAbandoned(Exception):
    """This rank left a pending quorum (leave() said so): its group stops at its last committed step."""


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
    new: bool = False  # the membership changed since this group's last quorum (its groups are admitted first)


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


def reach(env: FaultToleranceEnv, timeout_s: float) -> None:
    """Before anything is written: LaunchError (exit 2, one line) when the Lighthouse does not answer a TCP
    connection within timeout_s (dist.ft_timeout_s), or when torchft is not installed (UserError)."""
    quiet_torchft()
    try:
        import torchft.manager  # noqa: F401
    except ImportError:
        raise UserError("in-place fault tolerance needs torchft: pip install 'ddptrain[ft]'") from None
    host, port = host_port(LIGHTHOUSE_ENV, env.lighthouse.removeprefix("http://"))
    why = probe_store(host, port, time.monotonic() + timeout_s, poll_s=0.2)
    if why is not None:
        raise LaunchError(
            f"cannot reach the Lighthouse at {env.lighthouse} within {timeout_s:g} s "
            f"({why}); start it with `ddptrain lighthouse --bind HOST:PORT` and pass that address"
        )


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
        self._transport: Any = None  # train/in_place_transport.py: the recipe-checked heal transport
        self._quorum_id: int | None = None  # the last quorum's id (torchft's: a new one for a new membership)
        self._reported = False  # this step was failed by report() (a check of ours), not by a collective
        self._drill = env.inject
        self.watch: PeerWatch | None = None
        self._evicted = False  # this step's collectives were given up on (take_eviction)
        self._stale_groups: list[Any] = []  # process groups left with a frozen group's collective in flight
        self._asker = concurrent.futures.ThreadPoolExecutor(1, "ddptrain-quorum", initializer=self._on_own_device)

    def _on_own_device(self) -> None:
        """The quorum thread works on this rank's device (a heal's tensors land there)."""
        if self.ctx.device.type == "cuda":
            torch.cuda.set_device(self.ctx.device)

    def start(self, step: int, state_fn: StateFn, load_fn: LoadFn, recipe: str) -> None:
        """All ranks of the group, once the run resumed at `step`: the group's store (rank 0 serves it on the bind
        address), then the Manager, which heartbeats to the Lighthouse from then on (so a group still loading
        its checkpoint never holds up the others' quorum). state_fn/load_fn: the live state a donor sends and a
        joiner loads (after its digest is checked); recipe: this group's (a heal from another is refused)."""
        from torchft.checkpointing.pg_transport import PGTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        from ddptrain.train.in_place_transport import RecipeTransport

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
        inner = PGTransport(self.pg, self.timeout, self.ctx.device)
        self._transport = RecipeTransport(inner, self.env.replica_group, recipe)
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
                checkpoint_transport=self._transport,
                init_sync=False,  # every group builds the same initial weights from run.seed
                max_retries=20,
            )
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        address = self.env.lighthouse.removeprefix("http://")
        self.watch = PeerWatch(f"http://{address}/status", self.env.replica_group).start()
        self.manager._client = RecordingClient(self.manager._client, self.watch.quorum_formed)

    def lighthouse_answers(self) -> bool:
        """Whether the Lighthouse accepts a TCP connection within PROBE_S."""
        host, port = host_port(LIGHTHOUSE_ENV, self.env.lighthouse.removeprefix("http://"))
        return probe_store(host, port, time.monotonic() + PROBE_S) is None

    def _send(self) -> dict[str, Any]:
        """The donor's side of a heal: the live state and its digest (the joiner checks it before loading)."""
        assert self._state_fn is not None
        state = self._state_fn()
        sent = {"state": state, "digest": tree_digest(state)}
        if self.drill("die_in_send"):
            log.warning("fault drill: this group dies while it is the donor of a heal")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.drill("corrupt_send"):
            log.warning("fault drill: one byte of the state sent to the joining group is flipped")
            sent["state"] = _flip_one_byte(state)
        return sent

    def drill(self, name: str) -> bool:
        """Whether the fault drill `name` (ft_env.INJECT_ENV) fires now: the one this group was given, once."""
        if self._drill != name:
            return False
        self._drill = None
        return True

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

    def quorum(
        self, committed_step: int, still_waiting: Callable[[str], None], leave: Callable[[], bool] = lambda: False
    ) -> View:
        """This step's quorum (healing this group from a peer when it is behind).

        A quorum that fails (the Lighthouse lost, or restarting) is asked again until the Lighthouse answers,
        for up to `outage_s`; still_waiting(why) is called before each new attempt. While a quorum is pending,
        leave() is asked every LEAVE_POLL_S: True raises QuorumAbandoned. ConfigError (exit 2) when the donor of
        this group's heal trains another recipe: nothing of its state was received.
        """
        self._heal, self._reported = None, False
        t0 = time.perf_counter()
        self._start_quorum(still_waiting, leave)
        if self._transport.refused_by is not None:
            raise another_recipe(self.env.replica_group, [self._transport.refused_by])
        # torchft 0.2.0 has no accessor for the quorum's id; a new id is a new membership for every group in it.
        new, self._quorum_id = self.manager._quorum_id != self._quorum_id, self.manager._quorum_id
        heal = self._heal
        if heal is not None:
            heal = Heal(time.perf_counter() - t0, heal.bytes, heal.verified, heal.error)
            if not heal.verified:
                # Stay behind the others, so that the next quorum heals this group again.
                self.manager.load_state_dict({"step": committed_step, "batches_committed": 0})
        rank = self.manager.participating_rank()
        return View(rank if rank is not None else -1, self.manager.num_participants(), heal, new)

    def _start_quorum(self, still_waiting: Callable[[str], None], leave: Callable[[], bool]) -> None:
        give_up = time.monotonic() + self.outage_s
        while True:
            try:
                self._ask_quorum(leave)
                return
            except QuorumAbandoned:
                raise
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

    def _ask_quorum(self, leave: Callable[[], bool]) -> None:
        """One quorum, awaited from the session's thread; QuorumAbandoned when leave() says so first. torchft's own
        quorum thread then waits out its timeout, so the process leaves without joining it at exit."""
        pending = self._asker.submit(self.manager.start_quorum, timeout=self.timeout)
        while not concurrent.futures.wait([pending], timeout=LEAVE_POLL_S).done:
            if leave():
                leave_without_teardown()
                raise QuorumAbandoned
        pending.result()  # the quorum's own failure, raised here

    def errored(self) -> bool:
        """True when a collective of this step failed (the step will be discarded)."""
        return self.manager.errored() is not None

    def error_line(self) -> str:
        """This step's failure in a short line ("" when none): plain_error() of its first line."""
        error = self.manager.errored()
        return plain_error((str(error).strip().splitlines() or [""])[0]) if error is not None else ""

    def at_step(self, step: int) -> None:
        """The step this group holds, as the next quorum compares it (a group behind the others heals): for the
        quorums of outer syncs only, whose commits do not count training steps."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

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

        After an eviction (train/peer_watch.py) a collective is still in flight with the frozen group, and gloo
        waits for it, in an abort or in the group's destructor, until dist.ft_timeout_s: that group is detached
        from torchft's wrapper (whose next configure would abort it) and kept, unaborted, until the session ends;
        the next quorum configures a new one. When the frozen group wakes, its collective completes or fails.
        """
        if not self.errored() or self._reported:
            return
        if self._evicted:
            self._stale_groups.append(self.pg._pg)
            self.pg._pg = None
            self.manager._quorum_id = -1  # the next quorum configures a new group even with the same members
            return
        self.pg.abort()

    def mark_step(self) -> None:
        """An attempt at a step starts (the watch's frozen time counts from here)."""
        if self.watch is not None:
            self.watch.mark()

    def frozen_s(self) -> float:
        """How long this process was stopped during the attempt (0 without a watch)."""
        return self.watch.frozen_s() if self.watch is not None else 0.0

    def take_eviction(self) -> Eviction | None:
        """The groups evicted from this step for not answering (train/peer_watch.py), if any."""
        eviction = self.watch.take_eviction() if self.watch is not None else None
        self._evicted = eviction is not None
        return eviction

    def outsiders(self) -> list[int]:
        """The groups heartbeating to the Lighthouse that are not in the last quorum (read from its status page)."""
        return self.watch.outsiders() if self.watch is not None else []

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
            if self.watch is not None:
                fut = self.watch.track(fut)
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
        """Stop the Manager's server and threads, the eviction watch, and the group's store."""
        if self.watch is not None:
            self.watch.close()
        self._asker.shutdown(wait=False)
        if self.manager is not None:
            try:
                self.manager.shutdown(wait=False)
            except Exception as e:  # closing after a failure: say it, do not mask the failure
                log.warning("torchft manager shutdown: %s", e)
            self.manager = None
        self._store = None
