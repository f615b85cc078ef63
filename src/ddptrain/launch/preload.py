"""Imported once, by the fork server of `--worker-start preloaded`, and by nothing else.

It makes the server hold what every worker needs (torch, torch._dynamo, and ddptrain's run with
everything it builds; the CLI and its commands, a layer above launch/, are small and load in the worker) and
ignore the stop signals the launcher handles. A scheduler signals every process of a job (SLURM
at a time limit or `scancel`, `ip netns pids`-style kill loops); a server that died of SIGTERM
would report all its running workers as exited (code 255) and the coordinated stop of the real
workers would turn into a failure. The server still exits with the launcher (its pipe closes)
and dies of SIGKILL; each worker restores the default handlers (worker_start.run_worker).
"""

import signal

import torch._dynamo  # noqa: F401  (imported by the first optimizer: ~3 s saved per worker start)

import ddptrain.run  # noqa: F401  (and with it torch and every ddptrain module a training worker uses)

SERVER_IGNORES = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)

for _sig in SERVER_IGNORES:
    signal.signal(_sig, signal.SIG_IGN)
