"""The first-stage ranker: `preprocess first-stage` makes a two-tower dataset of the heavy ranker's
top-K labels (rows matched one to one, mismatches refused in one line, nothing left behind); its
model's cached item side scores as the trained model does; `recommend --first-stage` hands the
heavy ranker exactly the first stage's best N and returns them in the heavy ranker's order."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import failure, run_cli
from dlrm_hybrid.errors import UserError
from test_recommend import build_funnel, cli

TOP_K = 3


@pytest.fixture(scope="module")
def funnel(tmp_path_factory):
    """The planted log's retrieval and ranking datasets, a two-tower model, a heavy ranker and
    a graph (as test_recommend's), the heavy ranker's top-3 labels of the ranking train split,
    the first-stage dataset they make and its model, exported."""
    root = tmp_path_factory.mktemp("first_stage")
    build_funnel(root)
    cli("predict", "--model", str(root / "M.pt"), "--data", str(root / "rank"), "--split",
        "train", "--out", str(root / "p.csv"), "--top-k-label", str(TOP_K), "--label-out",
        str(root / "top.txt"))
    made = cli("preprocess", "first-stage", "--retrieval", str(root / "ret"), "--ranking",
               str(root / "rank"), "--labels", str(root / "top.txt"), "--output",
               str(root / "first"))
    cli("train", "--config", str(root / "tt.yaml"), "--set", f"data.path={root / 'first'}",
        "--set", f"train.run_dir={root / 'ft'}", "--set", "train.max_steps=60")
    cli("export", "--checkpoint", str(root / "ft/checkpoints/step_60"), "--out",
        str(root / "F"), "--retrieval")
    return SimpleNamespace(root=root, made=made.stdout)


def ranking_pairs(root: Path, split: str = "train") -> list:
    """The (raw user, raw item) of each row of the ranking dataset's split, in row order."""
    from dlrm_hybrid.data.interactions.first_stage_labels import ranking_rows

    users, items = ranking_rows(str(root / "rank"), split)
    return list(zip(users.tolist(), items.tolist()))


def test_the_dataset_holds_the_rows_labelled_1_and_the_retrieval_evaluation(funnel):
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    root = funnel.root
    labels = np.loadtxt(root / "top.txt", dtype=np.int64)
    pairs = ranking_pairs(root)
    assert len(labels) == len(pairs) and 0 < labels.sum() < len(labels)
    first, ret = open_interactions(str(root / "first")), open_interactions(str(root / "ret"))
    users = (root / "ret/users.txt").read_text().splitlines()
    items = (root / "ret/items.txt").read_text().splitlines()
    got = Counter((users[u], items[i]) for u, i in zip(*first.pairs["train"]))
    assert got == Counter(p for p, label in zip(pairs, labels) if label)
    for split in ("val", "test"):  # the retrieval dataset's evaluation, unchanged
        assert all(np.array_equal(a, b) for a, b in zip(first.pairs[split], ret.pairs[split]))
    assert (root / "first/items.txt").read_text() == (root / "ret/items.txt").read_text()
    counts = first.meta.extra["first_stage"]
    assert counts["rows"] == len(labels) and counts["kept"] == labels.sum()
    assert f"rows={len(labels)} labelled={labels.sum()}" in funnel.made


def test_engagements_stay_beside_the_labels_when_asked(funnel):
    """--engagements: the retrieval dataset's training engagements and the labelled rows,
    together (seeded: the same seed, the same order)."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    root = funnel.root
    for name, seed in (("eng", "0"), ("eng_again", "0"), ("eng_other", "1")):
        cli("preprocess", "first-stage", "--retrieval", str(root / "ret"), "--ranking",
            str(root / "rank"), "--labels", str(root / "top.txt"), "--output", str(root / name),
            "--engagements", "--seed", seed)
    ret, first = open_interactions(str(root / "ret")), open_interactions(str(root / "first"))
    eng = open_interactions(str(root / "eng"))
    pairs = lambda data: Counter(zip(*(a.tolist() for a in data.pairs["train"])))  # noqa: E731
    assert pairs(eng) == pairs(ret) + pairs(first)
    assert eng.meta.extra["first_stage"]["engagements"] == ret.num_samples("train")
    again = open_interactions(str(root / "eng_again"))
    other = open_interactions(str(root / "eng_other"))
    assert all(np.array_equal(a, b) for a, b in zip(eng.pairs["train"], again.pairs["train"]))
    assert not np.array_equal(eng.pairs["train"][1], other.pairs["train"][1])


def _refused(args: list, says: str) -> None:
    result = run_cli(["preprocess", "first-stage", *args])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
    assert says in result.stderr, result.stderr


def test_mismatched_labels_and_outputs_over_inputs_are_refused(funnel):
    root = funnel.root
    before = sorted(p.name for p in root.iterdir())
    lines = (root / "top.txt").read_text().split()
    (root / "short.txt").write_text("\n".join(lines[:-1]) + "\n")
    (root / "bad.txt").write_text("\n".join(["2"] + lines[1:]) + "\n")
    base = ["--retrieval", str(root / "ret"), "--ranking", str(root / "rank")]
    _refused([*base, "--labels", str(root / "short.txt"), "--output", str(root / "x")],
             f"has {len(lines) - 1} labels, {root / 'rank'}'s train split has {len(lines)} rows")
    _refused([*base, "--split", "val", "--labels", str(root / "top.txt"), "--output",
              str(root / "x")], "'s val split has")
    _refused([*base, "--labels", str(root / "bad.txt"), "--output", str(root / "x")],
             "line 1 is '2'; each line is 0 or 1")
    _refused([*base, "--labels", str(root / "top.txt"), "--output", str(root / "rank")],
             "--output")
    _refused([*base, "--labels", str(root / "top.txt"), "--output", str(root / "first")],
             "already exists")
    _refused(["--retrieval", str(root / "rank"), "--ranking", str(root / "rank"), "--labels",
              str(root / "top.txt"), "--output", str(root / "x")],
             f"--retrieval: {root / 'rank'} has no interactions.yaml")
    _refused(["--retrieval", str(root / "first"), "--ranking", str(root / "rank"), "--labels",
              str(root / "top.txt"), "--output", str(root / "x")], "is a first-stage dataset")
    (root / "short.txt").unlink()
    (root / "bad.txt").unlink()
    assert sorted(p.name for p in root.iterdir()) == before  # nothing written, no partial


def test_the_cached_item_side_scores_as_the_trained_model(funnel):
    """FirstStage.scores (the exported item vectors, cached) equals the trained model's own
    user tower . item tower for the same user and items."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.batch import Batch
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions
    from dlrm_hybrid.model.two_tower import build_two_tower, split_towers
    from dlrm_hybrid.serve.first_stage import FirstStage
    from dlrm_hybrid.serve.retrieve import Retriever
    from dlrm_hybrid.train.inference import read_model_state

    root, checkpoint = funnel.root, funnel.root / "ft/checkpoints/step_60"
    cfg = load_config(str(checkpoint / "config.yaml"))
    data = open_interactions(str(root / "first")).for_model(cfg.model)
    model = build_two_tower(cfg, data.spec, embedding_device=torch.device("cpu"))
    model.load_state_dict(read_model_state(checkpoint))
    model.eval()
    stage = FirstStage(str(root / "F"), Retriever(str(root / "R")))
    items = np.array([5, 0, 77, 31, 119, 64])
    for user in (0, 7, 211):
        columns = data.tower_columns(np.full(len(items), user), items, np.ones(len(items), bool))
        batch = Batch.from_columns(columns, data.spec.feature_names)
        with torch.no_grad():
            users, vectors = split_towers(model(batch.dense, batch.sparse))
        want = (users * vectors).sum(1).numpy()
        assert np.allclose(stage.scores(user, items), want, atol=1e-5)
        assert stage.order(user, items).tolist() == items[np.argsort(-want, kind="stable")].tolist()


def test_three_stages_rank_the_first_stages_best_in_the_heavy_rankers_order(funnel):
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    root = funnel.root
    settings = RecommendSettings(k=6, per_source=15, first_stage_keep=6, diversity="off")
    rec = Recommender(str(root / "R"), str(root / "G"), str(root / "M.pt"), settings=settings,
                      first_stage=str(root / "F"))
    two = Recommender(str(root / "R"), str(root / "G"), str(root / "M.pt"),
                      settings=RecommendSettings(k=6, per_source=15, diversity="off"))
    differs = 0
    for name in ("u0", "u1", "u9", "u42"):
        answer = rec.recommend(name)
        user = rec.retriever.user_of[name]
        merged = answer.stages["merged"]
        assert len(merged) > 2 * settings.first_stage_keep
        scores = rec.first_stage.scores(user, merged)
        best = merged[np.argsort(-scores, kind="stable")[:6]]
        assert answer.stages["first_stage"].tolist() == best.tolist()
        assert sorted(answer.items.tolist()) == sorted(best.tolist())
        dense, ids = rec.features.rows(int(rec.ranking_user[user]), rec.ranking_item[best])
        with torch.inference_mode():
            _, value = rec.ranker.score_with_value(torch.from_numpy(dense),
                                                   torch.from_numpy(ids), None, rec.weights)
        assert answer.items.tolist() == best[np.argsort(-value.numpy(), kind="stable")].tolist()
        differs += answer.items.tolist() != two.recommend(name).items.tolist()
    assert differs  # the first stage changes what the heavy ranker sees
    assert not two.recommend("u0").stages["first_stage"].size  # two stages: none
    for prior in (1000.0, float("inf")):  # its order fused with the merged order's; kept
        rec.settings.first_stage_prior = prior
        kept = rec.recommend("u0").stages
        assert kept["first_stage"].tolist() == kept["merged"][:6].tolist()
    order, rec.first_stage.order = rec.first_stage.order, None  # kept: nothing to score
    assert rec.recommend("u0").stages["first_stage"].tolist() == kept["merged"][:6].tolist()
    rec.first_stage.order = order
    rec.settings.first_stage_prior = 0.5
    kept = rec.recommend("u0").stages
    own = rec.first_stage.order(rec.retriever.user_of["u0"], kept["merged"])
    rank = {item: r for r, item in enumerate(kept["merged"].tolist(), 1)}
    fused = sorted(own.tolist(), key=lambda item: -(1 / (60 + own.tolist().index(item) + 1)
                                                    + 0.5 / (60 + rank[item])))
    assert kept["first_stage"].tolist() == fused[:6] != own[:6].tolist()


def test_recommend_command_with_a_first_stage(funnel):
    root = funnel.root
    inputs = ["--retrieval", str(root / "R"), "--pixie", str(root / "G"), "--ranker",
              str(root / "M.pt"), "--user", "u3", "--per-source", "15", "--k", "5"]
    answer = json.loads(cli("recommend", *inputs, "--first-stage", str(root / "F"),
                            "--first-stage-keep", "7", "--json").stdout)
    assert answer["candidates"]["first_stage"] == 7 and answer["candidates"]["ranked"] == 7
    assert len(answer["items"]) == 5 and "first_stage" in answer["ms"]
    result = run_cli(["recommend", *inputs, "--first-stage", str(root / "F"),
                      "--first-stage-keep", "3"])
    assert result.returncode == 2 and "--first-stage-keep: 3 is less than --k 5" in result.stderr
    result = run_cli(["recommend", *inputs, "--first-stage", str(root / "rank")])
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--first-stage: " in result.stderr and "has no retrieval.yaml" in result.stderr


def test_recommend_tune_writes_the_settings_recommend_reads(funnel):
    """`recommend-tune` chooses the three-stage funnel's value model and priors on the
    retrieval dataset's validation pairs and writes them; `recommend --settings` answers as the
    same settings given as flags (a flag given beside the file wins); a file that is not one, a
    bad key, or another ranker than the file's is one line."""
    import yaml

    root = funnel.root
    out = root / "funnel.yaml"
    served = ["--retrieval", str(root / "R"), "--pixie", str(root / "G")]
    funnel_flags = ["--per-source", "15", "--first-stage-keep", "7", "--steps", "2000"]
    said = cli("recommend-tune", *served, "--ranker", str(root / "M.pt"), "--first-stage",
               str(root / "F"), *funnel_flags, "--value", "liked=1,disliked=-1",
               "--value", "disliked=1", "--k", "5", "--users", "100", "--out", str(out)).stdout
    tuned = yaml.safe_load(out.read_text())
    chosen = tuned["settings"]
    assert said.startswith(f"recommend-tune: wrote {out} users=") and "hr@5_ranked=" in said
    assert tuned["ranker"] == str((root / "M.pt").resolve())
    assert tuned["first_stage"] == str((root / "F").resolve())
    assert chosen["per_source"] == 15 and chosen["first_stage_keep"] == 7
    assert chosen["value"] in ({"liked": 1.0, "disliked": -1.0}, {"disliked": 1.0})
    assert chosen["first_stage_prior"] is not None and tuned["validation"]["users"] == 100
    assert set(chosen["fusion"]) == {"two_tower", "history", "pixie"}

    def answer(*args: str) -> dict:
        found = json.loads(cli("recommend", *served, "--user", "u3", "--k", "5", "--steps",
                               "2000", *args, "--json").stdout)
        del found["ms"]
        return found

    fusion = ",".join(f"{s}={w}" for s, w in chosen["fusion"].items())
    as_flags = ["--ranker", str(root / "M.pt"), "--first-stage", str(root / "F"),
                "--per-source", "15", "--first-stage-keep", "7", "--fusion", fusion]
    priors = ["--rank-prior", str(chosen["rank_prior"]), "--first-stage-prior",
              str(chosen["first_stage_prior"])]
    assert answer("--settings", str(out)) == answer(*as_flags, *priors, "--value",
                                                    "liked=1,disliked=-1")
    assert answer("--settings", str(out), "--value", "disliked=1") == \
        answer(*as_flags, *priors, "--value", "disliked=1")
    chosen.update(value={"disliked": 1.0}, rank_prior=float("inf"), first_stage_prior=0.0)
    out.write_text(yaml.safe_dump(tuned))  # a file edited by hand is read as it says
    assert answer("--settings", str(out)) == answer(*as_flags, "--rank-prior", "inf",
                                                    "--value", "disliked=1")

    def refused(says: str, *args: str) -> None:
        result = run_cli(["recommend", *served, "--user", "u3", *args])
        assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
        assert says in result.stderr, result.stderr

    chosen["rank_prior"] = "high"
    out.write_text(yaml.safe_dump(tuned))
    refused("settings.rank_prior is not a number 0 or more ('high')", "--settings", str(out))
    out.write_text("ranker: [unclosed\n")
    refused(f"--settings: {out}: not YAML", "--settings", str(out))
    out.write_text("k: 3\n")
    refused("not a funnel settings file", "--settings", str(out))
    refused("--settings: cannot read", "--settings", str(root / "none.yaml"))
    chosen["rank_prior"] = 0.0
    out.write_text(yaml.safe_dump(tuned))
    refused("is not what --settings", "--settings", str(out), "--ranker", str(root / "F"))
    refused("recommend: give --ranker FILE", "--per-source", "15")


def test_a_labelled_evaluation_pair_stays_and_is_still_asked_for(tmp_path):
    """A train request's negatives may be a user's validation or test item (never_negative),
    and the heavy ranker may put one in its top K: the row stays, counted, and the first
    stage's evaluation (and its export's seen items) exclude the users' engagements, not the
    labels, so that pair is still one to find, as in the retrieval dataset."""
    from dlrm_hybrid.data.interactions.first_stage_labels import first_stage_data
    from dlrm_hybrid.data.interactions.interaction_data import (InteractionData,
                                                                open_interactions,
                                                                write_interactions)
    from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta

    pairs = {"train": (np.array([0, 0, 1]), np.array([0, 1, 2])),
             "val": (np.array([0, 1]), np.array([3, 4])), "test": (np.array([0, 1]), np.array([5, 0]))}
    names = (["a", "b"], [f"i{i}" for i in range(6)])
    write_interactions(InteractionData(InteractionMeta(2, 6), pairs, np.zeros((2, 0), np.int64),
                                       np.zeros((6, 0), np.int64)), str(tmp_path / "ret"), *names)
    ret = open_interactions(str(tmp_path / "ret"))
    users = np.array(["a", "a", "b", "b"], dtype=object)
    items = np.array(["i5", "i2", "i4", "i1"], dtype=object)  # a's test item, b's validation one
    for seed in (None, 0):
        data, counts = first_stage_data(ret, str(tmp_path / "ret"), "rank", users, items,
                                        np.array([True, True, True, False]), seed)
        assert counts["evaluation_pairs"] == 2 and counts["kept"] == 3
        out = tmp_path / f"first_{seed}"
        write_interactions(data, str(out), *names)
        first = open_interactions(str(out))
        assert {(0, 5), (1, 4)} <= set(zip(*(a.tolist() for a in first.pairs["train"])))
        for split, earlier in (("val", ("train",)), ("test", ("train", "val"))):
            for got, want in zip(first.findable(split, earlier), ret.findable(split, earlier)):
                assert got.tolist() == want.tolist()
        for got, want in zip(first.engaged(("train",)), ret.engaged(("train",))):
            assert got.tolist() == want.tolist()
    none = np.zeros(4, bool)  # no row labelled 1: an empty training split, unless engagements
    with pytest.raises(UserError, match="^--labels: no row of rank's split is labelled 1"):
        first_stage_data(ret, str(tmp_path / "ret"), "rank", users, items, none, None)
    data, counts = first_stage_data(ret, str(tmp_path / "ret"), "rank", users, items, none, 0)
    assert counts["labelled"] == 0 and data.num_samples("train") == 3
