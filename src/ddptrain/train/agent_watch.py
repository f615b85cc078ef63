"""Workers stop when their agent dies.

torchrun starts its workers in sessions of their own, and `ddptrain launch`'s preloaded workers
fork from a fork server into sessions of their own too: a SIGKILL of the agent (the OOM killer's
pick, `kill -9`, a node agent crash) reaches none of them, and nothing else tells them. Left
alone they train on unsupervised and keep the run folder's lease, so the restarted job is refused.

Under an agent (torchrun's TORCHELASTIC_RUN_ID is set) a daemon thread checks twice a second
that the agent is still there. For exec'd workers (plain torchrun, `--worker-start exec`) the
agent is the parent: os.getppid() changes, to init or a subreaper, the moment it dies. Preloaded
workers' parent is the fork server, which outlives the agent (every forked worker holds the write
end of the pipe whose end of file would stop it), so `ddptrain launch` names itself in
DDPTRAIN_AGENT_PID and the worker watches that process: gone, a zombie, or a newer process with
the same pid (its start time in /proc differs) all mean dead. PR_SET_PDEATHSIG was not used: it
fires when the parent *thread* that forked the worker ends, not the process; it would fire on the
fork server, not the agent; and a worker could only set it after it started, racing the death it
should catch.

On the agent's death the worker stops as for SIGTERM: it sends itself the signal, the ranks
agree on the stop and commit a checkpoint (exit 75), as when the agent forwards a scheduler's
SIGTERM. The agent would have given its workers its shutdown timeout before SIGKILL; a worker
still alive after that grace (the stop cannot complete: a peer frozen, a collective that never
returns) releases the run folder's lease and exits 1 at once. The grace is `ddptrain launch
--shutdown-timeout` (passed as DDPTRAIN_STOP_GRACE_S), else 30 s (torchrun's default). The
kernel's alarm ends the process 10 s later should even that not run.

A forked worker whose run has ended then waits for the agent to read its return value (torch's worker
wrapper), its run's watch closed: should the agent die then, leave_if_the_agent_dies ends it (exit 0: the
work was done) rather than leave it waiting, and holding the fork server, for ever.

A plain `ddptrain train` has no agent and no watcher: it goes on when the shell that started it
exits (nohup, a closed SSH session with the output redirected).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ddptrain import streams
from ddptrain.errors import EXIT_FAILURE

log = logging.getLogger(__name__)

AGENT_ENV = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent (and `ddptrain launch`'s) in every worker
AGENT_PID_ENV = "DDPTRAIN_AGENT_PID"  # set by `ddptrain launch`: its preloaded workers' parent is the fork server
GRACE_ENV = "DDPTRAIN_STOP_GRACE_S"
DEFAULT_GRACE_S = 30.0  # torchrun's shutdown timeout
POLL_S = 0.5
BACKSTOP_S = 10  # after the grace: SIGALRM (default action: end the process) if the hard exit did not run


def stop_grace_s(environ: dict[str, str] | None = None) -> float:
    """Seconds a worker whose agent died gets to stop before it exits hard (GRACE_ENV, else 30)."""
    raw = (environ if environ is not None else os.environ).get(GRACE_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_GRACE_S
    return value if math.isfinite(value) and value >= 0 else DEFAULT_GRACE_S


def _proc_stat(pid: int) -> tuple[str, int, str] | None:
    """(state, parent pid, start time) of a process from /proc; None when it is gone or there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1]), fields[19]
    except (OSError, IndexError, ValueError):
        return None


def _agent_pid(parent: int) -> int:
    """The agent: AGENT_PID_ENV when it is this process's parent or grandparent (the fork server's
    parent), else the parent (a stale variable inherited from elsewhere names neither)."""
    named = os.environ.get(AGENT_PID_ENV, "")
    if named.isdigit() and int(named) != parent:
        grandparent = _proc_stat(parent)
        if grandparent is not None and grandparent[1] == int(named):
            return int(named)
    return parent


class AgentWatch:
    """Watches the agent that started this worker; see the module docstring."""

    def __init__(self, grace_s: float, poll_s: float = POLL_S) -> None:
        self.parent = os.getppid()
        self.agent = _agent_pid(self.parent)
        first = _proc_stat(self.agent)
        self._agent_start = first[2] if first is not None else None
        self.grace_s = grace_s
        self.poll_s = poll_s
        self._before_exit: list[Callable[[], None]] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def under_agent(cls) -> AgentWatch | None:
        """A started watch when this process is a worker of torchrun's agent; None for a plain process."""
        if not os.environ.get(AGENT_ENV):
            return None
        return cls(stop_grace_s()).start()

    def start(self) -> AgentWatch:
        """Start the watching thread."""
        self._thread = threading.Thread(target=self._watch, name="ddptrain-agent-watch", daemon=True)
        self._thread.start()
        return self

    def before_hard_exit(self, action: Callable[[], None]) -> None:
        """Run action (e.g. releasing the run folder's lease) before a hard exit after the grace."""
        self._before_exit.append(action)

    def close(self) -> None:
        """Stop watching (the run ended on its own). A stop already begun keeps its deadline."""
        self._closed.set()

    def agent_alive(self) -> bool:
        """Whether the agent is still running (without /proc: whether the parent is still the one at start)."""
        if self.agent == self.parent and os.getppid() != self.parent:
            return False
        if self._agent_start is None:
            return True
        now = _proc_stat(self.agent)
        return now is not None and now[0] not in ("Z", "X") and now[2] == self._agent_start

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            if not self.agent_alive():
                self._agent_lost()
                return

    def _agent_lost(self) -> None:
        log.warning(
            "the agent that started this worker (pid %d) is gone: stopping as for SIGTERM (a checkpoint if "
            "the ranks still agree); exiting within %g s in any case",
            self.agent,
            self.grace_s,
        )
        if signal.getsignal(signal.SIGALRM) == signal.SIG_DFL:
            signal.alarm(math.ceil(self.grace_s) + BACKSTOP_S)  # ends the process even if this thread cannot run
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.grace_s)
        log.error("the stop did not complete within %g s of the agent's death: exiting now", self.grace_s)
        for action in self._before_exit:
            try:
                action()
            except Exception as e:  # noqa: BLE001 - exiting regardless; the lease goes stale instead
                log.warning("before exiting: %s: %s", type(e).__name__, e)
        streams.flush_standard_streams()
        os._exit(EXIT_FAILURE)


def leave_if_the_agent_dies() -> None:
    """For a forked worker whose command has returned: torch's worker wrapper then waits until the agent has read
    the return value, with the run's own watch closed. An agent killed at that moment (`kill -9` as the run ends)
    would leave the worker waiting, and holding its pipes, for ever: a daemon thread ends it instead (exit 0: the
    work was done), checking as often as the run's watch does."""
    if not os.environ.get(AGENT_ENV):
        return
    watch = AgentWatch(grace_s=0.0)

    def leave_once_lost() -> None:
        while watch.agent_alive():
            time.sleep(POLL_S)
        streams.flush_standard_streams()
        os._exit(0)

    threading.Thread(target=leave_once_lost, name="ddptrain-agent-watch-after-run", daemon=True).start()
