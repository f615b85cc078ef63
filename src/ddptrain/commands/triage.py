"""`ddptrain triage RUN_DIR`: one verdict from the stacks a hang left in RUN_DIR/stacks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain.cli_options import REQUIRED, option
from ddptrain.review.verdict import verdict
from ddptrain.run_folder import stacks_dir


@dataclass(frozen=True)
class TriageOptions:
    """What `ddptrain triage` reads from its command line."""

    run_dir: str = option(REQUIRED, None, positional=True)


def triage(options: TriageOptions) -> int:
    """Print the verdict of the hang recorded in run_dir/stacks."""
    print(verdict(stacks_dir(Path(options.run_dir))))
    return 0
