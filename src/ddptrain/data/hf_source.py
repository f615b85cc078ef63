"""data.hf: Hugging Face-format data on local disk (Parquet, Arrow, JSON Lines, folders `datasets` saved),
prepared on first use into data.dir, then trained on as a prepared corpus.

Nothing is downloaded. The files are read by ddptrain's own prepare (data/tables.py: row groups and
record batches, only the text column, in worker processes, bounded memory), not loaded through
`datasets.load_dataset`, which would first copy them into its Arrow cache. A corpus in data.dir is
reused only when it was prepared from the same files (path, size, modification time), text field,
tokenizer and validation fraction (its recipe); otherwise it is prepared again. What a run and its
resume compare is the corpus's content hash (the shards' SHA-256s), as for any prepared corpus.
"""

from __future__ import annotations

from pathlib import Path

from ddptrain.config import DataConfig
from ddptrain.data.corpus import PrepareOptions, corpus_ready, expand_sources
from ddptrain.data.prepare import recipe_of
from ddptrain.data.publish import read_recipe
from ddptrain.data.source import CorpusPreparedOnFirstUse, LiveData
from ddptrain.data.tokenizer import TokenizerSpec
from ddptrain.errors import DataError


class HFData(CorpusPreparedOnFirstUse):
    """data.hf's files, prepared into data.dir."""

    kind = "hf"
    key = "data.hf"
    what = "the data.hf files"

    @classmethod
    def claims(cls, cfg: DataConfig, live: LiveData) -> bool:
        """data.hf is set."""
        return cfg.hf is not None

    def inputs(self) -> list[Path]:
        """The files data.hf names: a saved DatasetDict's folder is read at its `split`."""
        hf = self.cfg.hf
        assert hf is not None  # claims() checked it
        patterns = []
        for entry in hf.files:
            if (Path(entry) / "dataset_dict.json").is_file():
                if hf.split is None:
                    raise DataError(f"data.hf: {entry} holds several splits: set data.hf.split (e.g. train)")
                entry = str(Path(entry) / hf.split)
            patterns.append(entry)
        return expand_sources(patterns)

    def options(self, wait_s: float) -> PrepareOptions:
        """The tokenizer and text field data.hf names."""
        hf = self.cfg.hf
        assert hf is not None
        return PrepareOptions(tokenizer=hf.tokenizer, text_field=hf.text_field, wait_s=wait_s)

    def ready(self, folder: Path) -> bool:
        """A complete corpus prepared from these very files and options."""
        if not corpus_ready(folder):
            return False
        options = self.options(0.0)
        recipe = recipe_of(self.inputs(), self.cfg.val_fraction, options, TokenizerSpec.parse(options.tokenizer))
        return read_recipe(folder) == recipe

    def describe(self) -> str:
        """The files and, where prepared, the folder."""
        hf = self.cfg.hf
        assert hf is not None
        return f"{', '.join(hf.files)} -> {self.cfg.dir}"
