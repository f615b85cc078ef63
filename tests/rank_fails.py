"""A 2-rank job whose rank 1 fails while rank 0 waits for ever (tests/dist/test_bench_smoke.py): the job ends
only if whatever launched it ends the other ranks once one has failed."""

import threading

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise SystemExit("rank 1 gives up")
threading.Event().wait()  # not a collective: nothing but the launcher ends rank 0
