"""benchmarks/recommend.py: its hit rates count a user's test item only among a stage's first K,
and its last line is the one scripts read."""


from pathlib import Path

import numpy as np
import pytest

from conftest import load_script


@pytest.fixture(scope="module")
def bench():
    """benchmarks/recommend.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/recommend.py", "recommend_bench")


def test_hit_rates_count_the_test_item_among_each_stages_first_k(bench):
    ranked = np.arange(100, 400)  # the test item 7 at place 30 (0-based) of `merged`
    merged = np.concatenate([np.arange(1000, 1030), [7], np.arange(2000, 2100)])
    stages = [{"pixie": np.array([7, 1]), "two_tower": np.arange(20, 40),
               "history": np.zeros(0, np.int64), "merged": merged, "ranked": ranked},
              {"pixie": np.arange(50), "two_tower": np.array([9] + list(range(10, 60))),
               "history": np.array([3, 4]), "merged": np.array([5, 9]),
               "ranked": np.array([*range(200, 209), 9])}]
    hr = bench.hit_rates(stages, np.array([7, 9]))  # user 1's test item is 9
    assert hr == {"pixie_hr@10": 1.0, "pixie_hr@50": 1.0, "two_tower_hr@10": 0.5,
                  "two_tower_hr@50": 0.5, "history_hr@10": 0.0, "history_hr@50": 0.0,
                  "merged_hr@10": 0.5, "merged_hr@50": 1.0, "ranked_hr@10": 0.5,
                  "ranked_hr@50": 0.5}
    line = bench.summary_line("ml-100k", hr, [float(ms) for ms in range(1, 101)])
    assert line == ("recommend: data=ml-100k hr@10_pixie=1.0000 hr@10_two_tower=0.5000 "
                    "hr@10_history=0.0000 hr@10_merged=0.5000 hr@10_ranked=0.5000 "
                    "p50_ms=50.50 p99_ms=99.01")
    line = bench.summary_line("ml-100k", hr, [1.0], {"pointwise": hr, "listwise":
                                                     {"ranked_hr@10": 0.25}})
    assert line.endswith("hr@10_ranked=0.5000 hr@10_ranked_pointwise=0.5000 "
                         "hr@10_ranked_listwise=0.2500 p50_ms=1.00 p99_ms=1.00")
    three = {"merged_hr@10": 0.5, "first_stage_hr@10": 0.75, "ranked_hr@10": 0.25}
    line = bench.summary_line("ml-100k", hr, [1.0], None, (three, [2.0, 4.0], [1.0, 2.0]),
                              [0.5])
    assert line.endswith("hr@10_ranked=0.5000 p50_ms=1.00 p99_ms=1.00 p50_cpu_ms=0.50 "
                         "p99_cpu_ms=0.50 hr@10_first_stage=0.7500 "
                         "hr@10_ranked_three_stage=0.2500 p50_ms_three_stage=3.00 "
                         "p99_ms_three_stage=3.98 p50_cpu_ms_three_stage=1.50 "
                         "p99_cpu_ms_three_stage=1.99")
    assert bench.value_text({"watched": 0.5, "liked": 1.0, "disliked": -2.0}) == \
        "0.5 P(watched) + 1 P(liked) - 2 P(disliked)"


def test_the_test_items_asked_for_leave_out_re_watches(bench, tmp_path):
    """A test item the user engaged with in train or validation is never returned (seen items
    are left out), so the benchmark does not ask for it (docs/retrieval.md's rule)."""
    from dlrm_hybrid.data.interactions.interaction_data import InteractionData, write_interactions
    from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta

    pairs = {"train": (np.array([0, 0, 1, 2]), np.array([1, 2, 3, 0])),
             "val": (np.array([0, 1, 2]), np.array([3, 0, 4])),
             "test": (np.array([0, 1, 2]), np.array([2, 4, 4]))}  # u0: train's 2; u2: val's 4
    data = InteractionData(InteractionMeta(3, 5), pairs, np.zeros((3, 0), np.int64),
                           np.zeros((5, 0), np.int64))
    write_interactions(data, str(tmp_path / "log"))
    users, items = bench.recommend_choice.findable(tmp_path / "log", "test", ("train", "val"))
    assert users.tolist() == [1] and items.tolist() == [4]
    # validation asks (the ranker's choice) with the training items only as history
    users, items = bench.recommend_choice.findable(tmp_path / "log", "val", ("train",))
    assert users.tolist() == [0, 1, 2] and items.tolist() == [3, 0, 4]
    data.pairs["train"] = (np.array([0, 0, 1, 2]), np.array([1, 3, 3, 0]))  # u0 re-watches 3
    write_interactions(data, str(tmp_path / "log2"))
    users, items = bench.recommend_choice.findable(tmp_path / "log2", "val", ("train",))
    assert users.tolist() == [1, 2] and items.tolist() == [0, 4]


class Made(list):
    def __init__(self):
        super().__init__()
        self.full = []


@pytest.fixture
def made(bench, monkeypatch):
    """The commands the build runs (their first two words; an export: the folder or file it
    writes; `.full`: every command whole), through a stand-in cli that leaves what the real
    one would."""
    made = Made()

    def out_of(command):
        return command[command.index("--out" if "--out" in command else "--output") + 1]

    def cli(command):
        made.full.append(command)
        made.append(command if command[0] in ("predict", "preprocess") and
                    command[1] in ("--model", "first-stage") else
                    command[:2] if command[0] != "export" else ["export",
                                                                Path(out_of(command)).name])
        target = Path(out_of(command)) if "--out" in command or "--output" in command else None
        if target is None:
            return ""
        if command[0] == "predict":
            target.write_text("scores")
            Path(command[command.index("--label-out") + 1]).write_text("0\n1\n")
            return ""
        if command[0] == "export":
            (target.mkdir() if "--retrieval" in command else target.write_text("ranker"))
            return ""
        target.mkdir(parents=True)
        np.save(target / "train_user.npy", np.zeros(5, np.int64))
        for done in ("interactions.yaml", "graph.yaml", "feature_spec.yaml"):
            (target / done).write_text("")
        return ""

    monkeypatch.setattr(bench.recommend_build.retrieval_bench, "cli", cli)
    return made


def test_work_folder_reuses_what_it_holds_and_remakes_what_settings_change(bench, tmp_path,
                                                                          made):
    """--work: a second run makes nothing already made; another candidate ratio makes only its
    ranking dataset and rankers; other tower epochs remake the towers and what reads them."""
    import argparse

    (tmp_path / "u.data").write_text("1\t1\t5\t1\n")
    args = argparse.Namespace(data=str(tmp_path / "u.data"), holdout_recent=10, negatives=7,
                              candidate_ratio=0.75, ranker_data="candidates", epochs=2,
                              tower="two_tower", hstu_epochs=5, ranker_history=0,
                              losses=["pointwise"], ranker_steps=[10, 20])
    build = bench.recommend_build.build
    first = build(args, tmp_path)
    assert [m[0] for m in made].count("train") == 4  # two towers, two rankers
    made.clear()
    assert build(args, tmp_path) == first and made == []
    args.candidate_ratio = 1.0
    again = build(args, tmp_path)
    assert [m[:2] for m in made if m[0] != "export"] == [["preprocess", "interactions"],
                                                         ["train", "--config"],
                                                         ["train", "--config"]]
    assert again["ranking"] != first["ranking"] and again["tower"] == first["tower"]
    made.clear()
    args.epochs = 3
    build(args, tmp_path)
    assert [m[0] for m in made].count("train") == 4 and ["preprocess", "interactions"] in made
    made.clear()
    args.ranker_history = 4  # the sequence rankers: their own dataset and rankers, the towers kept
    history = build(args, tmp_path)
    remade = [m for m in made.full[-len(made):] if m[0] != "export"]
    assert [m[:2] for m in remade] == [["preprocess", "interactions"], ["train", "--config"],
                                       ["train", "--config"]]
    assert "--history" in remade[0] and history["ranking"].endswith("_h4")
    assert all("model.sequence=hstu" in m for m in remade[1:])


def test_work_folder_keeps_what_each_log_made_apart(bench, tmp_path, made):
    """--work: what a log made is kept in a folder named by its bytes, so another log (here
    under the same file name) makes every part again, reads none of the first's (the validation
    world's log included), and a copy of the first log reuses what it made."""
    import argparse
    import os

    first_log, copy = tmp_path / "a/ratings.csv", tmp_path / "b/ratings.csv"
    for path in (first_log, copy):
        path.parent.mkdir()
        path.write_text("userId,movieId,rating,timestamp\n1,1,5,1\n1,2,4,2\n1,3,5,3\n")
    args = argparse.Namespace(data=str(first_log), holdout_recent=10, negatives=7,
                              candidate_ratio=0.75, ranker_data="candidates", epochs=2,
                              tower="two_tower", hstu_epochs=5, ranker_history=0,
                              losses=["pointwise"], ranker_steps=[10])
    build, work = bench.recommend_build.build, tmp_path / "work"
    first = build(args, work)
    world = bench.recommend_build.validation_log(str(first_log), work / "validation_world")
    made.clear()
    args.data = str(copy)
    assert build(args, work) == first and made == []
    assert bench.recommend_build.validation_log(str(copy), work / "validation_world") == world
    stamp = os.stat(first_log).st_mtime_ns
    first_log.write_text("userId,movieId,rating,timestamp\n2,1,5,1\n2,2,4,2\n2,3,5,3\n")
    os.utime(first_log, ns=(stamp, stamp))  # the same size and time: the bytes tell
    args.data = str(first_log)
    second = build(args, work)
    assert [m[0] for m in made].count("train") == 3 and made.count(["pixie", "build"]) == 2
    assert not set(second.values()) & set(first.values())
    other = bench.recommend_build.validation_log(str(first_log), work / "validation_world")
    assert other != world and Path(other).read_text().startswith("2\t")
    assert Path(world).read_text().startswith("1\t")


def test_the_first_stage_learns_the_chosen_ranker_and_value_model(bench, tmp_path, made):
    """The first stage's labels are the chosen ranker's top K under the chosen value model
    (predict --value), with the engagements unless labels-only; each part is named by what it
    depends on: a second run makes nothing, another value model or labels-only remakes only
    what reads it."""
    import argparse

    args = argparse.Namespace(epochs=2, top_k_label=10, first_stage_labels_only=False)
    paths = {"retrieval": str(tmp_path / "retrieval"), "ranking": str(tmp_path / "ranking")}
    np.save(tmp_path / "train_user.npy", np.zeros(5, np.int64))
    ranker = str(tmp_path / "ranking_x_pointwise_600.pt")
    build = bench.recommend_build.build_first_stage
    first = build(args, tmp_path, paths, ranker, {"liked": 1.0})
    predict, preprocess = made[0], made[1]
    assert predict[predict.index("--model") + 1] == ranker
    assert predict[predict.index("--value") + 1] == "liked=1"
    assert predict[predict.index("--top-k-label") + 1] == "10"
    assert predict[predict.index("--split") + 1] == "train"
    assert preprocess[preprocess.index("--labels") + 1] == predict[
        predict.index("--label-out") + 1]
    assert "--engagements" in preprocess
    assert [m[0] for m in made[2:]] == ["train", "export"]
    assert not list(tmp_path.glob("*.scores.csv"))  # predict's scores are not kept
    made.clear()
    assert build(args, tmp_path, paths, ranker, {"liked": 1.0}) == first and made == []
    value = {"watched": 0.5, "liked": 1.0, "disliked": -2.0}
    other = build(args, tmp_path, paths, ranker, value)
    assert other != first and made[0][made[0].index("--value") + 1] == \
        "watched=0.5,liked=1,disliked=-2"
    made.clear()
    args.first_stage_labels_only = True
    alone = build(args, tmp_path, paths, ranker, value)
    assert alone not in (first, other)
    assert [m[:2] for m in made[:1]] == [["preprocess", "first-stage"]]
    assert "--engagements" not in made[0]


def test_the_validation_world_stops_before_each_users_test_item(bench, tmp_path):
    """Its log is the log without each user's last positive (rating >= 4, by time then file
    order: the test item) and that user's later rows, so its test item is the validation item;
    a user too short for a test item keeps every row."""
    log = tmp_path / "u.data"
    rows = [(1, 1, 5, 10), (1, 2, 4, 20), (1, 3, 2, 30), (1, 4, 5, 40), (2, 1, 5, 5),
            (1, 5, 1, 50), (1, 9, 3, 60), (1, 6, 4, 60), (1, 8, 3, 60), (1, 7, 2, 70),
            (2, 2, 4, 90), (2, 3, 1, 95)]  # user 1's test item: 6; user 2: two positives
    log.write_text("".join("\t".join(map(str, r)) + "\n" for r in rows))
    out = bench.recommend_build.validation_log(str(log), tmp_path / "world")
    kept = [tuple(line.split("\t")) for line in Path(out).read_text().splitlines()]
    want = [r for r in rows if r[0] == 2 or r[3] < 60 or r[1] == 9]
    assert kept == [tuple(map(str, r)) for r in want]


def test_the_requests_history_is_the_validation_item_then_the_latest_training_items(bench):
    """The benchmark asks as `recommend --user` reads a stored user (newest first,
    test_candidate_negatives checks that order), the validation item before them; a history
    tower's timeline is the same items oldest first, then the validation item."""
    latest = np.array([10, 12, 11])
    rec = type("Rec", (), {"stored_latest_first": lambda self, user: latest,
                           "retriever": type("R", (), {"history_length": 0})()})()
    history, timeline = bench.recommend_build.asked_history(rec, 1, {1: 7})
    assert history.tolist() == [7, 10, 12, 11] and timeline is None
    rec.retriever.history_length = 4
    history, timeline = bench.recommend_build.asked_history(rec, 1, {1: 7})
    assert history.tolist() == [7, 10, 12, 11] and timeline.tolist() == [11, 12, 10, 7]
    assert bench.recommend_build.asked_history(rec, 2, {1: 7})[0].tolist() == [10, 12, 11]
