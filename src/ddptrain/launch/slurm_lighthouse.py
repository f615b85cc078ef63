"""The Lighthouse of an sbatch job in the in-place mode (`ddptrain slurm --fault-tolerance torchft`).

It runs as a job step of its own on the first node, the one running the batch script (whose loss
ends the job anyway), beside the training step (`srun --overlap`), at that node's SLURM NodeAddr
and the job's port. The script restarts it at the same address whenever it stops while the job
runs: its loss pauses every group (they keep their state and go on at the next quorum after it is
back), so it must come back where the groups look for it. The training step then runs one launch
per node, `--replica-group $SLURM_NODEID`.
"""

from __future__ import annotations

import shlex

LIGHTHOUSE_SECTION = """\
# In-place recovery: every node's ranks are one replica group; the groups meet at a Lighthouse, a job
# step of its own on the first node (the batch script's, whose loss ends the job anyway) at its SLURM
# NodeAddr, on a port derived from the job id unless fixed. Losing the Lighthouse pauses every group
# (no state is lost): this script restarts it at the same address until the job ends.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)
LIGHTHOUSE_PORT={port}
export LIGHTHOUSE="$HEAD_ADDR:$LIGHTHOUSE_PORT"
export RDZV_ENDPOINT="none, in-place: Lighthouse $LIGHTHOUSE"
keep_lighthouse() {{
    lighthouse_step=""
    trap '[ -n "$lighthouse_step" ] && kill "$lighthouse_step"; exit 0' TERM
    while :; do
        srun --nodes=1 --ntasks=1 --cpus-per-task=1 --overlap --nodelist="$HEAD_NODE" --kill-on-bad-exit=0 \\
            {python} -m ddptrain lighthouse --bind "$LIGHTHOUSE" &
        lighthouse_step=$!
        wait "$lighthouse_step"
        echo "ddptrain-slurm: the Lighthouse stopped (exit $?) at $(date -u +%FT%T.%3N%:z); restarting it on $LIGHTHOUSE"
        sleep 2 &
        lighthouse_step=$!  # a wait the TERM trap can cut short, so that the job's end is not held up
        wait "$lighthouse_step"
    done
}}
keep_lighthouse &
lighthouse_pid=$!
trap 'kill "$lighthouse_pid" 2>/dev/null' EXIT
"""


def lighthouse_section(python: str, port: str) -> str:
    """The script lines that keep the job's Lighthouse running (`port`: a number or a shell expression)."""
    return LIGHTHOUSE_SECTION.format(port=port, python=shlex.quote(python))
