"""`ddptrain ARGS` with data.dir chosen by LOCAL_RANK from DATA_DIRS (dir0:dir1:...).

A wrapper as a user might write one (nodes with different default corpora end up the same way):
the ranks are handed different data, which the start-up data check must refuse.
"""

import os
import sys

from ddptrain.cli import main

dirs = os.environ["DATA_DIRS"].split(os.pathsep)
sys.exit(main([*sys.argv[1:], f"data.dir={dirs[int(os.environ['LOCAL_RANK'])]}"]))
