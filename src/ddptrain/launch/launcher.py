"""`ddptrain launch`: start a job with the same command on every node, over torchrun's own agent.

    ddptrain launch --nnodes 2 --nproc-per-node auto --rdzv-endpoint 10.0.0.1:29500 \\
        --node-addr 10.0.0.1 -- train -c cfg.yaml          # on 10.0.0.1 (hosts the rendezvous)
    ddptrain launch --nnodes 2 --nproc-per-node auto --rdzv-endpoint 10.0.0.1:29500 \\
        --node-addr 10.0.0.2 -- train -c cfg.yaml          # on 10.0.0.2

The options (options.py) become a torchrun command line (torchrun_args.py; `--dry-run` prints it)
that torchrun's own parser and `config_from_args` turn into a LaunchConfig; the agent is torchrun's
LocalElasticAgent with production changes that torchrun's CLI cannot express (agent.py). Here the
agent runs until the job ends, and its outcome becomes the job's exit code.

Exit codes: 0 done, 1 failed (restarts used up, rendezvous failed), 2 bad input (whenever any
worker exited 2, whatever the others did), 73 the run folder's lease was taken by another run, 75
preempted and 130 interrupted (run the same command again to resume), 128+N killed by signal N
before the workers could stop cleanly.
"""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import config_from_args, get_args_parser

from ddptrain.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_USAGE, LaunchError
from ddptrain.launch.agent import Agent, QuietStops, StallGuard, describe_failure, handled_signals, make_agent, say
from ddptrain.launch.options import EXIT_OK, LaunchOptions
from ddptrain.launch.worker_start import run_worker, start_preloaded_server, use_preloaded_server
from ddptrain.train.agent_watch import AGENT_PID_ENV
from ddptrain.train.preemption import leave_without_teardown

_RESUMABLE = {EXIT_PREEMPTED: "preempted", EXIT_INTERRUPTED: "interrupted"}


def run_job(options: LaunchOptions, env: dict[str, str], argv: list[str], note: str | None) -> int:
    """Run this node's agent over the torchrun command line `argv` until the job ends; the job's exit code.

    `env` joins this process's environment (the workers inherit it); `note` is said once torchrun's
    parser has accepted the line.
    """
    os.environ.update(env)
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # what the workers watch (train/agent_watch.py)
    try:
        config, entrypoint, entry_args = config_from_args(get_args_parser().parse_args(argv))
    except (ValueError, AssertionError, RuntimeError) as e:
        raise LaunchError(f"invalid launch options: {e}") from None
    if note:
        say(note)
    if options.worker_start == "preloaded":
        config.start_method = use_preloaded_server()
        start_preloaded_server()  # before the agent starts its threads (rendezvous, stall guard)
        entrypoint, entry_args = run_worker, ["", *options.command()]
    agent = make_agent(config, entrypoint, entry_args, options.exit_barrier_timeout)
    QuietStops().install()
    StallGuard(agent).start()
    shutdown_rdzv = True
    try:
        result = agent.run()
    except SignalException as e:
        # Keep the rendezvous open (as torchrun does): the other nodes may still re-form without us.
        shutdown_rdzv = False
        return _stopped_by_signal(agent, agent.stop_signal or e.sigval, options)
    except RendezvousError as e:
        if exit_code_for(list(agent.exit_codes.values())) == EXIT_PREEMPTED:
            return options.preempted_exit_code  # the host node left first after the same coordinated stop
        say(f"rendezvous failed: {type(e).__name__}: {str(e) or 'the nodes did not all join in time'}")
        return EXIT_FAILURE
    finally:
        if shutdown_rdzv:
            try:
                agent.get_worker_group().spec.rdzv_handler.shutdown()
            except Exception as e:  # the host node (and its store) may already be gone
                say(f"note: could not close the rendezvous ({type(e).__name__})")
    return _finished(agent, result, options)


def _finished(agent: Agent, result: RunResult, options: LaunchOptions) -> int:
    """The job's exit code once the agent's run returned, said in one line unless it succeeded."""
    if result.state == WorkerState.SUCCEEDED:
        return EXIT_OK
    code = exit_code_for([f.exitcode for f in result.failures.values()])
    if code in _RESUMABLE:
        say(f"{_RESUMABLE[code]}: the workers committed a checkpoint. Run the same command again to resume.")
        return _resumable_exit(code, options)
    if code == EXIT_USAGE:
        say("bad input (a worker exited 2; not restarted): see its error above")
    elif code == EXIT_LEASE_LOST:
        say(f"another run took the run folder's lease (a worker exited {code}; not restarted): see its error above")
    else:
        allowed = agent.get_worker_group().spec.max_restarts
        say(f"job failed after {allowed} restart(s) allowed: {describe_failure(result.failures)}")
    return code


def _stopped_by_signal(agent: Agent, first: signal.Signals, options: LaunchOptions) -> int:
    """The launcher's exit code after its first stop signal (`first`: a later one never renames the stop)."""
    for sig in handled_signals():  # the workers are stopped and the code decided: nothing may cut the exit
        signal.signal(sig, signal.SIG_IGN)  # short now (Python restores default handlers as it exits)
    # Nor may the interpreter's teardown: with the rendezvous left open, a native thread of torch's aborted it
    # here now and then ("terminate called without an active exception", exit -6 instead of 75).
    leave_without_teardown()
    code = exit_code_for(list(agent.exit_codes.values()))
    if code in _RESUMABLE:
        done = (
            "the workers quit at once on the Ctrl-C that followed (with or without this stop's checkpoint)"
            if agent.hurried
            else "the workers committed a checkpoint"
        )
        say(f"stopped by {first.name}; {done}. Run the same command again to resume.")
        return _resumable_exit(code, options)
    if code in (EXIT_USAGE, EXIT_LEASE_LOST):
        return code  # the worker said why, in one line
    say(f"killed by {first.name} before the workers could stop cleanly")
    return 128 + int(first)


def exit_code_for(codes: list[int]) -> int:
    """The job's exit code from its workers' codes (on this node).

    Bad input (2) wins over everything: when one rank exits 2 the agent stops the others, and
    whatever they exit with then must not turn the job into a retryable failure.
    """
    for final in (EXIT_USAGE, EXIT_LEASE_LOST, EXIT_PREEMPTED, EXIT_INTERRUPTED):
        if final in codes:
            return final
    return EXIT_OK if all(c == 0 for c in codes) else EXIT_FAILURE


def _resumable_exit(code: int, options: LaunchOptions) -> int:
    """The launcher's exit code for a coordinated stop: a preemption exits --preempted-exit-code (a scheduler's
    restart policy may key on it), a Ctrl-C keeps its own code."""
    return options.preempted_exit_code if code == EXIT_PREEMPTED else code
