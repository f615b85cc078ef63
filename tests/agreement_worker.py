"""Run under torchrun: rank 1 alone requests a stop from its 4th poll on; every rank records when it agrees.

Both ways the agreement can travel are exercised: on the gloo training group, and on a gloo group of
its own (what a NCCL run gets). Rank r writes OUT/agreement-rank<r>.json: {"shared": N, "own": N}.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from ddptrain.config import DistConfig
from ddptrain.dist import close_distributed, init_distributed
from ddptrain.train.agreement import StopAgreement


def main() -> None:
    """Poll 8 times per group; note the first poll that returns True."""
    out = Path(sys.argv[1])
    ctx = init_distributed(DistConfig(timeout_s=30))
    agreed_at: dict[str, int | None] = {}
    for label, context in (("shared", ctx), ("own", replace(ctx, backend="nccl"))):
        agreement = StopAgreement(context, timeout_s=30)
        agreement.setup()
        agreed_at[label] = None
        for poll in range(1, 9):
            if agreement.poll(requested=ctx.rank == 1 and poll >= 4) and agreed_at[label] is None:
                agreed_at[label] = poll
        agreement.wait()
    (out / f"agreement-rank{ctx.rank}.json").write_text(json.dumps(agreed_at))
    close_distributed(ctx)


if __name__ == "__main__":
    main()
