"""Imported once, by the fork server of `--worker-start preloaded`, and by nothing else.

It makes the server hold what every worker needs (worker_start.import_what_workers_need: torch, torch._dynamo, and
ddptrain's run with everything it builds; imported already when the server was forked from the launcher) and
ignore the stop signals the launcher handles. A scheduler signals every process of a job (SLURM at a time limit
or `scancel`, `ip netns pids`-style kill loops); a server that died of SIGTERM would report all its running
workers as exited (code 255) and the coordinated stop of the real workers would turn into a failure. The server
still exits with the launcher (its pipe closes) and dies of SIGKILL; each worker restores the default handlers
(worker_start.run_worker).
"""

import signal

from ddptrain.launch.worker_start import SERVER_IGNORES, import_what_workers_need

import_what_workers_need()

for _sig in SERVER_IGNORES:
    signal.signal(_sig, signal.SIG_IGN)
