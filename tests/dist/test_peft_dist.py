"""LoRA (model.peft) under torchrun, 2 ranks: a tiny Llama fine-tuned from a saved transformers folder.

The checkpoints hold the adapters and their optimizer state only; a SIGKILLed run resumes bit-exactly;
the merged export loads in transformers and the adapter export in peft, both with the trained model's
logits; FSDP2 trains as DDP does; a resume against another base is refused; a live model from the
Python API trains adapters too.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    env_for_subprocess,
    final_model_state,
    folder_bytes,
    kill_job,
    read_metrics,
    run_ddptrain,
    start_ddptrain,
)

pytestmark = pytest.mark.dist
pytest.importorskip("peft", reason="needs the peft extra")

STEPS = 8
LLAMA = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
PEFT = "model.peft={r: 4, alpha: 8, dropout: 0.1, target_modules: [q_proj, v_proj]}"  # dropout: RNG state matters
ADAPTERS = 2 * 2 * 2  # layers x (q_proj, v_proj) x (lora_A, lora_B)


def save_base(folder: Path, seed: int) -> Path:
    """A 'released' model: a tiny Llama from a config, saved as transformers saves it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**LLAMA)).save_pretrained(str(folder))
    return folder


def lora(corpus: Path, base: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "train",
        f"model.hf.config={base}",
        f"model.init_from={base}",
        PEFT,
        f"data.dir={corpus}",
        f"run.dir={run_dir}",
        "model.block_size=32",
        "data.micro_batch_size=4",
        "train.global_batch_size=16",
        f"train.max_steps={STEPS}",
        "train.warmup_steps=2",
        "train.eval_every=0",
        "log.every_steps=1",
        "ckpt.every_steps=3",
        *extra,
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_base(tmp_path_factory.mktemp("base"), seed=0)


@pytest.fixture(scope="module")
def ddp_run(corpus_dir: Path, base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("ddp") / "run"
    r = run_ddptrain(lora(corpus_dir, base, run_dir), nproc=2, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("step-*"))


def assert_adapters_only(run_dir: Path, base: Path) -> None:
    """Every checkpoint: the adapters, AdamW state for them alone, and the base's SHA-256 in its identity."""
    from ddptrain.checkpoint import verify_checkpoint
    from ddptrain.config import HFModelConfig
    from ddptrain.models.hf import build_hf_model
    from ddptrain.models.peft import state_digest

    digest = state_digest(build_hf_model(HFModelConfig(pretrained=str(base)), 32).state_dict())
    for path in checkpoints(run_dir):
        ckpt = verify_checkpoint(path)
        model = ckpt.state("model")
        assert len(model) == ADAPTERS and all(".lora_A." in k or ".lora_B." in k for k in model), sorted(model)
        if ckpt.writer.name == "dcp":  # FSDP: the optimizer state is read into a live run only; its keys say whose
            keys = [k for k in ckpt.writer.metadata(ckpt).state_dict_metadata if k.startswith("optimizer.state.")]
            assert len(keys) == 3 * ADAPTERS and all("lora_" in k for k in keys), keys  # step, exp_avg, exp_avg_sq
        else:
            moments = ckpt.state("optimizer")["state"].values()
            assert sorted(m["exp_avg"].numel() for m in moments) == sorted(t.numel() for t in model.values())
        assert json.loads((path / "manifest.json").read_text())["identity"]["base_sha256"] == digest


def losses(run_dir: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for m in read_metrics(run_dir):
        out.setdefault(m["step"], []).append(m["loss"])
    return out


def kill_after_a_checkpoint(args: list[str], run_dir: Path) -> None:
    """Run args on 2 ranks and SIGKILL every process once a step after the first checkpoint was logged."""
    proc = start_ddptrain(args, nproc=2, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        if (run_dir / "metrics.jsonl").is_file() and any(m["step"] >= 4 for m in read_metrics(run_dir)):
            break
        time.sleep(0.01)
    kill_job(proc.pid)
    proc.wait(timeout=30)


def exported_logits(run_dir: Path, base: Path, out: Path) -> dict[str, torch.Tensor]:
    """Logits of the trained adapter model, of the merged export in transformers, of the adapter export in peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ddptrain.checkpoint import verify_checkpoint
    from ddptrain.commands.evaluate import model_of

    for fmt in ("hf", "peft"):
        r = run_ddptrain(["export", str(run_dir), "--format", fmt, "--out", str(out / fmt)])
        assert r.returncode == 0, r.stderr[-3000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (out / "peft").iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(str(out / "hf")).eval()
    assert not any("lora" in k for k in merged.state_dict())  # a plain transformers model: no peft needed
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(out / "peft")).eval()
    _, ours = model_of(verify_checkpoint(checkpoints(run_dir)[-1]))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return {
            "ours": ours.logits(ids),
            "merged": merged(input_ids=ids).logits,
            "peft": adapted(input_ids=ids).logits,
            "base": AutoModelForCausalLM.from_pretrained(str(base))(input_ids=ids).logits,
        }


@pytest.mark.timeout(480)
def test_lora_checkpoints_resume_bit_exact_and_export_merged_and_as_adapters(
    corpus_dir: Path, base: Path, ddp_run: Path, tmp_path: Path
) -> None:
    assert [c.name for c in checkpoints(ddp_run)] == ["step-00000003", "step-00000006", "step-00000008"]
    assert_adapters_only(ddp_run, base)
    ref = losses(ddp_run)
    assert ref[STEPS][0] < ref[1][0]  # the adapters learn

    killed = tmp_path / "killed"
    kill_after_a_checkpoint(lora(corpus_dir, base, killed), killed)
    assert (killed / "checkpoints" / "step-00000003").is_dir()
    assert max(m["step"] for m in read_metrics(killed)) < STEPS  # killed mid-run: the rerun has steps to redo
    r = run_ddptrain(lora(corpus_dir, base, killed), nproc=2, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout
    got = losses(killed)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert all(v == ref[step][0] for step, values in got.items() for v in values), (got, ref)
    a, b = final_model_state(ddp_run), final_model_state(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    logits = exported_logits(killed, base, tmp_path / "export")
    torch.testing.assert_close(logits["merged"], logits["ours"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits["peft"], logits["ours"], rtol=0, atol=1e-5)
    assert not torch.allclose(logits["base"], logits["ours"], atol=1e-4)  # the adapters changed the model

    other = save_base(tmp_path / "other-base", seed=1)  # same config, other weights
    before = folder_bytes(killed)
    refused = run_ddptrain(lora(corpus_dir, other, killed, f"train.max_steps={STEPS + 2}"), timeout=120)
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in refused.stderr.splitlines() if line.startswith("ddptrain train: error:")]
    assert len(lines) == 1 and "changed the base weights (SHA-256" in lines[0], refused.stderr[-3000:]
    assert folder_bytes(killed) == before


@pytest.mark.timeout(120)
def test_generate_samples_from_a_lora_run_as_its_adapted_model(
    ddp_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddptrain.checkpoint import verify_checkpoint
    from ddptrain.cli import main
    from ddptrain.commands.evaluate import model_of

    assert main(["generate", str(ddp_run), "--prompt", "def f(", "--max-new-tokens", "6", "--top-k", "1"]) == 0
    text = capsys.readouterr().out.removesuffix("\n")
    _, adapted = model_of(verify_checkpoint(checkpoints(ddp_run)[-1]))  # the adapters unmerged: another path
    ids = torch.tensor([list(b"def f(")])
    with torch.no_grad():
        for _ in range(6):  # greedy: top-k 1 samples the likeliest token
            ids = torch.cat([ids, adapted.logits(ids)[:, -1:].argmax(-1)], dim=1)
    assert text == bytes(ids[0].tolist()).decode("utf-8", errors="replace")


@pytest.mark.timeout(240)
def test_lora_under_fsdp_trains_as_under_ddp(corpus_dir: Path, base: Path, ddp_run: Path, tmp_path: Path) -> None:
    fsdp = tmp_path / "fsdp"
    r = run_ddptrain(lora(corpus_dir, base, fsdp, "dist.strategy=fsdp"), nproc=2, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((checkpoints(fsdp)[-1] / "manifest.json").read_text())["writer"] == "dcp"
    assert_adapters_only(fsdp, base)
    a, b = read_metrics(ddp_run), read_metrics(fsdp)
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
    x, y = final_model_state(ddp_run), final_model_state(fsdp)
    assert x.keys() == y.keys()
    for name in x:
        torch.testing.assert_close(y[name], x[name], rtol=1e-5, atol=1e-5, msg=name)


LIVE = """
import sys, torch, ddptrain
from ddptrain.config import ModelConfig
from ddptrain.models.gpt import GPT
from ddptrain.checkpoint import verify_checkpoint
shape = dict(n_layer=1, n_head=2, n_embd=32, block_size=32)
config = {"model": {**shape, "peft": {"r": 2, "target_modules": ["qkv", "proj"]}}, "data": {"dir": sys.argv[1],
          "micro_batch_size": 4}, "run": {"dir": sys.argv[2]},
          "train": {"global_batch_size": 8, "max_steps": 3, "warmup_steps": 1, "eval_every": 0}}
torch.manual_seed(0)
result = ddptrain.train(config, model=GPT(ModelConfig(**shape)))
state = verify_checkpoint(sorted((result.run_dir / "checkpoints").glob("step-*"))[-1]).state("model")
print(result.status, sorted(state))
"""


@pytest.mark.timeout(120)
def test_a_live_model_from_the_python_api_trains_adapters(corpus_dir: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", LIVE, str(corpus_dir), str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env_for_subprocess())
    assert done.returncode == 0, done.stderr[-3000:]
    status, names = done.stdout.splitlines()[-1].split(" ", 1)
    assert status == "completed"
    assert names.count("lora_A") == names.count("lora_B") == 2 and "wte" not in names, names
