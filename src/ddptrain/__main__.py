"""`python -m ddptrain` is the `ddptrain` command (and what `ddptrain launch` runs on each worker)."""

from torch.distributed.elastic.multiprocessing.errors import record

from ddptrain.cli import main

# record(): under torchrun, an uncaught exception is written to the agent's error file, so the
# launcher can name the root cause of a failed job.
raise SystemExit(record(main)())
