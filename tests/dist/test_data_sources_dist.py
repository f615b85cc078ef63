"""Data sources under torchrun: a mixture of 3 killed at 2 ranks and resumed at 1 and 3 loses and repeats no sample; data.hf."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import TESTS_DIR, TINY, read_metrics, run_ddptrain

pytestmark = pytest.mark.dist

BATCH = 12  # shares 6, 3.6 and 2.4 samples: most batches cannot give each its exact share


def sources(weights: tuple[int, int, int] = (5, 3, 2)) -> str:
    sizes = {"web": (1, 37), "code": (2, 23), "math": (3, 11)}
    items = [
        f"{{name: {name}, weight: {w}, target: 'toy:build_tagged_datasets', kwargs: {{tag: {tag}, n: {n}}}}}"
        for (name, (tag, n)), w in zip(sizes.items(), weights)
    ]
    return f"data.sources=[{', '.join(items)}]"


def args(run_dir: Path, record: Path, steps: int, die_at: int = 0) -> list[str]:
    model = f"model.kwargs={{dim: 8, record_dir: {record}, die_at: {die_at}, marker: {run_dir.parent / 'killed'}}}"
    return ["train", "model.target=toy:build_model", sources(), model, f"run.dir={run_dir}",
            f"train.max_steps={steps}", f"train.global_batch_size={BATCH}", "data.micro_batch_size=2",
            "train.eval_every=0", "ckpt.every_steps=2", "log.every_steps=1"]  # fmt: skip


def ids_by_rank(record: Path) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for f in sorted(record.glob("ids-rank*.txt")):
        rank = int(f.name.split("-")[1].removeprefix("rank"))
        out.setdefault(rank, []).extend(int(i) for line in f.read_text().splitlines() for i in line.split())
    return out


def source_samples(run_dir: Path) -> dict[int, dict[str, int]]:
    return {r["step"]: r["source_samples"] for r in read_metrics(run_dir)}


@pytest.mark.timeout(300)
def test_a_mixture_killed_at_2_ranks_resumes_at_1_and_3_with_no_sample_lost_or_repeated(tmp_path: Path) -> None:
    r = run_ddptrain(args(tmp_path / "ref" / "run", tmp_path / "ref-ids", 12))
    assert r.returncode == 0, r.stderr
    reference = ids_by_rank(tmp_path / "ref-ids")[0]
    assert len(reference) == 12 * BATCH
    assert "data source math starts its epoch 1" in r.stdout + r.stderr  # 11 samples: used up after a few steps
    expected_samples = source_samples(tmp_path / "ref" / "run")
    tags = Counter(i // 1000 for i in reference)
    assert [tags[1], tags[2], tags[3]] == [expected_samples[12][n] for n in ("web", "code", "math")]
    for step, taken in expected_samples.items():
        for name, w in zip(("web", "code", "math"), (5, 3, 2)):
            assert abs(taken[name] - step * BATCH * w / 10) < 1  # the running totals follow the weights

    run_dir = tmp_path / "mix" / "run"
    killed = run_ddptrain(args(run_dir, tmp_path / "ids-2", 12, die_at=17), nproc=2)  # step 6's 2nd micro-batch
    assert killed.returncode != 0 and (tmp_path / "mix" / "killed").exists()
    one = run_ddptrain(args(run_dir, tmp_path / "ids-1", 8))
    assert one.returncode == 0, one.stderr
    assert "(step 4; saved at world size 2, now 1" in one.stdout + one.stderr
    three = run_ddptrain(args(run_dir, tmp_path / "ids-3", 12), nproc=3)
    assert three.returncode == 0, three.stderr
    assert "(step 8; saved at world size 1, now 3" in three.stdout + three.stderr

    at_two = ids_by_rank(tmp_path / "ids-2")  # steps 1-4 were committed: each rank's first 4 x 6 samples
    assert sorted(i for ids in at_two.values() for i in ids[: 4 * BATCH // 2]) == sorted(reference[: 4 * BATCH])
    assert ids_by_rank(tmp_path / "ids-1")[0] == reference[4 * BATCH : 8 * BATCH]  # one rank: the stream's order
    at_three = [i for ids in ids_by_rank(tmp_path / "ids-3").values() for i in ids]
    assert sorted(at_three) == sorted(reference[8 * BATCH :])
    assert source_samples(run_dir)[12] == expected_samples[12]


@pytest.mark.timeout(180)
def test_ranks_given_different_mixture_weights_stop_before_the_first_step(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    common = args(run_dir, tmp_path / "ids", 4)
    common.remove(sources())
    env = {"PER_RANK_ARGS": json.dumps([[sources((5, 3, 2))], [sources((5, 3, 3))]])}
    r = run_ddptrain([str(TESTS_DIR / "per_rank_args.py"), *common], nproc=2, launcher="launch", timeout=150, env=env)
    assert r.returncode == 2, r.stderr[-3000:]  # `ddptrain launch` exits with its workers' 2
    errors = [line for line in r.stderr.splitlines() if "ddptrain train: error:" in line]
    assert len(errors) == 2, r.stderr[-3000:]
    assert all("rank 1 (" in line for line in errors), errors
    assert not (tmp_path / "ids").exists()  # not one sample trained


@pytest.mark.timeout(180)
def test_a_parquet_file_written_by_the_test_trains_on_two_ranks(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [f"def f{i}(x):\n    return x * {i}\n" * 8 for i in range(300)]
    pq.write_table(pa.table({"content": rows}), tmp_path / "code.parquet", row_group_size=50)
    hf = f"data.hf={{files: [{tmp_path / 'code.parquet'}], text_field: content}}"
    r = run_ddptrain(["train", *TINY, hf, f"data.dir={tmp_path / 'corpus'}", f"run.dir={tmp_path / 'run'}"], nproc=2)
    assert r.returncode == 0, r.stderr
    assert f"preparing the data.hf files into {tmp_path / 'corpus'}" in r.stdout + r.stderr
    assert len(read_metrics(tmp_path / "run")) == 6  # TINY's 6 steps, each logged
