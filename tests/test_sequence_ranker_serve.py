"""`recommend` with a sequence ranker (model.sequence hstu) as the funnel's ranker: each candidate
is scored with the user's latest engagements (the ranking dataset's timelines.npz), exactly as
the exported model scores those rows written by hand from the log."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import failure, run_cli
from test_recommend import FUNNEL, RANKER, TWO_TOWER, config_with, planted_log

SLOTS = 4
LABELS = "watched,liked:rating>=4,disliked:rating<=2"


def cli(*args: str):
    result = run_cli(list(args))
    assert result.returncode == 0, failure(result)
    return result


@pytest.fixture(scope="module")
def funnel(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequence_serve")
    rows = planted_log()
    (root / "log.csv").write_text("".join(",".join(map(str, r)) + "\n" for r in rows))
    read = ["preprocess", "interactions", "--input", str(root / "log.csv"),
            "--columns", "user,item,rating,timestamp,item:category"]
    cli(*read, "--positive", "rating>=1", "--output", str(root / "ret"))
    cli(*read, "--labels", LABELS, "--ranking-negatives", "2", "--history", str(SLOTS),
        "--output", str(root / "rank"))
    ranker = config_with(RANKER, {"model.sequence": "hstu", "model.hstu.dropout": 0.0,
                                  "train.max_steps": 60, "train.log_every": 60})
    for name, config, data, steps in (("tt", config_with(TWO_TOWER, {"train.max_steps": 30}),
                                       "ret", 30), ("rk", ranker, "rank", 60)):
        (root / f"{name}.yaml").write_text(config)
        cli("train", "--config", str(root / f"{name}.yaml"), "--set", f"data.path={root / data}",
            "--set", f"train.run_dir={root / name}", "--set", f"train.max_steps={steps}")
    cli("export", "--checkpoint", str(root / "tt/checkpoints/step_30"), "--out", str(root / "R"),
        "--retrieval")
    cli("export", "--checkpoint", str(root / "rk/checkpoints/step_60"), "--out",
        str(root / "M.pt"))
    cli("pixie", "build", "--data", str(root / "ret"), "--out", str(root / "G"))
    return root, rows


def hand_rows(root, rows, user: str, items: list):
    """(dense, ids) of `user` with each of `items`, in the ranking dataset's feature order, the
    history being the user's last SLOTS rows of the log (actions 1 + labels' bits)."""
    import yaml

    spec = yaml.safe_load((root / "rank/feature_spec.yaml").read_text())["metadata"]
    names = spec["categorical_features"]
    users = (root / "rank/users.txt").read_text().split()
    item_ids = (root / "rank/items.txt").read_text().split()
    mine = [r for r in rows if r[0] == user][-SLOTS:]  # the log is in time order
    ids = np.zeros((len(items), len(names)), np.int64)
    ids[:, names.index("user_id")] = users.index(user)
    ids[:, names.index("item_id")] = [item_ids.index(i) for i in items]
    categories = {r[1]: r[4] for r in rows}
    for j, (_, item, rating, _, _) in enumerate(mine):
        ids[:, names.index(f"user_history{j}")] = item_ids.index(item)
        ids[:, names.index(f"user_action{j}")] = 1 + 1 + 2 * (rating >= 4) + 4 * (rating <= 2)
    return ids, categories, names


def test_recommend_scores_each_candidate_with_the_users_latest_history(funnel):
    import torch

    from dlrm_hybrid.serve.predict import load_scoring_model
    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    root, rows = funnel
    inputs = ["--retrieval", str(root / "R"), "--pixie", str(root / "G"), "--ranker",
              str(root / "M.pt")]
    answer = json.loads(cli("recommend", *inputs, "--user", "u5", *FUNNEL, "--json").stdout)
    assert answer["items"]
    ids, _, names = hand_rows(root, rows, "u5", answer["items"])
    features = RankingFeatures(str(root / "rank"))
    dense, served_ids = features.rows(features.user_of["u5"],
                                      np.array([features.item_of[i] for i in answer["items"]]))
    side = [f for f, n in enumerate(names) if n.startswith("item_") and n != "item_id"]
    ids[:, side] = served_ids[:, side]  # the item's category, as the dataset numbered it
    np.testing.assert_array_equal(served_ids, ids)  # the history the log says, newest last
    module, _ = load_scoring_model(root / "M.pt")
    with torch.no_grad():
        probabilities = module(torch.from_numpy(dense), torch.from_numpy(ids)).numpy()
    for t, task in enumerate(("watched", "liked", "disliked")):
        np.testing.assert_allclose(answer["probabilities"][task], probabilities[:, t],
                                   atol=2e-6)


def test_a_request_before_the_last_engagement_reads_the_history_before_it(funnel):
    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    root, rows = funnel
    features = RankingFeatures(str(root / "rank"))
    mine = [r for r in rows if r[0] == "u7"]
    at = mine[-2][3]  # the time of the user's second-to-last engagement: it and later unseen
    _, ids = features.rows(features.user_of["u7"], np.arange(2), at=at)
    history = [features.item_names[ids[0, features.names.index(f"user_history{j}")]]
               for j in range(SLOTS)]
    assert history == [r[1] for r in mine[:-2]][-SLOTS:]
