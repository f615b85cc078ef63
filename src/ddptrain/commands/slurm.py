"""`ddptrain slurm`: write the sbatch script for a config (ddptrain/launch/slurm.py) and submit it with --submit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain.checks import output_file
from ddptrain.cli_options import option
from ddptrain.launch.slurm import SlurmJob, submit, write_script


@dataclass(frozen=True)
class SlurmOptions(SlurmJob):
    """The job, and where its script goes."""

    out: str | None = option(None, "script path (default run.dir/slurm/<submission>/job.sbatch)")
    submit: bool = option(False, "submit with sbatch after writing")


def slurm(options: SlurmOptions) -> int:
    """Write the sbatch script for a config (and submit it with --submit)."""
    cfg = options.load_config()
    out = output_file("--out", Path(options.out)) if options.out else None
    script = write_script(cfg, options, out)
    print(f"wrote {script}")
    if options.submit:
        print(f"submitted job {submit(script)}")
    return 0
