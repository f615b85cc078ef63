"""`ddptrain ARGS` plus the arguments PER_RANK_ARGS (a JSON list of lists) gives this LOCAL_RANK.

A wrapper as a user might write one (nodes with different config files end up the same way): the
ranks are handed different settings, which the start-up data check must refuse.
"""

import json
import os
import sys

from ddptrain.cli import main

extra = json.loads(os.environ["PER_RANK_ARGS"])[int(os.environ["LOCAL_RANK"])]
sys.exit(main([*sys.argv[1:], *extra]))
