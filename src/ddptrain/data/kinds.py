"""Which kind of data a data section describes: the registry of data sources (data/source.py).

A new kind of data is its own DataSource subclass and one line in KINDS.
"""

from __future__ import annotations

from ddptrain.config import DataConfig
from ddptrain.data.hf_source import HFData
from ddptrain.data.mixture_source import Mixture
from ddptrain.data.source import DataSource, DefaultCorpus, LiveData, LiveDatasets, PreparedCorpus, UserFactory

# The kinds, asked in this order; the first that claims the config is its data.
KINDS: tuple[type[DataSource], ...] = (LiveDatasets, Mixture, UserFactory, HFData, DefaultCorpus, PreparedCorpus)


def data_source(cfg: DataConfig, live: LiveData = None) -> DataSource:
    """The source of the data cfg describes (with `live`, what ddptrain.train() was given, if anything)."""
    kind = next(k for k in KINDS if k.claims(cfg, live))
    return kind.build(cfg, live, data_source)
