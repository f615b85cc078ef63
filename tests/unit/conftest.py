"""The unit tests' process settings: torch computes on one thread in each pytest worker."""

from __future__ import annotations

import torch

# The unit tests train tiny models in the pytest process itself. torch's default intra-op pool (one thread
# per core) makes each of `make test-unit`'s two workers spin up threads for every core, four busy threads
# on two cores: their barriers then wait on each other, and a tiny model's step takes several times longer
# than on one thread. Child processes already run with OMP_NUM_THREADS=1 (helpers.env_for_subprocess).
torch.set_num_threads(1)
