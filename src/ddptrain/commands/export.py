"""`ddptrain export RUN_DIR --out PATH [--format hf|peft]`: a checkpoint's model as safetensors, a transformers
folder, or (a model.peft run) a peft adapter folder."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddptrain import streams
from ddptrain.checkpoint.store import select_checkpoint
from ddptrain.checks import creatable_file, existing_dir, number_in, output_dir
from ddptrain.cli_options import REQUIRED, option
from ddptrain.config import Config, saved_config
from ddptrain.errors import ConfigError


@dataclass(frozen=True)
class ExportOptions:
    """What `ddptrain export` reads from its command line."""

    run_dir: str = option(REQUIRED, None, positional=True)
    out: str = option(REQUIRED, "output .safetensors file (config beside it as .json), or a folder with --format hf")
    step: int | None = option(None, "checkpoint step (default: the newest good one)")
    format: str = option(
        "safetensors",
        "hf: a folder transformers.AutoModelForCausalLM.from_pretrained loads, with the tokenizer (a model.peft run: "
        "adapters merged); peft: the adapters as a folder peft.PeftModel.from_pretrained loads onto the base",
        choices=("safetensors", "hf", "peft"),
        show_default=False,
    )
    data_dir: str | None = option(
        None,
        "--format hf or peft: the prepared corpus whose tokenizer (and chat template) to include "
        "(default: the run's data.dir)",
    )


def export(options: ExportOptions) -> int:
    """Write a checkpoint's model: plain safetensors (config beside it) or a transformers folder (--format hf)."""
    existing_dir("run folder", Path(options.run_dir))
    if options.step is not None:
        number_in("--step", options.step, 0, 10**15)
    if options.data_dir is not None and options.format == "safetensors":
        raise ConfigError("--data-dir gives --format hf and peft their tokenizer; --format safetensors writes none")
    if options.format in ("hf", "peft"):
        return _export_folder(options)
    from ddptrain.checkpoint.export import export_model

    out_path = creatable_file("--out", Path(options.out))
    if out_path.suffix == ".json":
        raise ConfigError(f"--out {options.out}: the model config goes to a .json beside the weights; use .safetensors")
    path, count = export_model(Path(options.run_dir), out_path, options.step, streams.say)
    print(f"exported {path.name} ({count} tensors) to {out_path} and {out_path.with_suffix('.json')}")
    return 0


def _export_folder(options: ExportOptions) -> int:
    from ddptrain.checkpoint.export import refuse_links_inside, staged_output
    from ddptrain.checkpoint.export_hf import export_hf
    from ddptrain.commands.evaluate import model_of, tokenizer_dir
    from ddptrain.models.peft import merge_adapters, save_adapters

    run_dir = Path(options.run_dir)
    out_dir = output_dir("--out", Path(options.out))
    ckpt = select_checkpoint(run_dir, options.step, streams.say)
    saved = saved_config(ckpt.manifest.config)
    if saved.model.live is not None and saved.model.target is None:
        raise ConfigError(
            f"model.live={saved.model.live!r}: --format hf exports the built-in GPT and model.hf models, "
            "not a live nn.Module passed to ddptrain.train(); export without --format hf writes its weights"
        )
    if options.format == "peft" and saved.model.peft is None:
        raise ConfigError(f"--format peft: {ckpt.path.name} holds a full model (the run had no model.peft)")
    cfg, model = model_of(ckpt)
    refuse_links_inside(run_dir, out_dir)
    with staged_output(out_dir) as work:  # complete or absent: a failed export leaves nothing behind
        if options.format == "peft":
            what = f"{save_adapters(model, work)}; {_peft_tokenizer(cfg, options.data_dir, work)}"
        else:
            what = export_hf(merge_adapters(model), cfg.model, tokenizer_dir(cfg, options.data_dir), work)
    print(f"exported {ckpt.path.name} to {options.out}: {what}")
    return 0


def _peft_tokenizer(cfg: Config, data_dir: str | None, work: Path) -> str:
    """The data's tokenizer (with chat data's template) beside the adapters, as `--format hf` writes it; a line
    saying what was written. Adapters need none, so a run whose tokenizer ddptrain cannot know gets none."""
    from ddptrain.checkpoint.export_hf import write_tokenizer
    from ddptrain.commands.evaluate import tokenizer_dir

    try:
        folder = tokenizer_dir(cfg, data_dir)
    except ConfigError as e:
        return f"no tokenizer ({e})"
    return write_tokenizer(folder, work) if folder is not None else "no tokenizer (data.target run)"
