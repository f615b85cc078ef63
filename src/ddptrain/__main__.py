"""`python -m ddptrain` is the `ddptrain` command (and what `ddptrain launch` runs on each worker)."""

import os
import traceback

from torch.distributed.elastic.multiprocessing.errors import record

from ddptrain import streams
from ddptrain.cli import exit_with, main


def _run() -> int:
    # record(): under torchrun, an uncaught exception is written to the agent's error file, so
    # the launcher can name the root cause of a failed job.
    try:
        return record(main)() or 0
    except Exception:
        # A failed rank may still hold connections to peers that are frozen or unreachable, and
        # the interpreter's teardown of those blocked for minutes here: report and leave now.
        streams.say(traceback.format_exc())
        streams.flush_standard_streams()
        os._exit(1)


exit_with(_run())
