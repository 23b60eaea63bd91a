"""`recommend` end to end on a planted log: a two-tower model, a Pixie graph and a multi-task ranker
made from the same log put each target user's planted items first; the value model, the rules
(seen items, blocklist, diversity) each change the list as they must; bad input is one line."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from conftest import failure, run_cli

USERS, ITEMS, CLUSTERS = 300, 120, 4
PER = ITEMS // CLUSTERS
TARGETS = [f"u{u}" for u in range(CLUSTERS)]  # one per cluster: has seen none of its planted items
LIKED = {f"u{c}": {f"i{c * PER + k}" for k in range(3)} for c in range(CLUSTERS)}
DISLIKED = {f"u{c}": {f"i{c * PER + 3 + k}" for k in range(3)} for c in range(CLUSTERS)}
TWO_TOWER = """
model:
  kind: two_tower
  embedding_dim: 16
  user_tower: {mlp: [32, 16]}
  item_tower: {mlp: [32, 16]}
  temperature: 0.1
data: {global_batch_size: 128}
optim: {embedding: rowwise_adagrad, embedding_lr: 0.1, dense: adagrad, dense_lr: 0.05}
train: {max_steps: 150, log_every: 150, eval_every: 0, progress_bar: false}
checkpoint: {resume: none}
"""
RANKER = """
model:
  embedding_dim: 8
  bottom_mlp: [16, 8]
  top_mlp: [16, 1]
  tasks: [{name: watched}, {name: liked}, {name: disliked}]
data: {global_batch_size: 256}
optim: {embedding: rowwise_adagrad, embedding_lr: 0.1, dense: adagrad, dense_lr: 0.05}
train: {max_steps: 200, log_every: 200, eval_every: 0, progress_bar: false}
checkpoint: {resume: none}
value_model: {watched: 0.1, liked: 1.0, disliked: -1.0}
"""
FUNNEL = ["--per-source", "10", "--rank-top", "20"]


def config_with(config: str, changes: dict) -> str:
    """`config` (YAML text) with each dotted key of `changes` ("model.embedding_dim") set."""
    tree = yaml.safe_load(config)
    for key, value in changes.items():
        *parents, last = key.split(".")
        node = tree
        for name in parents:
            node = node.setdefault(name, {})
        node[last] = value
    return yaml.safe_dump(tree)


def planted_log() -> list:
    """(user, item, rating, timestamp, category) rows: each user engages with 8 random items of
    its cluster (rating 3) and, but for the targets, with the cluster's 3 liked (5) and 3
    disliked (1) items; an item's category is its place in the cluster mod 3."""
    rng = np.random.default_rng(0)
    rows = []
    for u in range(USERS):
        base = (u % CLUSTERS) * PER
        events = [(i, 3) for i in base + 6 + rng.choice(PER - 6, 8, replace=False)]
        if f"u{u}" not in TARGETS:
            events += [(base + k, 5) for k in range(3)] + [(base + 3 + k, 1) for k in range(3)]
        rng.shuffle(events)
        rows += [(f"u{u}", f"i{i}", r, len(rows) + n, f"c{(i - base) % 3}")
                 for n, (i, r) in enumerate(events)]
    return rows


def cli(*args: str):
    result = run_cli(list(args))
    assert result.returncode == 0, failure(result)
    return result


def build_funnel(root: Path) -> list:
    """The planted log in `root`, its retrieval (ret) and ranking (rank) datasets, a tiny
    two-tower model (R) and multi-task ranker (M.pt) trained on them and exported, and the
    Pixie graph (G) of the retrieval dataset: the log's rows."""
    rows = planted_log()
    (root / "log.csv").write_text("".join(",".join(map(str, r)) + "\n" for r in rows))
    read = ["preprocess", "interactions", "--input", str(root / "log.csv"),
            "--columns", "user,item,rating,timestamp,item:category"]
    cli(*read, "--positive", "rating>=1", "--output", str(root / "ret"))
    cli(*read, "--labels", "watched,liked:rating>=4,disliked:rating<=2",
        "--ranking-negatives", "2", "--output", str(root / "rank"))
    for name, config, data in (("tt", TWO_TOWER, "ret"), ("rk", RANKER, "rank")):
        (root / f"{name}.yaml").write_text(config)
        cli("train", "--config", str(root / f"{name}.yaml"), "--set", f"data.path={root / data}",
            "--set", f"train.run_dir={root / name}")
    cli("export", "--checkpoint", str(root / "tt/checkpoints/step_150"), "--out",
        str(root / "R"), "--retrieval")
    cli("export", "--checkpoint", str(root / "rk/checkpoints/step_200"), "--out",
        str(root / "M.pt"))
    cli("pixie", "build", "--data", str(root / "ret"), "--out", str(root / "G"))
    return rows


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The log's retrieval and ranking datasets, a tiny two-tower model and multi-task ranker
    trained on them and exported, and the Pixie graph of the retrieval dataset."""
    root = tmp_path_factory.mktemp("recommend")
    rows = build_funnel(root)
    by_user = {}
    for user, item, _, _, _ in rows:  # in time order: the last two are validation and test
        by_user.setdefault(user, []).append(item)
    return SimpleNamespace(root=root, category={i: c for _, i, _, _, c in rows},
                           seen={u: set(items[:-2]) for u, items in by_user.items()},
                           inputs=["--retrieval", str(root / "R"), "--pixie", str(root / "G"),
                                   "--ranker", str(root / "M.pt")])


def recommend(served, *args: str) -> dict:
    """One user's answer (--json)."""
    return json.loads(cli("recommend", *served.inputs, *args, "--json").stdout)


def batch(served, name: str, *args: str) -> list:
    """A batch over the targets (a byte-order mark, blank lines), the JSON lines read back."""
    users = served.root / "users.txt"
    users.write_bytes(b"\xef\xbb\xbf" + "\n\n".join(TARGETS).encode() + b"\n\n")
    out = served.root / name
    mine = Path(f"{out}.partial")  # a file of the user's that only looks like a temporary one
    mine.write_text("mine")
    result = cli("recommend", *served.inputs, "--users", str(users), "--out", str(out), *args)
    assert f"users={len(TARGETS)}" in result.stdout and mine.read_text() == "mine"
    assert not list(served.root.glob(f".{name}.partial*"))  # the temporary file is gone
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_planted_items_first_by_the_value_model_and_same_seed_same_lists(served):
    answers = batch(served, "liked.jsonl", *FUNNEL)
    assert [a["user"] for a in answers] == TARGETS
    for a in answers:  # the ranker's value (liked - disliked) puts the unseen liked items first
        assert set(a["items"][:3]) == LIKED[a["user"]], a
        counts = a["candidates"]
        assert len(a["items"]) == counts["ranked"] == min(counts["merged"], 20)
        assert all(a["sources"]) and max(counts["two_tower"], counts["pixie"]) <= 10
    for a in batch(served, "disliked.jsonl", *FUNNEL, "--value", "disliked=1"):
        assert set(a["items"][:3]) == DISLIKED[a["user"]], a  # other weights: other items
    again = batch(served, "again.jsonl", *FUNNEL)
    for a in (*answers, *again):
        del a["ms"]
    assert again == answers


def test_one_user_lines_and_summary(served):
    lines = cli("recommend", *served.inputs, "--user", "u1", "--k", "3",
                *FUNNEL).stdout.splitlines()
    assert {line.split("\t")[0] for line in lines[:3]} == LIKED["u1"]
    name, value, probabilities, sources = lines[0].split("\t")
    assert [p.split("=")[0] for p in probabilities.split()] == ["watched", "liked", "disliked"]
    assert set(sources.split(",")) <= {"two_tower", "history", "pixie"}
    summary = dict(f.split("=") for f in lines[3].split()[1:])
    assert lines[3].startswith("recommend: user=u1") and summary["returned"] == "3"
    assert {"ms_two_tower", "ms_pixie", "ms_rank", "ms_rules"} <= set(summary)


def test_seen_items_dropped_unless_kept(served):
    wide = ["--per-source", "200", "--rank-top", "300", "--k", "120", "--diversity", "off"]
    dropped = recommend(served, "--user", "u0", *wide)
    kept = recommend(served, "--user", "u0", *wide, "--keep-seen")
    seen = served.seen["u0"]
    assert not seen & set(dropped["items"]) and len(dropped["items"]) == ITEMS - len(seen)
    assert seen <= set(kept["items"]) and len(kept["items"]) == ITEMS


def test_blocklist_and_an_unknown_blocked_item_warns(served):
    blocked = served.root / "blocked.txt"
    blocked.write_text("i0\nnot_an_item\n\n")
    result = cli("recommend", *served.inputs, "--user", "u0", *FUNNEL, "--blocklist",
                 str(blocked), "--json")
    items = json.loads(result.stdout)["items"]
    assert "i0" not in items and set(items[:2]) == LIKED["u0"] - {"i0"}
    assert result.stderr.startswith("warning: --blocklist: 1 items") and "'not_an_item'" in \
        result.stderr


def test_reciprocal_rank_fusion_orders_by_the_summed_reciprocal_ranks():
    """Each item scores sum_s 1 / (60 + its rank in s): found twice low beats found once first;
    ties in the order first found, by the sources' order."""
    from dlrm_hybrid.serve.rank_fusion import merge

    lists = {"two_tower": np.array([5, 1, 2]), "history": np.array([2, 7]),
             "pixie": np.array([1, 9, 5, 4])}
    # 1: 1/62 + 1/61; 5: 1/61 + 1/63 = 2: 1/63 + 1/61 (5 found first); 7 = 9: 1/62; 4: 1/64
    order, found_by = merge(lists)
    assert order.tolist() == [1, 5, 2, 7, 9, 4]
    assert found_by == {5: ["two_tower", "pixie"], 1: ["two_tower", "pixie"],
                        2: ["two_tower", "history"], 7: ["history"], 9: ["pixie"], 4: ["pixie"]}
    assert merge({"pixie": np.array([3, 8])})[0].tolist() == [3, 8]  # one source: its order


def test_fusion_weights_scale_each_sources_reciprocal_ranks():
    """sum_s w_s / (60 + rank): a heavier source's items rise; weight 0 keeps a source's
    items (and who found them) but after every item a weighted source found, in found order."""
    from dlrm_hybrid.serve.rank_fusion import merge

    lists = {"two_tower": np.array([5, 1, 2]), "history": np.array([2, 7]),
             "pixie": np.array([1, 9, 5, 4])}
    # 5: 2/61 + 1/63; 1: 2/62 + 1/61; 2: 2/63 + 1/61; 7: 1/62; 9: 1/62; 4: 1/64
    assert merge(lists, {"two_tower": 2.0})[0].tolist() == [5, 1, 2, 7, 9, 4]
    order, found_by = merge(lists, {"history": 0.0, "pixie": 0.0})
    assert order.tolist() == [5, 1, 2, 7, 9, 4] and found_by == merge(lists)[1]
    assert merge(lists, {"two_tower": 0.0})[0].tolist() == [1, 2, 7, 9, 5, 4]  # ties: found


def test_a_stages_order_fused_with_the_order_it_was_handed():
    """with_prior: 1 / (60 + own rank) + prior / (60 + incoming rank); prior 0 keeps the
    stage's own order, a large prior gives the incoming order back, inf gives it exactly."""
    from dlrm_hybrid.serve.rank_fusion import with_prior

    incoming, own = np.array([4, 8, 1, 6]), np.array([6, 1, 4, 8])
    assert with_prior(own, incoming, 0.0).tolist() == [0, 1, 2, 3]
    assert own[with_prior(own, incoming, 1000.0)].tolist() == incoming.tolist()
    # prior 1: 4: 1/63 + 1/61 > 6: 1/61 + 1/64 > 1: 1/62 + 1/63 > 8: 1/64 + 1/62
    assert own[with_prior(own, incoming, 1.0)].tolist() == [4, 6, 1, 8]
    assert own[with_prior(own, incoming, 1.5)].tolist() == [4, 1, 6, 8]
    assert own[with_prior(own, incoming, 0.1)].tolist() == own.tolist()
    assert own[with_prior(own, incoming, float("inf"))].tolist() == incoming.tolist()
    # a first stage's cut: its own order of more items than it keeps, the merged order's first
    merged, scored = np.arange(10, 0, -1), np.arange(1, 11)
    assert scored[with_prior(scored, merged, float("inf"))[:3]].tolist() == [10, 9, 8]


def test_the_ranker_gets_the_fused_candidates_best_first(served):
    """With a value model that ties every item (weight 0), `recommend` returns the merged list
    itself: the reciprocal-rank fusion of what `retrieve` answers by the user tower and by the
    user's history, each source's 10 best."""
    rrf, lists = {}, []
    user = "u0"
    for by in ([], ["--history", ",".join(sorted(served.seen[user]))]):
        lists.append(json.loads(cli("retrieve", "--model", str(served.root / "R"), "--user", user,
                                    *by, "--k", "10", "--json").stdout)["items"])
        for rank, item in enumerate(lists[-1], 1):
            rrf[item] = rrf.get(item, 0.0) + 1.0 / (60 + rank)

    def ask(*args: str) -> list:
        return recommend(served, "--user", user, "--sources", "two_tower,history",
                         "--per-source", "10", "--rank-top", "20", "--k", "20", "--diversity",
                         "off", *args)["items"]

    got = ask("--value", "watched=0")
    assert sorted(got) == sorted(rrf)
    assert [rrf[i] for i in got] == sorted(rrf.values(), reverse=True)
    assert len(set(rrf.values())) > 5  # the order is the fusion's, not ties'
    alone = ask("--value", "watched=0", "--fusion", "history=0")
    assert alone[:10] == lists[0] and sorted(alone) == sorted(rrf)  # history's items after
    ranked, prior, keep = ask(), ask("--rank-prior", "1000"), ask("--rank-prior", "inf")
    assert ranked != got and prior == got == keep  # a large prior: the order it was handed


def test_items_keep_their_own_value_and_probabilities_when_a_prior_reorders_them(served):
    """A prior reorders the ranked items; each still prints the value and task probabilities
    the ranker gave it (the prior-0 answer's, item by item), not those of the item that held
    its place."""
    def ask(*args: str) -> tuple:
        answer = recommend(served, "--user", "u2", *FUNNEL, "--k", "20", "--diversity", "off",
                           *args)
        return {item: (answer["values"][n], [answer["probabilities"][t][n] for t in
                                             ("watched", "liked", "disliked")])
                for n, item in enumerate(answer["items"])}, answer["items"]

    own, own_order = ask()
    assert [own[i][0] for i in own_order] == sorted((v for v, _ in own.values()), reverse=True)
    for prior in ("1", "inf"):
        fused, order = ask("--rank-prior", prior)
        assert order != own_order and sorted(order) == sorted(own_order)
        assert fused == own, prior


def test_diversity_no_two_of_a_category_in_a_row(served):
    def repeats(ranked):  # two of a category in a row in the first 8
        categories = [served.category[i] for i in ranked["items"][:8]]
        return any(a == b for a, b in zip(categories, categories[1:]))

    for user in ("u2", "u0", "u1", "u3", "u4"):  # the first whose ranked list repeats
        ranked = recommend(served, "--user", user, *FUNNEL, "--k", "20", "--diversity", "off")
        if repeats(ranked):
            break
    assert repeats(ranked)  # off: repeats
    diverse = recommend(served, "--user", user, *FUNNEL, "--k", "8")["items"]
    values = ranked["values"]
    assert values == sorted(values, reverse=True)
    left, want = list(ranked["items"]), []  # greedily the best of another category
    while len(want) < 8:
        pick = next(i for i in left if not want or served.category[i] != served.category[want[-1]])
        want.append(pick)
        left.remove(pick)
    assert diverse == want


@pytest.fixture(scope="module")
def broken(served):
    """Inputs that do not fit: ranking datasets with a user or item renamed or a feature's size
    changed, a graph without categories, a graph of another dataset, a single-task ranker."""
    root = served.root
    (root / "users.txt").write_text("\n".join(TARGETS) + "\n")
    (root / "users_bad.txt").write_text("u0\n\nnobody\n")
    for name, path, old, new in (("user", "users.txt", "u5\n", "v5\n"),
                                 ("item", "items.txt", "i7\n", "j7\n"),
                                 ("size", "feature_spec.yaml", "cardinality: 120",
                                  "cardinality: 121")):
        shutil.copytree(root / "rank", root / f"rank_{name}")
        text = (root / f"rank_{name}" / path).read_text()
        assert old in text
        (root / f"rank_{name}" / path).write_text(text.replace(old, new, 1))
    shutil.copytree(root / "rank", root / "rank_cut")  # a copy cut short
    cut = root / "rank_cut" / "train" / "cat_1.bin"
    cut.write_bytes(cut.read_bytes()[:-7])
    shutil.copytree(root / "G", root / "G_plain")
    (root / "G_plain" / "item_category.npy").unlink()
    cli("preprocess", "interactions", "--input", str(root / "log.csv"), "--columns",
        "user,item,rating,timestamp,item:category", "--positive", "rating>=3", "--output",
        str(root / "ret3"))
    cli("pixie", "build", "--data", str(root / "ret3"), "--out", str(root / "G3"))
    cli("pixie", "build", "--data", str(root / "ret"), "--out", str(root / "G_val"), "--splits",
        "train,val")
    cli("train", "--config", "configs/demo.yaml", "--set", "train.max_steps=1", "--set",
        "data.val_samples=256", "--set", "train.progress_bar=false", "--set",
        "checkpoint.resume=none", "--set", f"train.run_dir={root / 'demo'}")
    cli("export", "--checkpoint", str(root / "demo/checkpoints/step_1"), "--out",
        str(root / "demo.pt"))
    return root


def ranker_with_description(served, name: str, edit) -> Path:
    """A copy of the served ranker M.pt, named `name`, whose stored description (model.json
    inside the file) `edit` changed in place."""
    with zipfile.ZipFile(served.root / "M.pt") as source, \
            zipfile.ZipFile(served.root / name, "w") as copy:
        for entry in source.infolist():
            text = source.read(entry)
            if entry.filename.endswith("/extra/model.json"):
                description = json.loads(text)
                edit(description)
                text = json.dumps(description).encode()
            copy.writestr(entry, text)
    return served.root / name


def test_a_ranker_description_without_its_data_asks_for_ranker_data(served):
    """An older export's description (stored in the file) does not name the ranker's dataset."""
    data = []
    ranker_with_description(served, "old.pt", lambda d: data.append(d["source"].pop("data")))
    assert data == [str(served.root / "rank")]
    args = ["--retrieval", str(served.root / "R"), "--pixie", str(served.root / "G"),
            "--user", "u0"]
    result = run_cli(["recommend", *args, "--ranker", str(served.root / "old.pt")])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: --ranker-data: ")
    result = run_cli(["recommend", *args, "--ranker", str(served.root / "old.pt"),
                      "--ranker-data", str(served.root / "rank"), *FUNNEL, "--k", "3"])
    assert result.returncode == 0, failure(result)
    assert {line.split("\t")[0] for line in result.stdout.splitlines()[:3]} == LIKED["u0"]


def test_a_ranker_exported_with_a_relative_data_path_names_it_whole(served, tmp_path):
    """export records the dataset it read as a whole path: `recommend` run from another folder
    would otherwise read a relative path's namesake there, another dataset, silently."""
    result = run_cli(["export", "--checkpoint", str(served.root / "rk/checkpoints/step_200"),
                      "--out", str(tmp_path / "M.pt"), "--set", "data.path=rank"],
                     cwd=served.root)
    assert result.returncode == 0, failure(result)
    description = json.loads((tmp_path / "M.json").read_text())
    assert description["source"]["data"] == str(served.root / "rank")


def test_a_ranker_trained_on_a_relative_path_is_not_read_from_another_folder(served):
    """A ranker trained with `data.path=rank` in its own folder names its dataset `rank`: asked
    from another folder, that path is not the dataset, and the error says so (it read like a
    flag the user had given wrongly)."""
    ranker_with_description(served, "relative.pt", lambda d: d["source"].update(data="rank"))
    result = run_cli(["recommend", "--retrieval", str(served.root / "R"), "--pixie",
                      str(served.root / "G"), "--user", "u0", "--ranker",
                      str(served.root / "relative.pt")])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: --ranker-data: {served.root}/relative.pt names its "
                                    f"dataset rank, a path relative to where it was trained"), \
        result.stderr


BAD = [
    (["--user", "nobody"], "--user: unknown user 'nobody': not in the retrieval model's"),
    (["--user", "u5", "--ranker-data", "{root}/rank_user"],
     "--user: 'u5' is not in {root}/rank_user/users.txt"),
    (["--user", "u0", "--history", "i1,nope"], "--history: unknown item 'nope'"),
    (["--user", "u0", "--pixie", "{root}/G3"], "--pixie: {root}/G3 was built from another"),
    (["--user", "u0", "--ranker-data", "{root}/rank_size"],
     "--ranker: {root}/M.pt was trained on other data than {root}/rank_size"),
    (["--user", "u0", "--ranker-data", "{root}/rank_cut"],
     "--ranker-data: {root}/rank_cut/train/cat_1.bin: "),
    (["--user", "u0", "--ranker-data", "{root}/rank_item"],
     "--ranker: 1 of the retrieval model's items are not in {root}/rank_item/items.txt"),
    (["--user", "u0", "--ranker", "{root}/demo.pt"], "--ranker: {root}/demo.pt is not a multi"),
    (["--user", "u0", "--ranker", "{root}/gone.pt"], "--ranker: {root}/gone.pt does not exist"),
    (["--user", "u0", "--retrieval", "{root}/ret"], "--retrieval: {root}/ret has no retrieval"),
    (["--user", "u0", "--pixie", "{root}/G_plain", "--diversity", "on"],
     "--diversity on: {root}/G_plain has no item categories"),
    (["--user", "u0", "--value", "loved=1"], "--value: no task 'loved'"),
    (["--user", "u0", "--k", "0"], "--k: must be at least 1"),
    (["--user", "u0", "--sources", "two_tower,graph"], "--sources: 'two_tower,graph'; give"),
    (["--user", "u0", "--k", "30", "--rank-top", "20"], "--rank-top: 20 is less than --k 30"),
    (["--user", "u0", "--fusion", "pixie"], "--fusion: 'pixie'; write SOURCE=WEIGHT"),
    (["--user", "u0", "--fusion", "graph=1"], "--fusion: graph is not a source of --sources"),
    (["--user", "u0", "--sources", "pixie", "--fusion", "pixie=0"],
     "--fusion: weights must be 0 or more and one above 0"),
    (["--user", "u0", "--fusion", "history=-1"], "--fusion: weights must be 0 or more"),
    (["--user", "u0", "--fusion", "history=1,history=0"], "--fusion: history is given twice"),
    (["--user", "u0", "--value", "liked=1, liked=2"], "--value: liked is given twice"),
    (["--user", "u0", "--rank-prior", "-0.5"], "--rank-prior: must be 0 or more (inf: keep "
                                                "the incoming order), got -0.5"),
    (["--user", "u0", "--rank-prior", "nan"], "--rank-prior: must be 0 or more (inf: keep the "
                                              "incoming order), got nan"),
    (["--user", "u0", "--first-stage-prior", "2"], "recommend: --first-stage-prior weighs"),
    (["--users", "{root}/users.txt"], "recommend: --users needs --out"),
    (["--user", "u0", "--memboost-weight", "1"], "--memboost-weight: give --memboost STATS"),
    (["--user", "u0", "--memboost-weight", "-1"], "--memboost-weight: must be a number 0 or "
                                                  "more"),
    (["--user", "u0", "--random-share", "1.5"], "--random-share: must be between 0 and 1"),
    (["--user", "u0", "--memboost", "{root}/users.txt"], "--memboost: {root}/users.txt: not "
                                                         "Memboost statistics"),
    (["--user", "u0", "--log-impressions", "{root}/R/users.txt"],
     "recommend: --log-impressions {root}/R/users.txt would replace a file inside --retrieval"),
    (["--users", "{root}/users_bad.txt", "--out", "{root}/lists_bad.jsonl"],
     "--users: {root}/users_bad.txt: unknown user 'nobody': not in the retrieval model's"),
    (["--users", "{root}/users.txt", "--out", "{root}/rank/users.txt"],  # the ranker's, unnamed
     "recommend: --out {root}/rank/users.txt would replace a file inside --ranker-data "
     "{root}/rank"),
    (["--users", "{root}/users.txt", "--out", "{root}/R/users.txt"],
     "recommend: --out {root}/R/users.txt"),
]


@pytest.mark.parametrize("args, says", BAD, ids=[b[1].split(":")[0] + str(n)
                                                 for n, b in enumerate(BAD)])
def test_bad_input_is_one_line(served, broken, args, says):
    root = str(served.root)
    args = [a.format(root=root) for a in args]
    flags = {a for a in args if a.startswith("--")}
    inputs = [a for pair in zip(served.inputs[::2], served.inputs[1::2]) if pair[0] not in flags
              for a in pair]
    before = sorted(p.name for p in served.root.iterdir())
    result = run_cli(["recommend", *inputs, *args])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
    assert result.stderr.startswith(f"error: {says.format(root=root)}"), result.stderr
    assert sorted(p.name for p in served.root.iterdir()) == before  # nothing written


TUNE_BAD = [
    (["--pixie", "{root}/G_val"], "--pixie: the graph holds the val split's engagements "
                                  "(graph.yaml splits: train, val), the pairs chosen on"),
    (["--users", "-1"], "recommend-tune: --users must be 0 (all) or more, got -1"),
    (["--users", "1"], "recommend-tune: the validation pairs asked are of one user"),
    (["--out", "{root}/rank/users.txt"], "recommend-tune: --out {root}/rank/users.txt would "
                                         "replace a file inside --ranker-data {root}/rank"),
    (["--out", "{root}/ret/users.txt"], "recommend-tune: --out {root}/ret/users.txt would "
                                        "replace a file inside --data {root}/ret"),
]


@pytest.mark.parametrize("args, says", TUNE_BAD, ids=["graph_with_val", "users_below_0",
                                                      "one_user", "out_in_ranker_data",
                                                      "out_in_data"])
def test_recommend_tune_refuses_what_would_choose_on_leaked_or_no_pairs(served, broken, args,
                                                                        says):
    """A graph that walked the validation engagements finds each held-out item through the
    user's own edge (HR@10 0.72 -> 0.79 on this log); a negative --users dropped the last
    users; one user leaves the half that judges the ranker's prior empty; the datasets the
    ranker and the retrieval model name are inputs too, never written over."""
    root = str(served.root)
    args = [a.format(root=root) for a in args]
    inputs = [a for pair in zip(served.inputs[::2], served.inputs[1::2]) if pair[0] not in args
              for a in pair]
    out = served.root / "tuned_bad.yaml"
    datasets = {p: p.read_bytes() for p in (*served.root.glob("rank/*.*"),
                                            *served.root.glob("ret/*.*"))}
    result = run_cli(["recommend-tune", *inputs, *FUNNEL, "--out", str(out), *args])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
    assert result.stderr.startswith(f"error: {says.format(root=root)}"), result.stderr
    assert not out.exists()
    assert all(p.read_bytes() == data for p, data in datasets.items())


def test_a_settings_file_serves_only_the_models_it_was_tuned_with(served):
    """The file's choices belong to its retrieval model as to its ranker: another retrieval
    folder (here the same checkpoint exported again) is refused as another ranker is, and a
    ranker the file names that is gone is named with the file, not as `--model`."""
    from dlrm_hybrid.serve.funnel_settings import FORMAT, write_settings

    root = served.root
    cli("export", "--checkpoint", str(root / "tt/checkpoints/step_150"), "--out",
        str(root / "R_again"), "--retrieval")
    tuned = {"format": FORMAT, "ranker": str(root / "M.pt"), "retrieval": str(root / "R"),
             "settings": {"per_source": 10, "rank_top": 20}}
    write_settings(root / "tuned_R.yaml", tuned)
    write_settings(root / "tuned_gone.yaml", {**tuned, "ranker": str(root / "gone.pt")})
    ask = ["recommend", "--pixie", str(root / "G"), "--user", "u0", "--k", "3"]
    assert run_cli([*ask, "--retrieval", str(root / "R"), "--settings",
                    str(root / "tuned_R.yaml")]).returncode == 0
    for settings, retrieval, says in (
            ("tuned_R.yaml", "R_again", f"--retrieval: {root}/R_again is not what --settings "
                                        f"{root}/tuned_R.yaml was tuned with ({root}/R)"),
            ("tuned_gone.yaml", "R", f"--settings: {root}/tuned_gone.yaml: its ranker "
                                     f"{root}/gone.pt does not exist")):
        result = run_cli([*ask, "--retrieval", str(root / retrieval), "--settings",
                          str(root / settings)])
        assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
        assert result.stderr.startswith(f"error: {says}"), result.stderr


def test_a_history_tower_source_reads_the_history_given_with_the_request(served):
    """With a history user tower (model.user_tower.encoder), the two_tower source is the
    tower over the request's history (given most recent first, read oldest first), else over
    the user's stored training items in time order."""
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    root = served.root
    cli("train", "--config", str(root / "tt.yaml"), "--set", f"data.path={root / 'ret'}",
        "--set", f"train.run_dir={root / 'th'}", "--set", "train.max_steps=20",
        "--set", "model.user_tower.encoder=history_attention",
        "--set", "model.user_tower.history_length=6")
    cli("export", "--checkpoint", str(root / "th/checkpoints/step_20"), "--out",
        str(root / "RH"), "--retrieval", "--index", "flat")
    rec = Recommender(str(root / "RH"), str(root / "G"), str(root / "M.pt"),
                      settings=RecommendSettings(k=5, per_source=10, rank_top=20))
    retriever, user = rec.retriever, rec.retriever.user_of["u5"]
    given = ["i3", "i40", "i17"]  # most recent first
    answer = rec.recommend("u5", given)
    dense = np.array([retriever.item_of[i] for i in given])
    exclude = np.union1d(retriever.seen(user), dense)
    [(want, _)] = retriever.for_histories([dense[::-1]], 10, False, [exclude])
    assert np.array_equal(answer.stages["two_tower"], want)
    [(backwards, _)] = retriever.for_histories([dense], 10, False, [exclude])
    assert not np.array_equal(backwards, want)  # the order is read
    stored = rec.recommend("u5").stages["two_tower"]
    [(from_log, _)] = retriever.for_users(np.array([user]), 10,
                                          exclude=[retriever.seen(user)])
    assert np.array_equal(stored, from_log) and not np.array_equal(stored, want)


SLOTS = 4  # the sequence ranker's history


@pytest.fixture(scope="module")
def sequence_ranker(served):
    """A ranker with the sequence feature (model.sequence hstu) on the log's ranking dataset
    made with --history SLOTS, exported: the funnel's inputs with it as the ranker."""
    root = served.root
    cli("preprocess", "interactions", "--input", str(root / "log.csv"), "--columns",
        "user,item,rating,timestamp,item:category", "--labels",
        "watched,liked:rating>=4,disliked:rating<=2", "--ranking-negatives", "2",
        "--history", str(SLOTS), "--output", str(root / "rank_h"))
    (root / "sq.yaml").write_text(config_with(RANKER, {"model.sequence": "hstu",
                                                       "model.hstu.dropout": 0.0}))
    cli("train", "--config", str(root / "sq.yaml"), "--set", f"data.path={root / 'rank_h'}",
        "--set", f"train.run_dir={root / 'sq'}", "--set", "train.max_steps=60")
    cli("export", "--checkpoint", str(root / "sq/checkpoints/step_60"), "--out",
        str(root / "S.pt"))
    return [*served.inputs[:4], "--ranker", str(root / "S.pt")]


def test_a_sequence_ranker_scores_each_candidate_with_the_users_latest_history(
        served, sequence_ranker):
    """`recommend` with the sequence ranker: each candidate's row carries the user's last SLOTS
    engagements as the log has them (actions 1 + watched 1 + liked 2 + disliked 4), and its
    probabilities are the exported model's on those rows."""
    import torch

    from dlrm_hybrid.serve.predict import load_scoring_model
    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    answer = json.loads(cli("recommend", *sequence_ranker, "--user", "u5", *FUNNEL,
                            "--json").stdout)
    features = RankingFeatures(str(served.root / "rank_h"))
    items = np.array([features.item_of[i] for i in answer["items"]])
    dense, ids = features.rows(features.user_of["u5"], items)
    names, rows = features.names, planted_log()
    mine = [r for r in rows if r[0] == "u5"][-SLOTS:]  # the log is in time order
    for j, (_, item, rating, _, _) in enumerate(mine):
        assert (ids[:, names.index(f"user_history{j}")] == features.item_of[item]).all()
        action = 2 + 2 * (rating >= 4) + 4 * (rating <= 2)
        assert (ids[:, names.index(f"user_action{j}")] == action).all()
    assert (ids[:, names.index("item_id")] == items).all()
    module, _ = load_scoring_model(served.root / "S.pt")
    with torch.no_grad():
        probabilities = module(torch.from_numpy(dense), torch.from_numpy(ids)).numpy()
    for t, task in enumerate(("watched", "liked", "disliked")):
        np.testing.assert_allclose(answer["probabilities"][task], probabilities[:, t],
                                   atol=2e-6)


def test_a_request_made_earlier_reads_the_history_before_it(served, sequence_ranker):
    from dlrm_hybrid.serve.ranking_features import RankingFeatures

    features = RankingFeatures(str(served.root / "rank_h"))
    mine = [r for r in planted_log() if r[0] == "u7"]
    at = mine[-2][3]  # the time of the user's second-to-last engagement: it and later unread
    _, ids = features.rows(features.user_of["u7"], np.arange(2), at=at)
    history = [features.item_names[ids[0, features.names.index(f"user_history{j}")]]
               for j in range(SLOTS)]
    assert history == [r[1] for r in mine[:-2]][-SLOTS:]


def memboost_log(path: Path, boosted: dict) -> None:
    """An impression log: for each user of `boosted` three random-order requests showing its
    item first, clicked each time, and one showing it second, beside an item of no clicks;
    position 1's curve from them and from 40 requests of other items clicked one time in four."""
    rows = ["request\ttime\tquery_kind\tquery\titem\tposition\trandom\tclicked"]
    for n, (user, item) in enumerate(sorted(boosted.items())):
        for r in range(3):
            rows.append(f"b{n}-{r}\t{n}\tuser\t{user}\t{item}\t1\t1\t1")
        rows += [f"c{n}\t{n}\tuser\t{user}\ti0\t1\t1\t0",
                 f"c{n}\t{n}\tuser\t{user}\t{item}\t2\t1\t1"]
    for r in range(40):
        rows.append(f"o{r}\t{r}\tuser\tzz\ti{r % 7}\t1\t1\t{int(r % 4 == 0)}")
    path.write_text("\n".join(rows) + "\n")


def test_memboost_lifts_an_engaged_item_and_recommend_logs_what_it_showed(served):
    """`recommend --memboost S --memboost-weight G` adds G x MB to the value (the item clicked
    wherever it was shown comes first; with a rank prior each item keeps its own MB); weight 0
    leaves the list as it was; --log-impressions appends the rows `memboost update` reads,
    --random-share 1 shows the same items in random order and logs them so."""
    from dlrm_hybrid.serve.memboost import load_stats

    root = served.root
    log = root / "shown.tsv"
    plain = recommend(served, "--user", "u1", *FUNNEL, "--k", "5", "--log-impressions", str(log))
    last = plain["items"][-1]
    memboost_log(root / "mb.tsv", {"u1": last})
    cli("memboost", "update", "--impressions", str(root / "mb.tsv"), "--out", str(root / "S.npz"))
    boosted = recommend(served, "--user", "u1", *FUNNEL, "--k", "5", "--memboost",
                        str(root / "S.npz"), "--memboost-weight", "100")
    assert boosted["items"][0] == last and boosted["memboost"][0] > 0.3
    assert boosted["values"][0] > plain["values"][0] + 30  # value + 100 x MB
    still = recommend(served, "--user", "u1", *FUNNEL, "--k", "5", "--memboost",
                      str(root / "S.npz"))
    assert still["items"] == plain["items"] and still["values"] == plain["values"]
    fused = recommend(served, "--user", "u1", *FUNNEL, "--k", "5", "--memboost",
                      str(root / "S.npz"), "--memboost-weight", "1", "--rank-prior", "1")
    mb = load_stats(str(root / "S.npz")).scores("user", "u1", fused["items"])
    assert fused["memboost"] == pytest.approx(mb.tolist(), abs=1e-6) and mb.any()
    shuffled = [recommend(served, "--user", "u1", *FUNNEL, "--k", "5", "--random-share", "1",
                          "--seed", str(s), "--log-impressions", str(log)) for s in range(4)]
    assert all(sorted(a["items"]) == sorted(plain["items"]) and a["random_order"]
               for a in shuffled)
    assert any(a["items"] != plain["items"] for a in shuffled)
    rows = [line.split("\t") for line in log.read_text().splitlines()[1:]]
    assert len(rows) == 25 and [r[4] for r in rows[:5]] == plain["items"]
    assert [r[5] for r in rows[:5]] == ["1", "2", "3", "4", "5"]
    assert {r[6] for r in rows[:5]} == {"0"} and {r[6] for r in rows[5:]} == {"1"}
    assert {(r[2], r[3], r[7]) for r in rows} == {("user", "u1", "0")}
    said = cli("memboost", "update", "--impressions", str(log), "--stats", str(root / "S.npz"),
               "--out", str(root / "S2.npz")).stdout
    assert "rows_added=25" in said and "logs=2" in said
    lists = batch(served, "mb.jsonl", *FUNNEL, "--k", "5", "--log-impressions",
                  str(root / "batch.tsv"))  # a batch's rows: each user's list, in one write
    rows = [line.split("\t") for line in (root / "batch.tsv").read_text().splitlines()[1:]]
    assert [(r[3], r[4]) for r in rows] == [(a["user"], i) for a in lists for i in a["items"]]
    assert len({r[0] for r in rows}) == len(TARGETS)


def test_one_request_commands_of_one_seed_do_not_all_draw_the_same_random_order(served):
    """`recommend --user` serves one request per process: its random-order draws must differ
    between two such processes of one --seed (they drew alike: at seed 0 and a share of 0.05
    no request was ever shown in random order)."""
    from dlrm_hybrid.serve.recommender import Recommender, RecommendSettings

    settings = RecommendSettings(k=5, per_source=10, rank_top=20, random_share=0.05)
    draws = [Recommender(*served.inputs[1::2], settings=settings).shuffle.random(20)
             for _ in range(2)]
    assert not np.array_equal(*draws)


def test_recommend_tune_chooses_the_memboost_weight_recommend_reads(served):
    """`recommend-tune --memboost S` chooses gamma on the validation pairs: statistics that
    engage each user's validation item lift HR@1, so a weight above 0 is chosen and written
    with the statistics; `recommend --settings` reads both."""
    import yaml

    root = served.root
    by_user: dict = {}
    for user, item, _, _, _ in planted_log():
        by_user.setdefault(user, []).append(item)
    memboost_log(root / "val.tsv", {u: items[-2] for u, items in by_user.items()})
    cli("memboost", "update", "--impressions", str(root / "val.tsv"), "--out",
        str(root / "V.npz"))
    out = root / "tuned.yaml"
    said = cli("recommend-tune", *served.inputs, *FUNNEL, "--k", "1", "--users", "120",
               "--steps", "2000", "--memboost", str(root / "V.npz"), "--out", str(out)).stdout
    tuned = yaml.safe_load(out.read_text())
    assert tuned["memboost"] == str((root / "V.npz").resolve())
    assert tuned["settings"]["memboost_weight"] > 0 and "memboost_weight=" in said
    assert tuned["validation"]["hr_memboost"] > tuned["validation"]["hr_ranked"] + 0.1
    answer = json.loads(cli("recommend", "--retrieval", str(root / "R"), "--pixie",
                            str(root / "G"), "--settings", str(out), "--user", "u5", "--steps",
                            "2000", "--json").stdout)
    assert by_user["u5"][-2] in answer["items"] and answer["memboost"]
