"""How the ranks agree on gradients and weights (the synchronization seam, base.py): every step (every_step.py)
or DiLoCo (diloco.py); config/kinds.py's SYNCS declares them."""

from ddptrain.train.sync.base import Share, Sync, build_sync

__all__ = ["Share", "Sync", "build_sync"]
