"""The docs match reality: every key is documented, and every command shown is run or skipped with a reason.

`test_every_documented_command_is_covered` collects each command line from the code blocks of
README.md and docs/*.md and requires a rule for it below: a check that runs it here and compares
its output with what the docs show (exactly, or line by line in shape: numbers may differ), or a
reason it cannot run in the unit tests. A new command in the docs fails the test until it has one.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from helpers import TINY

from ddptrain.cli import main
from ddptrain.config import Config, describe_fields, load_config
from ddptrain.data.corpus import prepare_corpus
from ddptrain.models.gpt import GPT
from ddptrain.train.schedules import config_plan

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "configuration.md"
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_PROGRAMS = ("ddptrain", "make", "torchrun", "python", "python3", "pip", "kubectl", "sbatch", "scancel", "tensorboard")
_NUMBER = re.compile(r"\d[\d,.:]*(e[-+]\d+)?")


def test_every_config_key_is_documented() -> None:
    """The reference lists exactly what `--help-config` prints: every key, and every choice of a registry."""
    text = DOC.read_text()
    start = text.index("```\n", text.index("This list is what `ddptrain train --help-config` prints")) + 4
    assert text[start : text.index("\n```", start)] == describe_fields()


# ---- collecting the commands ------------------------------------------------------------------


def code_blocks(path: Path) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block and every indented block of a markdown file."""
    blocks: list[tuple[str, list[str]]] = []
    fence: tuple[str, list[str]] | None = None
    indented: list[str] = []
    previous = ""
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence = (line[3:].strip(), [])
            else:
                blocks.append(fence)
                fence = None
            continue
        if fence is not None:
            fence[1].append(line)
        elif (
            line.startswith("    ")
            and (indented or not previous.strip())
            and not line.lstrip().startswith(("*", "-", "|"))
        ):
            indented.append(line[4:])
        elif indented:
            blocks.append(("", indented))
            indented = []
        previous = line
    return blocks


def _is_command(line: str) -> bool:
    word = line.split(" ", 1)[0]
    name = word.rsplit("/", 1)[-1]
    output = re.match(r"^\S+( \S+)?(:| \()|^\S+ {2,}|^\S+ = ", line)  # "ddptrain train: error", "python   3.11"
    return (name in _PROGRAMS or word.startswith("PYTHONPATH=")) and not output


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for every command line in a plain or console code block, continuations joined."""
    found = []
    for path in DOC_FILES:
        for lang, lines in code_blocks(path):
            if lang not in ("", "sh", "console", "shell"):
                continue  # yaml, python, bash scripts: file contents, not commands
            prompted = any(line.startswith("$ ") for line in lines)
            joined, pending = [], ""
            for line in lines:
                text = line[2:] if prompted and line.startswith("$ ") else (None if prompted else line)
                if text is None:
                    continue
                text = pending + text.strip()
                if text.endswith("\\"):
                    pending = text[:-1] + " "
                    continue
                pending = ""
                text = re.sub(r"\s+#.*$", "", text).strip()
                if text and _is_command(text):
                    joined.append(text)
            found += [(path.name, command) for command in joined]
    return found


# ---- checks that run a command here ------------------------------------------------------------


def _ddptrain(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _block_after(path: Path, marker: str) -> list[str]:
    """The first fenced block after the line containing `marker`."""
    text = path.read_text()
    rest = text[text.index(marker) :]
    start = rest.index("```")
    body = rest[rest.index("\n", start) + 1 :]
    return body[: body.index("```")].splitlines()


def _shape(line: str) -> re.Pattern[str]:
    """A line with its numbers (and the padding before them) made variable."""
    literal = [re.sub(" +", " +", re.escape(p)) for p in _NUMBER.sub("\0", line).split("\0")]
    return re.compile("^" + r"\d[\d,.:]*(e[-+]\d+)?".join(literal) + "$")


def _prepare_example_data(argv: list[str], tmp: Path) -> None:
    """A tiny corpus where the example config's data.dir points: `ddptrain slurm` refuses one never prepared."""
    data_dir = load_config(argv[argv.index("-c") + 1]).data.dir
    prepare_corpus([Path(shlex.__file__)], tmp / data_dir, 0.1)


def check_generated_slurm_script(command: str, tmp: Path) -> None:
    """docs/clusters.md shows the script this command writes (paths and submission id aside)."""
    argv = shlex.split(command)[1:] + ["--python", "/mnt/shared/venvs/ddptrain/bin/python"]
    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in argv if a != "[--submit]"]
    _prepare_example_data(argv, tmp)
    rc, out, err = _ddptrain(argv, tmp)
    assert rc == 0, err
    script = Path(out.split("wrote ", 1)[1].strip())
    shown = _block_after(ROOT / "docs" / "clusters.md", "A generated script")
    submission = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
    actual = [
        submission.sub("SUB", line.replace(str(tmp.resolve()), "/mnt/shared/gpt"))
        for line in script.read_text().splitlines()
    ]
    assert actual == [submission.sub("SUB", line) for line in shown]


def check_generated_manifest(command: str, tmp: Path) -> None:
    """docs/clusters.md shows exactly the manifest this command prints."""
    argv = [str(ROOT / a) if a.startswith("examples/") else a for a in shlex.split(command.split(" > ")[0])[1:]]
    rc, out, err = _ddptrain(argv, tmp)
    assert rc == 0, err
    assert out.splitlines() == _block_after(ROOT / "docs" / "clusters.md", "The generated manifest")


def check_runs_and_prints_documents(command: str, tmp: Path) -> None:
    """A README generator command with placeholders: it succeeds (no --submit here)."""
    argv = [
        str(ROOT / a) if a.startswith("examples/") else a
        for a in shlex.split(command.split(" > ")[0])[1:]
        if a != "--submit"
    ]
    if argv[0] == "slurm":
        _prepare_example_data(argv, tmp)
    rc, out, err = _ddptrain(argv, tmp)
    assert rc == 0, err
    if argv[0] == "k8s":
        lighthouse = ["Deployment", "Service"] if "--fault-tolerance" in argv else []
        assert [d["kind"] for d in yaml.safe_load_all(out)] == ["ConfigMap", *lighthouse, "PyTorchJob"]
    else:
        assert out.startswith("wrote ") and out.strip().endswith("job.sbatch")


def check_launch_dry_run(command: str, tmp: Path) -> None:
    """The launch line is valid: its --dry-run prints the torchrun command."""
    argv = shlex.split(command)[1:]
    for flag, value in zip(argv, argv[1:]):
        if flag in ("-c", "--config"):  # --dry-run checks the worker command: the reader's config must exist
            (tmp / value).write_text("run:\n  name: docs\n")
    argv.insert(argv.index("--"), "--dry-run")
    rc, out, err = _ddptrain(argv, tmp)
    assert rc == 0, err
    nnodes = argv[argv.index("--nnodes") + 1] if "--nnodes" in argv else "1"
    assert f" torchrun --nnodes {nnodes}" in out.splitlines()[0] and "--rdzv-endpoint" in out


def check_in_place_dry_run(command: str, tmp: Path) -> None:
    """An in-place launch line is valid: its --dry-run prints one torchrun line per replica group, each with
    the group's id and the Lighthouse the command names (or the one it starts)."""
    argv = shlex.split(command)[1:]
    (tmp / "cfg.yaml").write_text("run:\n  name: docs\n")
    argv.insert(argv.index("--"), "--dry-run")
    rc, out, err = _ddptrain(argv, tmp)
    assert rc == 0, err
    lines = [line for line in out.splitlines() if " torchrun --nnodes 1 " in line]
    lighthouse = argv[argv.index("--lighthouse") + 1] if "--lighthouse" in argv else "127.0.0.1:PORT"
    groups = int(argv[argv.index("--replica-groups") + 1]) if "--replica-groups" in argv else 1
    ids = [argv[argv.index("--replica-group") + 1]] if "--replica-group" in argv else [str(g) for g in range(groups)]
    assert len(lines) == len(ids), out
    for line, group in zip(lines, ids, strict=True):
        assert f"TORCHFT_LIGHTHOUSE=http://{lighthouse} DDPTRAIN_REPLICA_GROUP={group} torchrun" in line


def check_error_line(command: str, tmp: Path) -> None:
    """A documented error: exit 2 and exactly the line the docs show after the command."""
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        if f"$ {command}" in lines:
            expected = lines[lines.index(f"$ {command}") + 1]
            break
    if "runs/empty" in command:
        (tmp / "runs" / "empty").mkdir(parents=True)
        (tmp / "runs" / "empty" / "metrics.jsonl").write_text("")
    rc, out, err = _ddptrain(shlex.split(command)[1:], tmp)
    assert rc == 2 and err.strip() == expected


def check_help_config(command: str, tmp: Path) -> None:
    """`--help-config` prints every section the configuration reference documents."""
    rc, out, _ = _ddptrain(shlex.split(command)[1:], tmp)
    assert rc == 0 and all(f"\n{s}:" in "\n" + out for s in Config.model_fields)


def test_readme_sample_shows_what_the_default_config_determines() -> None:
    """Beyond the losses and speeds (which depend on the corpus, torch, threads and CPU: README says so), the
    sample's numbers follow from the default config: checked exactly, without training."""
    cfg = load_config()
    sample = [line for line in _block_after(ROOT / "README.md", "then trains a 0.84M") if line != "..."]
    params = sum(p.numel() for p in GPT(cfg.model).parameters()) / 1e6
    t, plan = cfg.train, config_plan(cfg)
    batch = f"global batch {t.global_batch_size} = {cfg.data.micro_batch_size} x 1 x "
    assert any(f"{batch}{t.global_batch_size // cfg.data.micro_batch_size}, {params:.2f}M" in x for x in sample)
    steps = [re.match(r"step +(\d+)/(\d+) .* lr (\S+)", x) for x in sample]
    shown = [(int(m[1]), int(m[2]), m[3]) for m in steps if m]
    assert len(shown) >= 4
    for step, total, lr in shown:
        assert total == t.max_steps and lr == f"{t.lr * plan.factor(step):.2e}", (step, lr)
    evals = [int(m[1]) for m in (re.match(r"step +(\d+)  val_loss", x) for x in sample) if m]
    commits = [int(m[1]) for m in (re.match(r"checkpoint step (\d+) committed", x) for x in sample) if m]
    assert evals and all(s % t.eval_every == 0 or s == t.max_steps for s in evals)
    assert commits and all(s % cfg.ckpt.every_steps == 0 or s == t.max_steps for s in commits)
    assert sample[-1] == f"done: {t.max_steps} steps; checkpoints in runs/default/checkpoints"


def check_train_output_shape(command: str, tmp: Path, corpus_dir: Path) -> None:
    """Training prints lines of the shapes README's sample shows (a tiny model: numbers differ)."""
    shapes = [_shape(line) for line in _block_after(ROOT / "README.md", "then trains a 0.84M") if line != "..."]
    argv = ["train", *TINY, f"data.dir={corpus_dir}", "train.max_steps=20", "log.every_steps=10"]
    rc, out, err = _ddptrain([*argv, "train.eval_every=10", "ckpt.every_steps=10"], tmp)
    assert rc == 0, err
    printed = [line for line in (out + err).splitlines() if line.strip()]
    for line in printed:
        assert any(s.match(line) for s in shapes), f"{line!r} has no line of its shape in README's sample"
    for kind in (
        "training default: world size 1",
        "step     10/20  loss",
        "step     20  val_loss",
        "checkpoint step 20",
        "done: 20 steps",
    ):
        assert any(line.startswith(kind) for line in printed), kind


def check_prepare(command: str, tmp: Path) -> None:
    """`ddptrain prepare GLOB --out DIR` on a folder of notes."""
    (tmp / "notes" / "a").mkdir(parents=True)
    (tmp / "notes" / "a" / "one.md").write_text("# notes\n" * 2000)
    rc, out, err = _ddptrain(shlex.split(command)[1:], tmp)
    assert rc == 0, err
    assert re.match(r"^prepared 1 files .*into data/notes: [\d,]+ train tokens, [\d,]+ val tokens", out.strip()), out


def check_prepare_chat(command: str, tmp: Path) -> None:
    """The instruction-data walk-through's records (its make_chat.py, run here) prepare to the documented line."""
    blocks = [lines for _, lines in code_blocks(ROOT / "docs" / "real-models.md") if lines]
    script = next("\n".join(lines) for lines in blocks if lines[0] == "# make_chat.py")
    with contextlib.chdir(tmp):
        exec(compile(script, "make_chat.py", "exec"), {})
    rc, out, err = _ddptrain(shlex.split(command)[1:], tmp)
    documented = next(lines for lines in blocks if "$ python make_chat.py" in lines)
    assert rc == 0, err
    assert out.strip() == documented[documented.index(f"$ {command}") + 1], out


Check = Callable[..., None]
_SKIP_DIST = "starts several processes: tests/dist covers it (make test-dist)"
RULES: list[tuple[str, Check | str]] = [
    (r"^make (train|test)$", "sets up a virtual environment and trains or tests for minutes: what .ci/run does"),
    (r"^make bench$", "minutes of benchmarks with extra installs: CI runs python -m bench all --smoke"),
    (r"^python3 -m venv \.venv$", "creates an environment: what make venv does"),
    (r"^\.venv/bin/pip install ", "installs packages: make venv does (its torch index: test_install_commands...)"),
    (r"^ddptrain train$", check_train_output_shape),
    (r"^ddptrain train -c my\.yaml ", "my.yaml stands for the reader's config; the same path as ddptrain train"),
    (r"^ddptrain train --help-config$", check_help_config),
    (r"^ddptrain train train\.", check_error_line),
    (r"^ddptrain train schedule\.name=", check_error_line),
    (
        r"^ddptrain train optim\.target=my_pkg",
        "my_pkg stands for the reader's package: tests/unit/test_schedules.py covers optim.target",
    ),
    (
        r"^ddptrain train log\.trackers=\[wandb\]$",
        "shows the error without wandb, which the dev extra installs: tests/dist/test_tracker_extras.py",
    ),
    (
        r"^ddptrain train data\.dir=data/notes( run\.name=notes)?$",
        "trains on the reader's notes: the same path as ddptrain train",
    ),
    (r"^ddptrain prepare 'notes/", check_prepare),
    (r"^PYTHONPATH=examples/regression ", "trains the example model: tests/dist/test_cli_end_to_end.py runs it"),
    (r"^torchrun --nproc-per-node 2 -m ddptrain train", _SKIP_DIST),
    (
        r"^ddptrain launch --nproc-per-node 2 -- examples/python_api/",
        "two processes: tests/dist/test_python_api.py launches it",
    ),
    (r"^torchrun --standalone --nproc-per-node \d+ -m (ddptrain doctor|bench)", _SKIP_DIST),
    (r"^torchrun --nnodes 2 ", "needs two machines: tests/cluster/test_multinode_faults.py runs it on namespace hosts"),
    (r"^ddptrain launch --nnodes 2 ", check_launch_dry_run),
    (r"^ddptrain launch --nproc-per-node 2 -- train run\.name=two-ranks$", check_launch_dry_run),
    (r"^ddptrain launch --nnodes 2:3 --rdzv-backend etcd-v2 ", check_launch_dry_run),
    (r"^ddptrain launch --fault-tolerance torchft ", check_in_place_dry_run),
    (r"^ddptrain lighthouse --bind ", "serves until stopped: tests/dist/test_lighthouse.py starts and stops one"),
    (
        r"^ddptrain (slurm|k8s) -c examples/gpt-small\.yaml .* --fault-tolerance torchft",
        check_runs_and_prints_documents,
    ),
    (
        r"^ddptrain doctor --etcd 10\.0\.0\.11:2379,",
        "needs etcd members: tests/cluster/test_etcd_rendezvous.py runs doctor --etcd against real ones",
    ),
    (r"^python -m ddptrain launch --nnodes N ", "the template every node runs, with placeholders N, K, HEAD"),
    (r"^ddptrain slurm -c examples/gpt-small\.yaml .* \[--submit\]$", check_generated_slurm_script),
    (r"^ddptrain slurm -c examples/gpt-small\.yaml .* --submit$", check_runs_and_prints_documents),
    (r"^ddptrain k8s -c examples/gpt-small\.yaml --nodes 4 --min-nodes 2 ", check_generated_manifest),
    (r"^ddptrain k8s -c examples/gpt-small\.yaml --nodes 4 --gpus-per-node 8 --image", check_runs_and_prints_documents),
    (r"^ddptrain prepare \"\$STDLIB/", "trains a BPE tokenizer on the standard library: tests/unit/test_prepare.py"),
    (r"^ddptrain prepare FILES/", "a synopsis with placeholders: tests/unit/test_prepare.py runs prepare"),
    (
        r"^ddptrain prepare 'docs/\*\.md' README\.md ",
        "prepares the docs as text: tests/unit/test_prepare.py runs prepare",
    ),
    (r"^ddptrain train -c mix\.yaml$", "trains a mixture: tests/dist/test_data_sources_dist.py trains and resumes one"),
    (r"^ddptrain prepare FILE\.jsonl --out DIR --sft ", "a synopsis with placeholders: tests/unit/test_sft.py"),
    (r"^python make_chat\.py$", "writes the records of the walk-through: check_prepare_chat runs it"),
    (
        r"^python (make_sft_base|chat)\.py$",
        "LoRA on instruction data: tests/dist/test_peft_dist.py and test_sft_dist.py",
    ),
    (
        r"^ddptrain launch --nproc-per-node 2 -- train -c sft-lora\.yaml$|^ddptrain (eval|export) runs/sft-lora",
        "LoRA on instruction data, 2 ranks: tests/dist/test_peft_dist.py exports and reloads a LoRA run",
    ),
    (r"^ddptrain prepare chat\.jsonl --out data/chat --sft messages ", check_prepare_chat),
    (
        r"^ddptrain launch --nproc-per-node 2 -- train run\.dir=runs/chat |^ddptrain (eval|generate) runs/chat",
        "400 steps on 2 ranks, then the run it made: tests/dist/test_sft_dist.py trains instruction data on 2 ranks",
    ),
    (
        r"^ddptrain (eval|export) (runs/llama|RUN_DIR) |^torchrun --nproc-per-node 2 -m ddptrain eval ",
        "the Hugging Face walk-through on a trained Llama run: tests/dist/test_real_models.py",
    ),
    (r"^ddptrain train -c llama\.yaml ", "fine-tunes the exported Llama: tests/dist/test_real_models.py"),
    (
        r"^(torchrun --standalone --nproc-per-node 2 -m )?ddptrain (train -c lora\.yaml|eval runs/lora$|export runs/lora )",
        "the LoRA walk-through on a saved Llama: tests/dist/test_peft_dist.py trains, resumes, evaluates and exports one",
    ),
    (
        r"^ddptrain launch --nproc-per-node 2 -- train -c llama\.yaml$",
        "trains the Llama: tests/dist/test_real_models.py",
    ),
    (r"^kubectl apply ", "needs a Kubernetes cluster: tests/cluster/test_k8s_replicas.py runs the manifest's pods"),
    (r"^ddptrain export runs/default ", "needs a trained run: tests/unit/test_checkpoint.py exports one"),
    (
        r"^PYTHONPATH=tests torchrun --nproc-per-node 2 (-m ddptrain train model\.target=metrics_toy:|watch\.py$)"
        r"|^ddptrain (eval|report) runs/plateau",
        "metrics of your own, early stopping and a hook's stop: tests/dist/test_metrics_dist.py runs them",
    ),
    (
        r"^ddptrain launch --nproc-per-node 2 -- train run\.dir=runs/diloco ",
        "DiLoCo in 2 groups on 2 ranks: tests/dist/test_diloco_dist.py trains, kills and resumes one",
    ),
    (r"^ddptrain report runs/empty$", check_error_line),
    (
        r"^(torchrun --standalone --nproc-per-node=2 -m )?ddptrain train (data\.target=counting:|\.\.\. train\.max_steps=12$)",
        "the docs' stream trained at 2 ranks, resumed at 1: tests/dist/test_streams_dist.py does it with its own",
    ),
    (r"^ddptrain doctor( --endpoint HEAD:29500)?$", "a bandwidth sweep: tests/unit/test_doctor_unit.py"),
    (r"^ddptrain generate runs/demo ", "needs the demo run: tests/unit/test_report.py samples from a trained run"),
    (r"^ddptrain triage run", "needs a hung run's stacks: tests/dist/test_hangs.py runs triage on real hangs"),
    (
        r"^(torchrun --standalone --nproc-per-node 2 -m )?ddptrain verify-resume runs/cert ",
        "needs a trained run with a certificate: tests/dist/test_verify_resume.py replays one",
    ),
    (
        r"^python -m bench|^python bench/gpu\.py|^\.venv/bin/python bench/gpu\.py|^python -m bench\.profiling",
        "benchmarks, minutes each (and a GPU for bench/gpu.py): tests/dist/test_bench_smoke.py runs the smoke set",
    ),
]


def _rule(command: str) -> Check | str | None:
    return next((action for pattern, action in RULES if re.search(pattern, command)), None)


def test_every_documented_command_is_covered() -> None:
    commands = documented_commands()
    assert len(commands) > 30  # the collector finds the commands at all
    uncovered = [f"{name}: {command}" for name, command in commands if _rule(command) is None]
    assert not uncovered, "documented commands without a rule in tests/unit/test_docs.py:\n" + "\n".join(uncovered)


RUNNABLE = [(name, command) for name, command in documented_commands() if callable(_rule(command))]
SKIPPED = [(name, command) for name, command in documented_commands() if isinstance(_rule(command), str)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, command", RUNNABLE, ids=[f"{n}:{c[:60]}" for n, c in RUNNABLE])
def test_documented_command_runs_as_shown(name: str, command: str, tmp_path: Path, corpus_dir: Path) -> None:
    check = _rule(command)
    assert callable(check)
    if check is check_train_output_shape:
        check(command, tmp_path, corpus_dir)
    else:
        check(command, tmp_path)


@pytest.mark.parametrize("name, command", SKIPPED, ids=[f"{n}:{c[:60]}" for n, c in SKIPPED])
def test_documented_command_not_run_here(name: str, command: str) -> None:
    pytest.skip(str(_rule(command)))


def test_make_installs_pinned_torch_first_from_the_index_given(tmp_path: Path) -> None:
    """`make venv` installs the pinned torch before ddptrain, adding a wheel index only when TORCH_INDEX is given."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")

    def install_lines(*args: str) -> list[str]:
        proc = subprocess.run(
            [make, "-n", "-B", "venv", "VENV=" + str(tmp_path / "venv"), *args],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return [line for line in proc.stdout.splitlines() if "-m pip install -q" in line]

    plain = install_lines()
    torch_at = next(i for i, line in enumerate(plain) if '"torch==2.13.0"' in line)
    ddptrain_at = next(i for i, line in enumerate(plain) if "-e '.[dev]'" in line)
    assert torch_at < ddptrain_at
    assert "--extra-index-url" not in plain[torch_at]
    given = install_lines("TORCH_INDEX=https://example.invalid/whl/cpu")
    assert any(line.endswith('"torch==2.13.0" --extra-index-url https://example.invalid/whl/cpu') for line in given)
