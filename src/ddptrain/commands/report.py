"""`ddptrain report RUN_DIR [--out DIR]`: plots and a text summary of a run, finished, running or crashed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain.checks import existing_dir, output_dir
from ddptrain.cli_options import REQUIRED, option


@dataclass(frozen=True)
class ReportOptions:
    """What `ddptrain report` reads from its command line."""

    run_dir: str = option(REQUIRED, None, positional=True)
    out: str | None = option(None, "output folder (default RUN_DIR/report)")


def report(options: ReportOptions) -> int:
    """Write the plots and summary into run_dir/report (or --out) and print the summary."""
    from ddptrain.review.report import report as write_report  # matplotlib loads only for this command

    run_dir = existing_dir("run folder", Path(options.run_dir))
    summary, files = write_report(run_dir, output_dir("--out", Path(options.out)) if options.out else None)
    print(summary)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0
