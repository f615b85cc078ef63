"""`ddptrain launch`: this node's share of a (multi-node) job, over torchrun's agent (ddptrain/launch/)."""

from __future__ import annotations

import os
import shlex

from ddptrain.errors import EXIT_FAILURE
from ddptrain.etcd_endpoints import parse_endpoints, require_client
from ddptrain.launch.agent import say
from ddptrain.launch.etcd_rdzv import no_healthy_member
from ddptrain.launch.ft_launch import check_ft_options, launch_in_place
from ddptrain.launch.launcher import run_job
from ddptrain.launch.options import EXIT_OK, LaunchOptions
from ddptrain.launch.torch_support import check_torch
from ddptrain.launch.torchrun_args import beyond_torchrun, pet_conflicts, torchrun_command, workers_here


def launch(options: LaunchOptions) -> int:
    """Run this node's agent until the job ends (or print its torchrun line with dry_run); the job's exit code.

    Bad options raise LaunchError (exit 2, one line) before anything starts.
    """
    check_torch()
    options.check_exit_code()
    check_ft_options(options)
    # torchrun reads every PET_<FLAG> as a flag: stale ones join old jobs, so the command line decides.
    inherited = {k: os.environ.pop(k) for k in sorted(os.environ) if k.startswith("PET_")}
    if options.fault_tolerance is not None:
        return launch_in_place(options)  # a scheduler's PET_NNODES counts the groups there: nothing to warn of
    env, argv = torchrun_command(options)
    note = workers_here(options.nproc_per_node)[1]  # said once the launch goes ahead: a refusal is one line
    if options.dry_run:
        if note:
            say(note)
        print(shlex.join([*(f"{k}={v}" for k, v in env.items()), "torchrun", *argv]))
        print(beyond_torchrun(options, env))
        return EXIT_OK
    for line in pet_conflicts(options, inherited):
        say(line)
    if options.etcd:
        require_client()
        members = parse_endpoints("--rdzv-endpoint", options.rdzv_endpoint or "")
        why = no_healthy_member(members, options.rdzv_timeout)
        if why is not None:
            say(f"rendezvous failed: {why}")
            return EXIT_FAILURE
    return run_job(options, env, argv, note)
