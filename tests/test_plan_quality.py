"""benchmarks/plan_quality.py and its torchrec adapter (benchmarks/torchrec_planner.py): what the
side-by-side table rests on. torchrec's plan must become our Plan table for table, column for
column, or the cost model scores some other plan; the quick run shows all three planners. And
benchmarks/plan_identity.py's --keep folder."""

import re

import pytest

from conftest import ROOT, load_script, failure, run_cli
from dlrm_hybrid.parallel.plan import Plan, Shard
from dlrm_hybrid.parallel.tables import TableSpec

torch = pytest.importorskip("torch")
pytest.importorskip("torchrec", reason="the adapter needs torchrec")

TABLES = [TableSpec("big", 4_000_000, 128, "fp32", "sgd", 2.0),
          TableSpec("mid", 100_000, 64, "fp32", "rowwise_adagrad", 4.0),
          TableSpec("tiny", 10, 16, "fp32", "sgd", 1.0)]


@pytest.fixture(scope="module")
def adapter():
    """benchmarks/torchrec_planner.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/torchrec_planner.py", "torchrec_planner")


def test_each_torchrec_sharding_type_becomes_our_shards_or_replicated(adapter):
    from torchrec.distributed.sharding_plan import (column_wise, construct_module_sharding_plan,
                                                    data_parallel, table_wise)
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    bags = EmbeddingBagCollection(device=torch.device("meta"), tables=[
        EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.rows,
                           feature_names=[t.name]) for t in TABLES])
    module_plan = construct_module_sharding_plan(
        bags, {"big": column_wise(ranks=[5, 2, 7, 1]), "mid": table_wise(rank=3),
               "tiny": data_parallel()}, local_size=4, world_size=8, device_type="cpu")
    plan = adapter.to_plan(module_plan, TABLES, 8, 2**30, 8192, 4)
    assert plan.shards_of("big") == [Shard("big", 5, 0, 32), Shard("big", 2, 32, 32),
                                     Shard("big", 7, 64, 32), Shard("big", 1, 96, 32)]
    assert plan.shards_of("mid") == [Shard("mid", 3, 0, 64)]
    assert plan.replicated == {"tiny"} and plan.shards_of("tiny") == []
    assert plan.strategy == "torchrec" and plan.gpus_per_node == 4


def test_a_plan_that_loses_columns_is_refused(adapter):
    plan = Plan(8, "torchrec", 2**30, 8192, {t.name: t for t in TABLES},
                [Shard("big", 0, 0, 32), Shard("big", 1, 64, 64), Shard("mid", 3, 0, 64)], 4,
                frozenset({"tiny"}))
    with pytest.raises(ValueError, match=r"table big: .*\[\(0, 32\), \(64, 64\)\] of its 128"):
        adapter._check_covered(plan)


def test_the_quick_run_compares_all_three_planners():
    run = run_cli(["--quick"], script=ROOT / "benchmarks" / "plan_quality.py", timeout=180)
    assert run.returncode == 0, failure(run)
    rows = {m[1]: m[2] for m in re.finditer(r"^\| demo \| 8 \| (\w+) \| ([\d.]+) \|",
                                            run.stdout, re.M)}
    assert set(rows) == {"greedy", "nvidia", "torchrec"}, run.stdout
    assert all(float(ms) > 0 for ms in rows.values())
    verdict = re.search(r"^\| demo \| 8 \| [\d.]+ \| (yes|no: \w+ [\d.]+ ms) \| "
                        r"(yes|no: [\d.]+x) \|$", run.stdout, re.M)
    assert verdict, run.stdout


def test_plan_identity_compares_only_the_cases_of_its_own_run(tmp_path, monkeypatch):
    """A --keep folder of an earlier run (its full grid, or another base) holds case files this
    run does not write: they are not counted as identical nor reported as differing."""
    identity = load_script("benchmarks/plan_identity.py", "plan_identity")
    config = str(ROOT / "configs/demo.yaml")
    monkeypatch.setattr(identity, "cases", lambda inputs, quick: [
        ("demo_1", ["--config", config, "--world-size", "1"])])
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(tmp_path)
    for side, earlier in (("base", "old"), ("this", "older")):
        (tmp_path / side).mkdir()
        (tmp_path / side / "120_synthetic_10000_1024_nvidia.txt").write_text(earlier)
        identity.record(tmp_path / side, tmp_path, quick=True)
    assert identity.compare(tmp_path / "base", tmp_path / "this") == 0
    assert sorted(p.name for p in (tmp_path / "this").iterdir()) == ["000_demo_1.txt"]
