"""The unit tests' process settings: torch computes on one thread in each pytest worker."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> None:
    """torch computes on one thread in the process that runs the tests.

    The unit tests train tiny models in the pytest process itself. torch's default intra-op pool (one thread
    per core) makes each of `make test-unit`'s two workers spin up threads for every core, four busy threads
    on two cores: their barriers then wait on each other, and a tiny model's step takes several times longer
    than on one thread. Child processes already run with OMP_NUM_THREADS=1 (helpers.env_for_subprocess).
    A session fixture rather than an import-time call: pytest-xdist's controller loads this file too and runs
    no test, so it never imports torch.
    """
    import torch

    torch.set_num_threads(1)
