"""Replicated (data_parallel) tables: a plan that replicates some tables trains the model one
rank trains, its checkpoints reshard to and from sharded tables, and they evaluate and export;
and the demo's losses do not depend on the number of ranks."""

import hashlib
import json
import math
from pathlib import Path

import pytest

from conftest import (assert_eval_and_export_reproduce, exported_val_scores, failure,
                      read_metrics, run_cli)

RUN = ["train.max_steps=40", "train.log_every=1", "train.eval_every=0", "data.val_samples=4096",
       "train.progress_bar=false", "checkpoint.every=20", "train.rank_logs=true"]
# Dense SGD: Adagrad's first dense steps move each weight by +-lr whatever its gradient's size
# (shared_runs.EQUIVALENCE), so another reduction order's rounding would decide them (with dense
# Adagrad, 1 and 2 ranks drift 1e-5 apart by step 28 and their models' scores 0.17 by step 40
# on an Intel Xeon with AMX). SGD tables are the ones that see the gradient's scale (both
# Adagrads divide it out), at an LR large enough for it to show in the loss: half of it moves
# the 40 steps' losses by 5e-4.
DENSE_SGD = ["optim.dense=sgd", "optim.dense_lr=0.5"]
OPTIMIZERS = {"rowwise_adagrad": DENSE_SGD,
              "sgd": ["optim.embedding=sgd", "optim.embedding_lr=20", *DENSE_SGD],
              "adagrad": ["optim.embedding=adagrad", *DENSE_SGD]}
REPLICATED = ("t_cat_0", "t_cat_3", "t_cat_7")  # the largest, a middle and the smallest table
TABLE_WISE = {"t_cat_1": 1, "t_cat_2": 0, "t_cat_4": 1, "t_cat_5": 0, "t_cat_6": 1}


def sets(*overrides):
    return [arg for o in overrides for arg in ("--set", o)]


def write_plan(path: Path, world: int, replicated=(), ranks=None) -> Path:
    """`plan --out` for `world` ranks with every table's placement replaced: `replicated`
    data_parallel, the others table-wise on `ranks[table]` (rank 0 if not named)."""
    made = run_cli(["plan", "--config", "configs/demo.yaml", "--world-size", str(world),
                    "--out", str(path)])
    assert made.returncode == 0, failure(made)
    plan = json.loads(path.read_text())
    for name, table in plan["tables"].items():
        if name in replicated:
            table.update(sharding="data_parallel", ranks=[], columns=[])
        else:
            table.update(sharding="table_wise", ranks=[(ranks or {}).get(name, 0)],
                         columns=[table["dim"]])
    path.write_text(json.dumps(plan))
    return path


def losses_of(run_dir: Path) -> dict:
    """{step: loss}, the last record of each step winning (a resumed run appends)."""
    return {e["step"]: e["loss"] for e in read_metrics(run_dir) if "loss" in e}


def assert_same_losses(got: dict, want: dict, steps, tolerance: float = 1e-5) -> None:
    assert sorted(got) == list(steps)
    for step in steps:
        assert abs(got[step] - want[step]) < tolerance, f"step {step}: {got[step]} vs {want[step]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Training runs of this file, each made once when a test first asks for it:
    runs(optimizer, nproc, *overrides) -> (run directory, the CLI's result). One rank trains
    every table table-wise; two ranks replicate REPLICATED and keep TABLE_WISE table-wise."""
    root = tmp_path_factory.mktemp("replicated")
    plans = {1: write_plan(root / "one.json", 1),
             2: write_plan(root / "two.json", 2, REPLICATED, TABLE_WISE)}
    made = {}

    def run(optimizer: str, nproc: int, *overrides: str):
        key = (optimizer, nproc, overrides)
        if key not in made:
            run_dir = root / f"run{len(made)}"
            result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
                *RUN, *OPTIMIZERS[optimizer], f"parallel.plan={plans[nproc]}",
                f"train.run_dir={run_dir}", *overrides)], nproc=nproc if nproc > 1 else 0)
            assert result.returncode == 0, failure(result)
            made[key] = run_dir, result
        return made[key]

    run.plans = plans
    return run


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "sgd"])
def test_replicated_tables_on_two_ranks_train_as_one_rank(runs, optimizer):
    """Replicated tables take the DDP-averaged gradient (the global batch's mean, as a sharded
    table's owner sees it) and the embedding optimizer's update, LR and schedule: 40 steps of
    losses and embedding LRs are one rank's. They exchange nothing: rank 0 sends the bytes
    of its own table-wise tables alone."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.parallel.exchange_bytes import exchange_bytes
    from dlrm_hybrid.parallel.plan_file import load_plan

    one, _ = runs(optimizer, 1)
    two, _ = runs(optimizer, 2)
    assert_same_losses(losses_of(two), losses_of(one), range(1, 41))
    lrs = [[e["lr_embedding"] for e in read_metrics(run) if "loss" in e] for run in (one, two)]
    assert lrs[0] == lrs[1] and lrs[0][0] < lrs[0][-1]  # the warmup, applied to both kinds

    applied = json.loads((two / "sharding.json").read_text())
    assert {n for n, a in applied.items() if a["sharding"] == "data_parallel"} == set(REPLICATED)
    for rank in (0, 1):
        first = json.loads((two / f"rank_{rank}.jsonl").read_text().splitlines()[0])
        assert first["replicated"] == list(REPLICATED)
        assert {s.split("[")[0] for s in first["shards"]} == {
            n for n, r in TABLE_WISE.items() if r == rank}
    planned = exchange_bytes(load_plan(str(runs.plans[2])),
                             load_config("configs/demo.yaml", [], 2))["pooled"]
    record = next(e for e in read_metrics(two) if "loss" in e)
    assert (record["exchange_fwd_bytes"], record["exchange_bwd_bytes"]) == (
        planned.forward[0], planned.backward[0])


FP16 = ("model.embedding_precision=fp16", "train.max_steps=16", "checkpoint.every=8")
# fp16 tables round every update to 11 bits: once a last-bit difference of a sum taken in
# another order flips one of those roundings, 1 and 2 ranks part (by up to 1e-4 at step 40 on
# an AMD EPYC, as much with every table sharded): from step ~20 with row-wise Adagrad, from step
# ~8 with Adagrad, whose first steps move a weight by +-lr whatever its gradient's size. Before
# that the steps are the same: the steps compared.
FP16_SAME_STEPS = {"rowwise_adagrad": 15, "adagrad": 5, "sgd": 16}


@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_fp16_replicated_tables_on_two_ranks_train_as_one_rank(runs, optimizer):
    """fp16 tables replicated on two ranks train as one rank trains them sharded: their
    gradient averaged in fp32, updated in fp32 and rounded (parallel/narrow_replicas.py). In
    fp16 the Adagrads' first step was NaN on two ranks, and with the gradient averaged in fp16
    row-wise Adagrad's losses were 1e-5 apart by step 12."""
    one, _ = runs(optimizer, 1, *FP16)
    two, _ = runs(optimizer, 2, *FP16)
    got, want = losses_of(two), losses_of(one)
    assert sorted(got) == list(range(1, 17)) and all(math.isfinite(v) for v in got.values())
    assert_same_losses({s: got[s] for s in range(1, FP16_SAME_STEPS[optimizer] + 1)}, want,
                       range(1, FP16_SAME_STEPS[optimizer] + 1), tolerance=1e-6)
    applied = json.loads((two / "sharding.json").read_text())
    assert {n for n, a in applied.items() if a["sharding"] == "data_parallel"} == set(REPLICATED)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_checkpoints_reshard_between_table_wise_and_replicated(runs, tmp_path, precision):
    """Weights and row-wise Adagrad's per-row sums move between a table-wise table on one rank
    and a replicated one on two, both ways: the resumed run's losses go on as the
    uninterrupted run's. fp16 tables too: a replicated table's sums are fp32, as fbgemm keeps a
    sharded one's."""
    overrides, resume, last = ((), 20, 40) if precision == "fp32" else (FP16, 8, 16)
    one, _ = runs("rowwise_adagrad", 1, *overrides)
    two, _ = runs("rowwise_adagrad", 2, *overrides)
    want = losses_of(one)
    into_two, _ = runs("rowwise_adagrad", 2, *overrides,
                       f"checkpoint.resume={one / f'checkpoints/step_{resume}'}")
    assert_same_losses(losses_of(into_two), want, range(resume + 1, last + 1))
    into_one = tmp_path / "into_one"
    result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
        *RUN, *OPTIMIZERS["rowwise_adagrad"], *overrides, f"parallel.plan={runs.plans[1]}",
        f"train.run_dir={into_one}", f"checkpoint.resume={two / f'checkpoints/step_{resume}'}")])
    assert result.returncode == 0, failure(result)
    assert_same_losses(losses_of(into_one), want, range(resume + 1, last + 1))


def test_a_replicated_checkpoint_evaluates_and_exports(runs, tmp_path):
    """`eval` of a checkpoint with replicated tables scores the run's final AUC, and `export`
    writes one unsharded model whose predictions are the one-rank model's."""
    import torch

    one, _ = runs("rowwise_adagrad", 1)
    two, _ = runs("rowwise_adagrad", 2)
    checkpoint = two / "checkpoints/step_40"
    assert_eval_and_export_reproduce(checkpoint, read_metrics(two)[-1]["val_auc"],
                                     tmp_path / "two.pt")
    result = run_cli(["export", "--checkpoint", str(one / "checkpoints/step_40"), "--out",
                      str(tmp_path / "one.pt"), "--state-dict"])
    assert result.returncode == 0, failure(result)
    torch.testing.assert_close(exported_val_scores(checkpoint, tmp_path / "two.pt")[0],
                               exported_val_scores(one / "checkpoints/step_40",
                                                   tmp_path / "one.pt")[0],
                               rtol=1e-5, atol=1e-5)


def test_a_checkpoint_without_the_optimizer_state_is_refused(runs, tmp_path):
    """An SGD checkpoint (no optimizer state) passed off as row-wise Adagrad's: the missing
    per-row sums are a one-line error, not a fresh state."""
    import shutil

    sgd, _ = runs("sgd", 2)
    checkpoint = shutil.copytree(sgd / "checkpoints/step_20", tmp_path / "step_20")
    config = (checkpoint / "config.yaml").read_text()
    demo = {"embedding: sgd": "embedding: rowwise_adagrad", "embedding_lr: 20.0":
            "embedding_lr: 0.1", "dense: sgd": "dense: adagrad", "dense_lr: 0.5": "dense_lr: 0.05"}
    for sgd_line, demo_line in demo.items():
        assert sgd_line in config
        config = config.replace(sgd_line, demo_line)
    (checkpoint / "config.yaml").write_text(config)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["sha256"]["config.yaml"] = hashlib.sha256(config.encode()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
        *RUN, f"parallel.plan={runs.plans[1]}", f"train.run_dir={tmp_path / 'run'}",
        f"checkpoint.resume={checkpoint}")])
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {checkpoint}: holds no optimizer state t_cat_0.momentum1 for "
        f"embedding_bags.embedding_bags.t_cat_0.weight; it was trained with another optimizer "
        f"or model: resume with the config it was written with, or checkpoint.resume=none")


@pytest.mark.parametrize("setting, error", [
    ("parallel.exchange=des", "error: parallel.exchange: des needs every table sharded, the plan "
     "replicates t_cat_0, t_cat_3, t_cat_7; use parallel.exchange=pooled or auto"),
    ("train.precision=fp16", "error: train.precision: fp16 does not train replicated tables "
     "(the plan replicates t_cat_0, t_cat_3, t_cat_7); use bf16 or fp32")])
def test_what_replicated_tables_do_not_run_with_is_refused(tmp_path, setting, error):
    """des sums owners' partial results (a replicated table has no owner); fp16's loss scaler
    would unscale a replicated table's gradient twice."""
    plan = write_plan(tmp_path / "plan.json", 1, REPLICATED)
    result = run_cli(["train", "--config", "configs/demo.yaml", *sets(
        *RUN, "model.interaction=cat", "train.precision_fallback=false", setting,
        f"parallel.plan={plan}", f"train.run_dir={tmp_path / 'run'}")])
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines()[-1] == error
    assert not (tmp_path / "run").exists()


# The demo as shipped but for the dense optimizer: dense Adagrad's first steps move a weight by
# +-lr whatever its gradient's size, so rounding of another reduction order in a near-zero
# gradient decides them (1 vs 2 ranks: 3e-4 apart at step 40, growing from step 31; dense SGD:
# 6e-8).
DEMO_40 = ["train.max_steps=40", "train.log_every=1", "train.eval_every=0",
           "data.val_samples=1024", "train.progress_bar=false", "optim.dense=sgd",
           "optim.dense_lr=0.5"]


def test_the_demo_trains_the_same_model_on_one_two_and_four_ranks(tmp_path):
    """The default placer keeps row-wise Adagrad's tables whole (table-wise or replicated), so
    the demo's 40 steps of losses do not depend on how many ranks train it."""
    losses, placements = {}, {}
    for nproc in (1, 2, 4):
        run_dir = tmp_path / f"ranks{nproc}"
        result = run_cli(["train", "--config", "configs/demo.yaml",
                          *sets(*DEMO_40, f"train.run_dir={run_dir}")],
                         nproc=nproc if nproc > 1 else 0)
        assert result.returncode == 0, failure(result)
        losses[nproc] = losses_of(run_dir)
        placements[nproc] = {name: a["sharding"] for name, a in
                             json.loads((run_dir / "sharding.json").read_text()).items()}
    for nproc in (2, 4):
        assert "column_wise" not in placements[nproc].values(), placements[nproc]
        assert_same_losses(losses[nproc], losses[1], range(1, 41))


def _dense_table(weights, precision: str):
    """fbgemm's dense table batch (a replicated table's lookup) holding `weights` [rows, dim],
    and its one table as the TableBatchedEmbeddingSlice the replicated optimizer trains."""
    import torch
    from fbgemm_gpu.split_embedding_configs import SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        DenseTableBatchedEmbeddingBagsCodegen)
    from torchrec.distributed.composable.table_batched_embedding_slice import (
        TableBatchedEmbeddingSlice)

    rows, dim = weights.shape
    tbe = DenseTableBatchedEmbeddingBagsCodegen(
        [(rows, dim)], weights_precision=SparseType.FP16 if precision == "fp16" else
        SparseType.FP32, use_cpu=True)
    with torch.no_grad():
        tbe.weights.copy_(weights.reshape(-1))
    return tbe, TableBatchedEmbeddingSlice(tbe.weights, 0, rows * dim, rows, dim)


def _batches(rows: int, dim: int, steps: int):
    """Zipf-like ids (most rows untouched) and pooled gradients of a global batch's size."""
    import torch

    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = (torch.rand(512, generator=gen) ** 3 * rows).long()
        yield ids, torch.arange(513), torch.randn(512, dim, generator=gen) * 1e-4


@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning")
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adagrad", "sgd"])
def test_an_fp16_replicated_table_steps_as_its_fp32_twin_rounded(optimizer):
    """A replicated fp16 table's step is its fp32 twin's (fp32 gradient, state and arithmetic),
    rounded to fp16. In fp16, torch's Adagrads turned every untouched row to NaN (eps 1e-8 is 0
    there: 0 / 0), and the gradient autograd rounds to fp16 moved thousands of weights a unit in
    the last place. Row-wise Adagrad's step is fbgemm's fused update of the table sharded."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice, EmbeddingLocation, SplitTableBatchedEmbeddingBagsCodegen)

    from dlrm_hybrid.parallel.narrow_replicas import keep_fp32_grads
    from dlrm_hybrid.train.optim import EMBEDDING_OPTIMIZERS, _fp32_update, _kwargs

    rows, dim, lr = 1000, 16, 0.05
    start = (torch.rand(rows, dim, generator=torch.Generator().manual_seed(1)) * 0.06
             - 0.03).half()
    narrow, narrow_slice = _dense_table(start, "fp16")
    collection = torch.nn.Module()
    collection._lookups = [torch.nn.ModuleList([narrow])]  # as torchrec keeps its lookups
    assert keep_fp32_grads(collection) == 1
    twin, twin_slice = _dense_table(start.float(), "fp32")
    optimizers = [_fp32_update(EMBEDDING_OPTIMIZERS[optimizer])([narrow_slice],
                                                               **_kwargs(optimizer, lr, 1e-8)),
                  EMBEDDING_OPTIMIZERS[optimizer]([twin_slice], **_kwargs(optimizer, lr, 1e-8))]
    fused = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=lr, eps=1e-8,
        weights_precision=SparseType.FP16)
    with torch.no_grad():
        fused.weights_host.copy_(start.reshape(-1))
    touched = torch.zeros(rows, dtype=torch.bool)
    for ids, offsets, grad in _batches(rows, dim, steps=3):
        touched[ids] = True
        for table, optim in zip((narrow, twin), optimizers):
            optim.zero_grad()
            table(ids, offsets).backward(grad)
            optim.step()
        with torch.no_grad():
            twin.weights.copy_(twin.weights.half().float())  # the twin, rounded each step
        fused(ids, offsets).backward(grad)
    got = narrow_slice.detach()
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert not touched.all() and torch.equal(got[~touched], start[~touched])
    assert torch.equal(got, twin_slice.detach().half())
    assert [s["sum"].dtype for s in optimizers[0].state.values()] == (
        [] if optimizer == "sgd" else [torch.float32])
    if optimizer == "rowwise_adagrad":
        assert torch.equal(got.reshape(-1), fused.weights_host)
