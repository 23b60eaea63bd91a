"""Two-tower retrieval carries over what the ranker has: 2 gloo ranks train the 1-rank model
step by step (global in-batch negatives, logQ, accidental hits, uniform negatives, cross-batch
memory), a 2-rank checkpoint resumes on 1 rank as the uninterrupted run, the train pipeline
trains the same model and bf16 a close one; the evaluation is exact over the corpus and equal on 1 and 2 ranks; the run's record,
TensorBoard and the done line carry its metrics; `plan` shows both towers."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, done_fields, failure, read_metrics, run_cli
from variant_job import assert_close, launch, losses
from test_start import HEAVY

JOB = ROOT / "tests/two_tower_job.py"
TRAINED = ("defaults", "negatives")  # trained on 1 and 2 ranks; their step 5 resumed on 1
KS = (10, 50, 100)
METRICS = [f"val_{m}@{k}" for k in KS for m in ("recall", "hr", "ndcg")] + ["val_mrr"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """variant_job.launch's runs of JOB, TRAINED on 2 ranks."""
    return launch(tmp_path_factory.mktemp("two_tower"), JOB, TRAINED)


def final_state(run_dir: Path) -> dict:
    from dlrm_hybrid.train.inference import read_model_state

    return read_model_state(run_dir / "checkpoints" / "step_10")


def assert_same_model(a: Path, b: Path) -> None:
    """Every tensor of the two runs' final checkpoints, the loss's state (logQ estimate,
    memory) included. Row-wise Adagrad's first steps scale a row's update by 1/|gradient|,
    which carries the rounding of another reduction order into the tables (~2e-5 here)."""
    import torch

    left, right = final_state(a), final_state(b)
    assert sorted(left) == sorted(right)
    for key in left:
        assert torch.allclose(left[key].double(), right[key].double(), rtol=1e-3, atol=1e-4), key


@pytest.mark.parametrize("variant", TRAINED)
def test_two_ranks_train_the_one_rank_model_step_by_step(jobs, variant):
    assert_close(losses(jobs["two"] / variant), losses(jobs["one"] / variant), 1e-5)
    assert_same_model(jobs["two"] / variant, jobs["one"] / variant)


def test_the_loss_options_change_what_is_trained(jobs):
    """The negatives variant trains another model (its options are on), and keeps its state."""
    assert losses(jobs["one"] / "negatives")[1:] != losses(jobs["one"] / "defaults")[1:]
    state = final_state(jobs["one"] / "negatives")
    # 10 steps of 64 engagements + 32 uniform negatives fill the 800 slots; engagements alone
    # (negatives not reaching the batches) would leave 160 empty.
    assert (state["loss.memory_ids"] >= 0).all() and int(state["loss.step"]) == 10


@pytest.mark.parametrize("variant", TRAINED)
def test_a_two_rank_checkpoint_resumed_on_one_rank_continues_the_run(jobs, variant):
    resumed = jobs["one"] / f"resumed_{variant}"
    assert read_metrics(resumed)[0]["step"] == 5
    assert_close(losses(resumed), losses(jobs["two"] / variant)[5:], 1e-5)
    assert_same_model(resumed, jobs["two"] / variant)


def test_the_train_pipeline_runs_and_trains_the_same_model(jobs):
    run = jobs["one"] / "pipeline"
    assert read_metrics(run)[0]["step_driver"] == "torchrec pipeline"
    assert read_metrics(jobs["one"] / "defaults")[0]["step_driver"] == "plain"
    assert_close(losses(run), losses(jobs["one"] / "defaults"), 1e-6)


def test_bf16_trains_close_to_fp32(jobs):
    bf16, fp32 = losses(jobs["one"] / "bf16"), losses(jobs["one"] / "defaults")
    assert bf16 != fp32  # it did compute in bf16
    assert_close(bf16, fp32, 2e-2)


def test_every_evaluation_is_recorded_shown_and_mirrored_to_tensorboard(jobs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = jobs["two"] / "defaults"
    evals = [e for e in read_metrics(run) if "val_mrr" in e]
    assert [e["step"] for e in evals] == [10] and evals[0]["users"] == 200
    record = evals[0]
    assert all(0 <= record[m] <= 1 for m in METRICS), record
    assert record["val_recall@10"] <= record["val_recall@50"] <= record["val_recall@100"]
    assert 0 < record["val_ceiling_recall@10"] <= 1  # the planted log's teacher
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    for metric in METRICS:
        [point] = events.Scalars(f"eval/{metric}")
        assert point.step == 10 and point.value == pytest.approx(record[metric], rel=1e-6)
    done = done_fields(next(line for line in jobs["stdout"].splitlines()
                            if line.startswith("done: ")))  # the first variant's: defaults
    assert {m: round(record[m], 5) for m in METRICS} == {m: done[m] for m in METRICS}
    assert done["val_ceiling_recall@10"] == round(record["val_ceiling_recall@10"], 5)


def test_eval_of_a_two_rank_checkpoint_on_one_rank_gives_the_runs_metrics(jobs):
    """The `eval` command, on 1 rank, evaluates what the 2-rank run evaluated at its end."""
    run = jobs["two"] / "defaults"
    record = [e for e in read_metrics(run) if "val_mrr" in e][-1]
    result = run_cli(["eval", "--checkpoint", str(run / "checkpoints/step_10"), "--split", "val"])
    assert result.returncode == 0, failure(result)
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("eval: ") and " split=val " in line, line
    fields = dict(item.split("=") for item in line.split()[1:])
    assert {m: float(fields[m]) for m in METRICS} == {m: round(record[m], 5) for m in METRICS}


def test_resuming_with_other_model_or_retrieval_settings_is_refused(jobs, tmp_path):
    run = jobs["two"] / "defaults"
    result = run_cli(["train", "--config", str(run / "config.yaml"),
                      "--set", f"train.run_dir={tmp_path}",
                      "--set", f"checkpoint.resume={run / 'checkpoints/step_5'}",
                      "--set", "retrieval.logq=false", "--set", "model.item_tower.mlp=[64,16]"])
    assert result.returncode == 2, failure(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: checkpoint.resume: ") and "trained with other settings" in line
    assert "retrieval.logq (True there, False here)" in line
    assert "model.item_tower.mlp ([32, 16] there, [64, 16] here)" in line


class Vectors:
    """A model for `evaluate_retrieval`: fixed user and item vectors by id."""

    def __init__(self, users: np.ndarray, items: np.ndarray) -> None:
        import torch

        self.users, self.items = torch.from_numpy(users), torch.from_numpy(items)

    def __call__(self, dense, sparse):
        import torch

        out = []
        for table, key in ((self.users, "user_id"), (self.items, "item_id")):
            bags = sparse[key]
            rows = torch.zeros(len(bags.lengths()), table.shape[1], dtype=table.dtype)
            rows[bags.lengths() > 0] = table[bags.values().long()]
            out.append(rows)
        return torch.cat(out, 1)

    def eval(self):
        return self

    def train(self):
        return self


def reference(scores: np.ndarray, seen: list, wanted: list, ks, split: str) -> dict:
    """The metrics by sorting each user's whole row (seen items last; ties by item id, as a
    stable sort serves them), as their definitions say."""
    out = {f"{m}@{k}": 0.0 for k in ks for m in ("recall", "hr", "ndcg")}
    out["mrr"] = 0.0
    users = [u for u in range(len(scores)) if wanted[u]]
    for u in users:
        row = scores[u].copy()
        row[list(seen[u])] = -np.inf
        position = {item: int((row > row[item]).sum() + (row[:item] == row[item]).sum())
                    for item in wanted[u]}
        for k in ks:
            hits = [p for p in position.values() if p < k]
            out[f"recall@{k}"] += len(hits) / min(len(wanted[u]), k)
            out[f"hr@{k}"] += bool(hits)
            ideal = sum(1 / math.log2(i + 2) for i in range(min(len(wanted[u]), k)))
            out[f"ndcg@{k}"] += sum(1 / math.log2(p + 2) for p in hits) / ideal
        out["mrr"] += 1 / (min(position.values()) + 1)
    return {f"{split}_{k}": v / len(users) for k, v in out.items()}


@pytest.mark.parametrize("split, tied", [("val", False), ("test", False), ("val", True)])
def test_the_evaluation_ranks_the_whole_corpus_exactly(split, tied):
    """Users with several relevant items, earlier splits' items left out (train for val; train
    and val for test), a re-engagement (an earlier item again) not one to find, the corpus
    scored in chunks that do not divide it, users in batches that do not divide them. `tied`:
    some users' vectors are 0 (a sequence model's user without history), every item ties:
    ranked by item id as served, not each relevant item first (HR 1, recall and NDCG above 1)."""
    import torch

    from dlrm_hybrid.config import RetrievalConfig
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData
    from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta
    from dlrm_hybrid.parallel.process_group import DistEnv
    from dlrm_hybrid.retrieval.evaluate import evaluate_retrieval

    rng = np.random.default_rng(0)
    users, items, ks = 23, 40, (1, 3, 10)
    order = ("train", "val", "test")
    pairs, engaged = {}, {s: [set() for _ in range(users)] for s in order}
    for u in range(users):
        drawn = rng.permutation(items)[:rng.integers(0, 12)]
        cut = sorted(rng.integers(0, len(drawn) + 1, 2))
        parts = [drawn[:cut[0]], drawn[cut[0]:cut[1]], drawn[cut[1]:]]
        # re-watches, an earlier split's item again later: train's in val or test, val's in test
        earlier_part, later = [(0, 1), (0, 2), (1, 2)][u % 3]
        if len(parts[earlier_part]):
            parts[later] = np.append(parts[later], parts[earlier_part][0])
        for name, part in zip(order, parts):
            got = pairs.setdefault(name, ([], []))
            got[0].extend([u] * len(part))
            got[1].extend(part)
            engaged[name][u].update(part.tolist())
    pairs = {s: (np.array(a, np.int64), np.array(b, np.int64)) for s, (a, b) in pairs.items()}
    data = InteractionData(InteractionMeta(users, items), pairs, np.zeros((users, 0), np.int64),
                           np.zeros((items, 0), np.int64))
    earlier = order[:order.index(split)]
    seen = [set().union(*(engaged[s][u] for s in earlier)) for u in range(users)]
    wanted = [engaged[split][u] - seen[u] for u in range(users)]
    assert sum(len(engaged[split][u] & seen[u]) for u in range(users)) >= 3  # re-watches
    user_vecs, item_vecs = rng.normal(size=(users, 4)), rng.normal(size=(items, 4))
    if tied:
        user_vecs[::3] = 0
    cfg = RetrievalConfig(eval_k=list(ks), eval_items_per_chunk=7)
    one_process = DistEnv(0, 1, 0, 1, "gloo", torch.device("cpu"))
    got = evaluate_retrieval(Vectors(user_vecs, item_vecs), data, cfg, one_process, batch=5,
                             split=split)
    want = reference(user_vecs @ item_vecs.T, seen, wanted, ks, split)
    assert got.pop("users") == sum(1 for w in wanted if w)
    assert got == pytest.approx(want, rel=1e-12)
    assert max(got.values()) <= 1


def test_plan_shows_each_tower_without_importing_torch(tmp_path):
    """On the planted log's shape, and on an interaction folder (its tables' rows are the
    folder's, not data.users/items)."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.interactions.interaction_data import write_interactions
    from dlrm_hybrid.data.interactions.planted_interactions import planted_interactions

    config = tmp_path / "tt.yaml"
    config.write_text("model: {kind: two_tower, embedding_dim: 16}\n"
                      "data: {users: 200, items: 300}\n")
    write_interactions(planted_interactions(load_config(str(config)).data), str(tmp_path / "log"))
    args = ["-m", "dlrm_hybrid", "plan", "--config", str(config), "--world-size", "2", "--set",
            "parallel.replicate=false"]
    for extra, users, items in (([], 200, 300), (["--set", f"data.path={tmp_path / 'log'}",
                                                  "--set", "data.users=7"], 200, 300)):
        result = subprocess.run([sys.executable, "-X", "importtime", *args, *extra],
                                capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert result.returncode == 0, result.stderr[-2000:]
        modules = {line.split("|")[-1].strip().split(".")[0]
                   for line in result.stderr.splitlines() if line.startswith("import time:")}
        assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
        towers = [line for line in result.stdout.splitlines() if " tower: " in line]
        assert [line.split(":")[0] for line in towers] == ["user tower", "item tower"]
        assert towers[0].startswith(f"user tower: 2 tables, {users + 16:,} rows, ")
        assert towers[1].startswith(f"item tower: 2 tables, {items + 32:,} rows, ")
        assert "t_user_id on rank" in towers[0] and "t_user_segment on rank" in towers[0]
        assert "t_item_id on rank" in towers[1] and "t_item_category on rank" in towers[1]


@pytest.mark.parametrize("setting, says", [
    ("retrieval.eval_k=[10,10]", "retrieval.eval_k: [10, 10]: give distinct positive cut-offs"),
    ("data.interactions_per_user=2", "data.interactions_per_user: 2 leaves the planted log no "
     "training engagements"),
])
def test_two_tower_config_mistakes_are_one_line_errors(setting, says):
    result = run_cli(["train", "--set", "model.kind=two_tower", "--set", setting])
    assert result.returncode == 2, failure(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {says}"), line


def test_uniform_negatives_that_do_not_split_over_the_ranks_stop_the_launch():
    result = run_cli(["train", "--set", "model.kind=two_tower",
                      "--set", "retrieval.uniform_negatives=5"], nproc=2)
    assert result.returncode == 2, failure(result)
    assert "error: retrieval.uniform_negatives: 5 do not split over 2 ranks" in result.stderr
