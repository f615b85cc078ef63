"""`ddptrain prepare [SOURCES...] --out DIR`: tokenize files, folders, globs or JSON Lines into token shards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain import streams
from ddptrain.checks import number_in, output_dir, text_arg
from ddptrain.cli_options import option
from ddptrain.config import MAX_TIMEOUT_S, DataConfig
from ddptrain.data.corpus import PrepareOptions, expand_sources, prepare_corpus, stdlib_sources
from ddptrain.errors import ConfigError

_HOW = PrepareOptions()  # the library's defaults are the command's


@dataclass(frozen=True)
class PrepareCommandOptions:
    """What `ddptrain prepare` reads from its command line (the corpus library's PrepareOptions, plus where from and to)."""

    sources: tuple[str, ...] = option(
        (),
        "files, folders or globs (default: the Python standard library's sources)",
        positional=True,
        repeat=True,
    )
    out: str = option(DataConfig.model_fields["dir"].default, "output folder")
    val_fraction: float = option(DataConfig.model_fields["val_fraction"].default, None)
    tokenizer: str = option(
        _HOW.tokenizer,
        "{default} (default), a tokenizer.json (or its folder), or train:VOCAB to train a byte-level BPE",
    )
    text_field: str = option(
        _HOW.text_field, "field (.jsonl) or column (.parquet, .arrow, saved datasets) holding the text"
    )
    workers: int = option(_HOW.workers, "tokenizing processes (default: one per core)", show_default=False)
    wait: float = option(_HOW.wait_s, "seconds to wait for another prepare of --out (default {default:g})")
    force: bool = option(
        _HOW.force,
        "prepare even when --out holds files no prepare wrote (without it: exit 2 naming them); files "
        "named like prepare's output (meta.json, tokenizer.json, shards) are then replaced, others left alone",
    )
    shard_tokens: int = option(_HOW.shard_tokens, "tokens per shard file (default {default:,})")
    sft: str | None = option(
        _HOW.sft,
        "instruction records in .jsonl files: PROMPT,COMPLETION (two field names) or MESSAGES (one field of "
        "chat messages); the loss is then on the answers only (a mask beside the tokens)",
        metavar="FIELDS",
    )


def prepare(options: PrepareCommandOptions) -> int:
    """Tokenize files/globs/JSON Lines into token shards (default: the Python standard library, as bytes)."""
    if options.shard_tokens < 1 or options.workers < 0:
        raise ConfigError("--shard-tokens must be >= 1 and --workers >= 0")
    number_in("--wait", options.wait, 0.0, MAX_TIMEOUT_S)
    number_in("--val-fraction", options.val_fraction, 0.0, 0.5, low_open=True)
    output_dir("--out", Path(options.out))
    for source in options.sources:
        text_arg("a source", source)
    files = expand_sources(list(options.sources)) if options.sources else stdlib_sources()
    how = PrepareOptions(
        options.tokenizer,
        options.text_field,
        options.workers,
        options.shard_tokens,
        wait_s=options.wait,
        force=options.force,
        sft=options.sft,
    )
    # say: "waiting for ..." lines while another prepare of the same folder works
    info = prepare_corpus(files, Path(options.out), options.val_fraction, how, say=streams.say)
    made = "reused the corpus another prepare made from the same" if info.reused else "prepared"
    print(
        f"{made} {info.files} files ({info.documents:,} documents) into {info.out_dir}: "
        f"{info.train_tokens:,} train tokens, {info.val_tokens:,} val tokens, vocab {info.vocab_size:,}, "
        f"{info.shards} shards"
    )
    return 0
