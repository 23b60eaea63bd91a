"""Served retrieval: `export --retrieval` writes a user tower that loads without this package and
reproduces the trained one, the item vectors, and FAISS indexes (flat exact, IVF and HNSW close
to it); `retrieve` answers from the user tower or a history without the trainer; bad input is a
one-line error that leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from conftest import ROOT, failure, run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.batch import Batch
from dlrm_hybrid.data.interactions.planted_interactions import planted_interactions
from dlrm_hybrid.data.interactions.interaction_data import open_interactions, write_interactions
from dlrm_hybrid.model.two_tower import build_two_tower, split_towers
from dlrm_hybrid.retrieval.index import (IndexParams, ann_recall, build_index, exact_top_k,
                                         query_latency, read_index, search)
from dlrm_hybrid.serve.retrieval_export import tower
from dlrm_hybrid.train.inference import read_model_state

USERS, ITEMS = 300, 200
CONFIG = f"""
model:
  kind: two_tower
  embedding_dim: 16
  user_tower: {{mlp: [32, 16]}}
  item_tower: {{mlp: [32, 16]}}
  temperature: 0.1
data: {{global_batch_size: 128, users: {USERS}, items: {ITEMS}}}
train: {{max_steps: 6, log_every: 6}}
"""
INDEXES = {"flat": [], "ivf": ["--nlist", "16", "--nprobe", "4"],
           "hnsw": ["--hnsw-m", "8", "--ef-search", "32"]}
# Modules a serving host need not have: `retrieve` must run with every one of them unimportable.
TRAINER = ["torchrec", "fbgemm_gpu", "dlrm_hybrid.train", "dlrm_hybrid.model", "dlrm_hybrid.data",
           "dlrm_hybrid.parallel", "dlrm_hybrid.config", "dlrm_hybrid.cli",
           "dlrm_hybrid.retrieval.loss", "dlrm_hybrid.retrieval.evaluate"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two_tower model trained 6 steps on the planted log, which is also written as a dataset
    folder with raw ids (u<n>, i<n>): the exports read it (`--set data.path`)."""
    root = tmp_path_factory.mktemp("retrieval")
    (root / "tt.yaml").write_text(CONFIG)
    cfg = load_config(str(root / "tt.yaml"))
    write_interactions(planted_interactions(cfg.data), str(root / "log"),
                       [f"u{i}" for i in range(USERS)], [f"i{i}" for i in range(ITEMS)])
    result = run_cli(["train", "--config", str(root / "tt.yaml"), "--set",
                      f"train.run_dir={root / 'run'}"])
    assert result.returncode == 0, failure(result)
    return root, root / "run" / "checkpoints" / "step_6"


@pytest.fixture(scope="module")
def exported(trained):
    """Each index kind's folder."""
    root, checkpoint = trained
    for kind, settings in INDEXES.items():
        result = run_cli(["export", "--checkpoint", str(checkpoint), "--out", str(root / kind),
                          "--set", f"data.path={root / 'log'}", "--retrieval", "--index", kind,
                          *settings])
        assert result.returncode == 0, failure(result)
    return root


def model_vectors(checkpoint: Path):
    """The trained model's own user vectors (every user) and item vectors (the corpus)."""
    cfg = load_config(str(checkpoint / "config.yaml"))
    data = open_interactions(str(checkpoint.parents[2] / "log")).for_model(cfg.model)
    model = build_two_tower(cfg, data.spec, embedding_device=torch.device("cpu"))
    model.load_state_dict(read_model_state(checkpoint))
    model.eval()
    columns = data.tower_columns(np.arange(USERS), np.arange(USERS) % ITEMS, np.ones(USERS, bool))
    batch = Batch.from_columns(columns, data.spec.feature_names)
    corpus = Batch.from_columns(data.corpus_columns(0, ITEMS), data.spec.feature_names)
    with torch.no_grad():
        users, _ = split_towers(model(batch.dense, batch.sparse))
        _, items = split_towers(model(corpus.dense, corpus.sparse))
    return users.numpy(), items.numpy(), data


def served_users(folder: Path) -> np.ndarray:
    """Every user's vector from the exported user tower."""
    side = np.load(folder / "user_side.npy")
    ids = np.column_stack([np.arange(len(side)), side])
    with torch.no_grad():
        return torch.jit.load(str(folder / "user_tower.pt"))(torch.from_numpy(ids)).numpy()


def fresh(script: str, cwd: Path) -> subprocess.CompletedProcess:
    """`script` in a new interpreter where the trainer's modules cannot be imported."""
    blocked = "".join(f"sys.modules[{m!r}] = None\n" for m in TRAINER)
    check = (f"\nassert not [m for m in sys.modules if m.startswith(tuple({TRAINER!r})) "
             f"and sys.modules[m] is not None]\n")
    return subprocess.run([sys.executable, "-c", "import sys\n" + blocked + script + check],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


USER_TOWER_ALONE = """
sys.modules["dlrm_hybrid"] = None
import numpy as np, torch
tower = torch.jit.load("flat/user_tower.pt")
ids = np.column_stack([np.arange(len(np.load("flat/user_side.npy"))), np.load("flat/user_side.npy")])
np.save("served_users.npy", tower(torch.from_numpy(ids)).numpy())
try:
    tower(torch.tensor([[10**6, 0]]))
    raise SystemExit("an id outside its table was looked up")
except torch.jit.Error as e:
    assert "1000000 is out of range for feature user_id" in str(e), str(e)
"""


def test_the_exported_towers_reproduce_the_trained_model(trained, exported):
    _, checkpoint = trained
    result = fresh(USER_TOWER_ALONE, exported)
    assert result.returncode == 0, result.stderr[-3000:]
    users, items, data = model_vectors(checkpoint)
    assert np.allclose(np.load(exported / "served_users.npy"), users, atol=1e-6)
    for kind in INDEXES:
        assert np.allclose(np.load(exported / kind / "item_vectors.npy"), items, atol=1e-6)
    flat = exported / "flat"
    assert (flat / "users.txt").read_text() == (Path(data.root) / "users.txt").read_text()
    assert (flat / "items.txt").read_text() == (Path(data.root) / "items.txt").read_text()
    indptr, seen = data.engaged(("train",))
    assert np.array_equal(np.load(flat / "seen_indptr.npy"), indptr)
    assert np.array_equal(np.load(flat / "seen_items.npy"), seen)
    described = {k: yaml.safe_load((exported / k / "retrieval.yaml").read_text())["index"]
                 for k in INDEXES}
    assert described == {"flat": {"kind": "flat"}, "ivf": {"kind": "ivf", "nlist": 16, "nprobe": 4},
                         "hnsw": {"kind": "hnsw", "hnsw_m": 8, "ef_construction": 200,
                                  "ef_search": 32}}


COMPOSITIONAL = {"hash": "{technique: hash, buckets: 70, rows_above: 100}",
                 "qr mult": "{technique: qr, collisions: 4, operation: mult, rows_above: 100}",
                 "qr add": "{technique: qr, collisions: 4, operation: add, rows_above: 100}",
                 "qr concat": "{technique: qr, collisions: 4, operation: concat, rows_above: 100}"}


@pytest.mark.parametrize("rule", COMPOSITIONAL)
def test_hashed_and_qr_tables_are_served_exactly(rule, tmp_path):
    """The towers' hashing and quotient-remainder lookups (user_id and item_id have more than
    100 rows) reproduce the model's forward."""
    (tmp_path / "tt.yaml").write_text(CONFIG)
    cfg = load_config(str(tmp_path / "tt.yaml"), [f"model.compositional=[{COMPOSITIONAL[rule]}]"])
    data = planted_interactions(cfg.data).for_model(cfg.model)
    torch.manual_seed(0)
    model = build_two_tower(cfg, data.spec, embedding_device=torch.device("cpu")).eval()
    assert any(lookup.technique != "full" for lookup in model.lookups)
    for table in model.embedding_bags.parameters():
        torch.nn.init.uniform_(table, -0.3, 0.3)
    weights = model.state_dict()
    columns = data.tower_columns(np.arange(USERS), np.arange(USERS) % ITEMS, np.ones(USERS, bool))
    batch = Batch.from_columns(columns, data.spec.feature_names)
    ids = torch.from_numpy(np.column_stack([c[:, 0] for c in columns.ids]))
    user_features = sum(name.startswith("user_") for name in data.spec.feature_names)
    with torch.no_grad():
        users, items = split_towers(model(batch.dense, batch.sparse))
        served_users = torch.jit.script(tower(model, "user", weights))(ids[:, :user_features])
        served_items = torch.jit.script(tower(model, "item", weights))(ids[:, user_features:])
    assert torch.allclose(served_users, users, atol=1e-6)
    assert torch.allclose(served_items, items, atol=1e-6)


def test_the_flat_index_is_exact_and_ann_recall_is_measured(exported):
    vectors = np.load(exported / "flat" / "item_vectors.npy")
    queries = served_users(exported / "flat")
    stated = {k: yaml.safe_load((exported / k / "retrieval.yaml").read_text())["index"]
              for k in INDEXES}
    index = {k: read_index(str(exported / k / "index.faiss"), stated[k]) for k in INDEXES}
    _, found = search(index["flat"], queries, 20)
    _, exact = exact_top_k(vectors, queries, 20)
    assert np.array_equal(found, exact)
    assert ann_recall(index["flat"], vectors, queries, 20) == 1.0
    assert index["ivf"].nprobe == 4 and index["hnsw"].hnsw.efSearch == 32
    for kind in ("ivf", "hnsw"):
        assert ann_recall(index[kind], vectors, queries, 20) >= 0.9, kind
    coarse = build_index(vectors, IndexParams("ivf", nlist=32, nprobe=1))
    assert 0 < ann_recall(coarse, vectors, queries, 20) < 0.9  # a lossy index measures lossy
    latency = query_latency(index["hnsw"], queries[:20], 20)
    assert 0 < latency["p50_ms"] <= latency["p99_ms"]


RETRIEVE_ALONE = """
import contextlib, io, json
from dlrm_hybrid.serve.retrieve import main
answers = {}
for name, args in {"tower": ["--user", "u5"], "kept": ["--user", "u5", "--keep-seen"],
                   "hnsw": ["--user", "u5", "--model", "hnsw"],
                   "history": ["--user", "u5", "--history", "i3,i9", "--exact"]}.items():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["--model", "flat", "--k", "10", "--json", *args])
    answers[name] = json.loads(out.getvalue())
json.dump(answers, open("answers.json", "w"))
"""


def _dense(names):
    return np.array([int(n[1:]) for n in names])


def test_retrieve_answers_without_the_trainer(trained, exported):
    result = fresh(RETRIEVE_ALONE, exported)
    assert result.returncode == 0, result.stderr[-3000:]
    answers = json.loads((exported / "answers.json").read_text())
    vectors = np.load(exported / "flat" / "item_vectors.npy")
    user = served_users(exported / "flat")[5]
    data = open_interactions(str(trained[0] / "log"))
    indptr, seen_items = data.engaged(("train",))
    seen = seen_items[indptr[5]:indptr[6]]
    scores = vectors @ user
    expected = [i for i in np.argsort(-scores) if i not in seen][:10]
    assert list(_dense(answers["tower"]["items"])) == expected
    assert np.allclose(answers["tower"]["scores"], scores[expected], atol=1e-5)
    assert list(_dense(answers["kept"]["items"])) == list(np.argsort(-scores)[:10])
    assert len(set(_dense(answers["hnsw"]["items"])) & set(expected)) >= 9
    near = np.maximum(vectors @ vectors[3], vectors @ vectors[9])
    skip = set(seen) | {3, 9}
    assert list(_dense(answers["history"]["items"])) == [i for i in np.argsort(-near)
                                                         if i not in skip][:10]
    text = run_cli(["retrieve", "--model", str(exported / "flat"), "--user", "u5", "--k", "10"])
    assert text.returncode == 0, failure(text)
    assert [line.split("\t")[0] for line in text.stdout.splitlines()] == answers["tower"]["items"]


def test_history_retrieval_scores_every_item_by_its_best_history_item(exported, monkeypatch):
    """A long history on the flat index, scored in blocks of a few history items: each item
    ranks by its max inner product with any history item, the history and the user's training
    items left out, exactly as brute force orders them."""
    from dlrm_hybrid.serve import retrieve

    retriever = retrieve.Retriever(str(exported / "flat"))
    vectors = retriever.item_vectors
    monkeypatch.setattr(retrieve, "HISTORY_BLOCK", 3 * len(vectors))  # 3 history items a block
    history = np.array([1, 4, 16, 39, 52, 75, 90, 122, 145, 171, 193], np.int64)
    items, scores = retriever.from_history(history, 10, user=5)
    near = (vectors[history] @ vectors.T).max(0)
    skip = set(history) | set(retriever.seen(5))
    expected = [i for i in np.argsort(-near, kind="stable") if i not in skip][:10]
    assert sorted(items) == sorted(expected)
    assert np.allclose(scores, near[items]) and np.all(np.diff(scores) <= 0)


def test_retrieve_a_batch_of_users_to_a_file(trained, exported, tmp_path):
    (tmp_path / "users.txt").write_text("\ufeffu5\n\nu7\n")  # a byte-order mark, a blank line
    out = tmp_path / "answers.jsonl"
    mine = tmp_path / "answers.jsonl.partial"  # the user's own file, not a temporary one
    mine.write_text("mine")
    result = run_cli(["retrieve", "--model", str(exported / "flat"), "--users",
                      str(tmp_path / "users.txt"), "--out", str(out), "--k", "10"])
    assert result.returncode == 0, failure(result)
    assert mine.read_text() == "mine" and not list(tmp_path.glob(".answers.jsonl.partial*"))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [a["user"] for a in lines] == ["u5", "u7"]
    vectors, users = np.load(exported / "flat" / "item_vectors.npy"), served_users(exported / "flat")
    indptr, seen = open_interactions(str(trained[0] / "log")).engaged(("train",))
    for line, user in zip(lines, (5, 7)):
        unseen = [i for i in np.argsort(-(vectors @ users[user]))
                  if i not in seen[indptr[user]:indptr[user + 1]]]
        assert list(_dense(line["items"])) == unseen[:10]
    again = run_cli(["retrieve", "--model", str(exported / "flat"), "--users", str(out),
                     "--out", str(out)])
    assert again.returncode == 2 and "--out" in again.stderr and "an input" in again.stderr


@pytest.fixture(scope="module")
def ranker_checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("ranker")
    result = run_cli(["train", "--set", "train.max_steps=1", "--set", f"train.run_dir={run}",
                      "--set", "data.val_samples=256", "--set", "train.eval_every=0"])
    assert result.returncode == 0, failure(result)
    return run / "checkpoints" / "step_1"


def _error(args, *, cwd=ROOT) -> str:
    result = run_cli(args, cwd=cwd)
    assert result.returncode == 2, failure(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_one_line_errors(trained, exported, ranker_checkpoint, tmp_path):
    root, checkpoint = trained
    flat = str(exported / "flat")
    assert "unknown user 'nobody'" in _error(["retrieve", "--model", flat, "--user", "nobody"])
    assert "unknown item 'i999'" in _error(["retrieve", "--model", flat, "--user", "u1",
                                            "--history", "i1,i999"])
    assert "is a checkpoint" in _error(["retrieve", "--model", str(checkpoint), "--user", "u1"])
    assert "add --retrieval" in _error(["export", "--checkpoint", str(checkpoint), "--out",
                                        str(tmp_path / "m.pt")])
    assert "--retrieval is for two_tower" in _error(
        ["export", "--checkpoint", str(ranker_checkpoint), "--out", str(tmp_path / "r"),
         "--retrieval"])
    assert "is --checkpoint" in _error(["export", "--checkpoint", str(checkpoint), "--out",
                                        str(checkpoint), "--retrieval"])
    assert "already exists" in _error(["export", "--checkpoint", str(checkpoint), "--out", flat,
                                       "--retrieval"])
    assert "setting of --index ivf" in _error(["export", "--checkpoint", str(checkpoint), "--out",
                                               str(tmp_path / "r"), "--retrieval", "--nlist", "4"])
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert (checkpoint / "meta.json").is_file()


def test_a_users_file_or_raw_ids_not_in_utf8_are_one_line(exported, tmp_path):
    """A users file saved in another encoding, or a folder's users.txt that is: one line
    naming the file, not a UnicodeDecodeError traceback."""
    import shutil

    (tmp_path / "users.txt").write_bytes(b"u1\n\xff\xfeu2\n")
    line = _error(["retrieve", "--model", str(exported / "flat"), "--users",
                   str(tmp_path / "users.txt"), "--out", str(tmp_path / "out.jsonl")])
    assert line.startswith(f"error: --users: cannot read {tmp_path}/users.txt ("), line
    folder = Path(shutil.copytree(exported / "flat", tmp_path / "flat"))
    with open(folder / "users.txt", "ab") as stream:
        stream.write(b"\xff\xfe\n")
    line = _error(["retrieve", "--model", str(folder), "--user", "u1"])
    assert line.startswith(f"error: {folder}/users.txt: not UTF-8 text ("), line
    assert not (tmp_path / "out.jsonl").exists()


def _cut(name: str):
    def damage(folder: Path) -> None:
        (folder / name).write_bytes((folder / name).read_bytes()[:100])
    return damage


def _other_users(folder: Path) -> None:
    np.save(folder / "user_side.npy", np.load(folder / "user_side.npy")[:-1])


@pytest.mark.parametrize("damage, says", [
    (lambda f: (f / "seen_items.npy").unlink(), "seen_items.npy: cannot read"),
    (_cut("item_vectors.npy"), "item_vectors.npy: damaged"),
    (_cut("user_tower.pt"), "user_tower.pt: not a readable TorchScript file"),
    (_other_users, f"user_side.npy: {USERS - 1} rows, retrieval.yaml says {USERS} users"),
    (lambda f: (f / "retrieval.yaml").write_bytes(b"\xff\xfe\x00"),
     "retrieval.yaml: not valid YAML"),
], ids=["missing array", "truncated vectors", "truncated tower", "short user side",
        "binary yaml"])
def test_a_damaged_export_is_a_one_line_error(exported, tmp_path, damage, says):
    """A file of the folder missing, cut short or of another size: one line naming it, not a
    traceback from numpy or torch."""
    import shutil

    folder = Path(shutil.copytree(exported / "flat", tmp_path / "flat"))
    damage(folder)
    line = _error(["retrieve", "--model", str(folder), "--user", "u1"])
    assert line.startswith(f"error: {folder}/{says}") and "export the model again" in line, line


def test_the_export_names_its_dataset_wherever_it_is_read_from(trained, tmp_path):
    """A checkpoint trained with a relative data.path: the export states the dataset it read
    as a whole path, so `recommend-tune` (which opens it) finds it from any folder."""
    root, checkpoint = trained
    result = run_cli(["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "r"),
                      "--set", "data.path=log", "--retrieval"], cwd=root)
    assert result.returncode == 0, failure(result)
    stated = yaml.safe_load((tmp_path / "r" / "retrieval.yaml").read_text())["source"]["data"]
    assert stated == str(root / "log")


def test_export_removes_only_a_partial_folder_a_stopped_export_made(trained, tmp_path):
    """`OUT.partial` that is not a stopped export's (no marker of it inside) is refused in one
    line and left as it is; a stopped export's is replaced."""
    root, checkpoint = trained
    export = ["export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "R"),
              "--set", f"data.path={root / 'log'}", "--retrieval", "--index", "flat"]
    partial = tmp_path / "R.partial"
    partial.mkdir()
    (partial / "notes.txt").write_text("mine")
    line = _error(export)
    assert line.startswith(f"error: {partial}: exists and is not a stopped export "
                           f"--retrieval's work")
    assert [p.name for p in partial.iterdir()] == ["notes.txt"] and not (tmp_path / "R").exists()
    (partial / ".dlrm_hybrid_partial").write_text("export --retrieval\n")
    result = run_cli(export)
    assert result.returncode == 0, failure(result)
    assert not partial.exists() and not (tmp_path / "R" / "notes.txt").exists()
    assert not (tmp_path / "R" / ".dlrm_hybrid_partial").exists()
