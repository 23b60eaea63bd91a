"""The ranker with a sequence feature (model.sequence hstu) on a ranking dataset with histories:
2 gloo ranks train it as 1 does, step by step, with its tables sharded (the history slots are
keys of the item table); a 2-rank checkpoint resumes on 1 rank as the uninterrupted run; the
exported file scores the validation rows as the trained model does; the run names the feature."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import ROOT, failure, read_metrics, run_cli
from test_two_tower import assert_same_model
from variant_job import assert_close, launch, losses

JOB = ROOT / "tests/sequence_ranker_job.py"
VARIANTS = ("dcn",)
LABELS = "watched,liked:rating>=4"


def write_ratings(path, users: int = 60, items: int = 50, seed: int = 0):
    """user,item,rating,timestamp rows: each user rates 3 to 12 distinct items in time order,
    liking (5) the items of its taste's parity and not (2) the others."""
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(users):
        for n, i in enumerate(rng.choice(items, rng.integers(3, 13), replace=False)):
            rating = 5 if i % 2 == u % 2 else 2
            rows.append(f"u{u},i{i},{rating},{1000 * u + 10 * n}\n")
    path.write_text("".join(rows))
    return str(path)


def ranking_dataset(root, history: int = 4) -> str:
    log = write_ratings(root / "log.csv")
    out = root / "ranking"
    result = run_cli(["preprocess", "interactions", "--input", log, "--columns",
                      "user,item,rating,timestamp", "--labels", LABELS,
                      "--ranking-negatives", "2", "--history", str(history),
                      "--output", str(out)])
    assert result.returncode == 0, failure(result)
    return str(out)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_ranker")
    data = ranking_dataset(root)
    out = launch(root, JOB, list(VARIANTS), ["--data", data])
    out["data"] = data
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_train_the_one_rank_model_step_by_step(jobs, variant):
    assert_close(losses(jobs["two"] / variant), losses(jobs["one"] / variant), 1e-5)
    assert_same_model(jobs["two"] / variant, jobs["one"] / variant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_evaluate_as_one(jobs, variant):
    evals = {n: [e for e in read_metrics(jobs[n] / variant) if "val_auc_liked" in e]
             for n in ("one", "two")}
    assert [e["step"] for e in evals["two"]] == [5, 10]
    for one, two in zip(evals["one"], evals["two"]):
        for metric in ("val_auc_watched", "val_auc_liked"):
            assert one[metric] == pytest.approx(two[metric], abs=1e-5), metric


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_two_rank_checkpoint_resumed_on_one_rank_continues_the_run(jobs, variant):
    assert_close(losses(jobs["one"] / f"resumed_{variant}"), losses(jobs["two"] / variant)[5:],
                 1e-5)


def test_the_run_names_the_sequence_feature_and_shards_the_item_table(jobs):
    out = jobs["stdout"]
    assert "sequence: HSTU over the user's last 4 engagements" in out
    assert "the sequence feature needs the pooled vectors" in out
    assert "t_item_id" in out and "replicated on every rank" not in out


def test_the_exported_ranker_scores_as_the_trained_model(jobs, tmp_path):
    """`export` then `predict` on the validation split: each row's probabilities equal the
    unsharded trained model's (the history read from the same columns)."""
    import torch

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.split_binary import SplitBinaryDataset
    from dlrm_hybrid.model.dlrm import build_model
    from dlrm_hybrid.train.inference import read_model_state

    checkpoint = jobs["two"] / "dcn/checkpoints/step_10"
    result = run_cli(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "m.pt")])
    assert result.returncode == 0, failure(result)
    result = run_cli(["predict", "--model", str(tmp_path / "m.pt"), "--data", jobs["data"],
                      "--split", "val", "--out", str(tmp_path / "p.csv")])
    assert result.returncode == 0, failure(result)
    served = np.loadtxt(tmp_path / "p.csv", delimiter=",", skiprows=1)

    cfg = load_config(str(checkpoint / "config.yaml"))
    data = SplitBinaryDataset(jobs["data"])
    data.use_tasks(["watched", "liked"], "test")
    model = build_model(cfg.model, data.spec, embedding_device=torch.device("cpu"))
    model.load_state_dict(read_model_state(checkpoint))
    batch = data.batch("val", 0, data.num_samples("val"))
    with torch.no_grad():
        trained = torch.sigmoid(model.eval()(batch.dense, batch.sparse)).numpy()
    assert served.shape == trained.shape
    np.testing.assert_allclose(served, trained, atol=2e-6)
    last = batch.sparse.to_dict()["user_action3"].values()
    assert (last > 0).any() and (last == 0).any()  # full and shorter histories both scored

    from dlrm_hybrid.serve.predict import load_scoring_model

    module, _ = load_scoring_model(tmp_path / "m.pt")
    names = data.spec.feature_names
    ids = torch.stack([batch.sparse.to_dict()[n].values()[:2] for n in names], 1)
    ids[:, names.index("user_action0")] = 0  # an empty slot before a full one
    ids[:, names.index("user_action1")] = 2
    with pytest.raises(Exception, match="a history action after an empty slot"):
        module(batch.dense[:2], ids)
