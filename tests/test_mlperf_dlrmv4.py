"""MLPerf DLRMv4 mode: the evaluation grid as closed_dlrmv4.yaml computes it (checked against the
rule file's own code), the optimizer settings the rules fix, and `plan` for its config."""

from __future__ import annotations

import math
import re
from pathlib import Path

import mlperf_logging
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from dlrm_hybrid.train.mlperf_dlrmv4 import (TRAIN_SAMPLES, EvalGrid, convergence_threshold,
                                             eval_interval_samples, first_eval_samples,
                                             scaled_threshold)

RULES = (Path(mlperf_logging.__file__).parent / "compliance_checker" / "training_6.1.0"
         / "closed_dlrmv4.yaml")


def _rule_state(global_batch: int, train_samples: int = TRAIN_SAMPLES) -> dict:
    """What the checker computes for a log's global_batch_size: the rule file's BEGIN code and
    the key's POST code run on the dict `s`, as the compliance checker runs them."""
    rules = yaml.safe_load(RULES.read_text())
    s: dict = {}
    begin = next(r["BEGIN"]["CODE"] for r in rules if "BEGIN" in r)
    exec(begin, {"math": math}, {"s": s})
    s["train_samples"] = train_samples
    post = next(r["KEY"]["POST"] for r in rules
                if "KEY" in r and r["KEY"]["NAME"] == "global_batch_size")
    exec(post, {"math": math}, {"s": s, "v": {"value": global_batch}})
    return s


@pytest.mark.parametrize("batch,block", [(8192, 25), (16384, 31), (32768, 41)])
def test_the_first_evaluation_is_at_the_rule_files_block(batch, block):
    grid = EvalGrid.of(batch)
    assert grid.first_block == block
    assert grid.samples_count(grid.first) == first_eval_samples(batch) == (
        block * eval_interval_samples(batch))
    assert grid.evaluates_at(grid.first) and not grid.evaluates_at(grid.first - grid.every)
    assert not grid.evaluates_at(grid.first + 1)


def test_every_grid_point_is_a_multiple_of_the_interval():
    grid = EvalGrid.of(8192)
    interval = eval_interval_samples(8192)
    assert interval == 280 * 8192  # ceil(0.001 * 2,290,835,423 / 8192) = 280 batches
    points = [grid.samples_count(s) for s in range(grid.first, grid.first + 5000)
              if grid.evaluates_at(s)]
    assert len(points) == 5000 // grid.every + (5000 % grid.every > 0)
    assert all(p % interval == 0 for p in points)


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 1 << 20),
       train_samples=st.one_of(st.just(TRAIN_SAMPLES), st.integers(1, 10**10)))
def test_the_grid_is_the_rule_files_on_any_batch(batch, train_samples):
    s = _rule_state(batch, train_samples)
    assert eval_interval_samples(batch, train_samples) == s["eval_interval_samples"]
    assert first_eval_samples(batch, train_samples) == s["first_eval_samples"]
    grid = EvalGrid.of(batch, train_samples)
    assert grid.samples_count(grid.first) == s["first_eval_samples"]
    assert scaled_threshold(batch, TRAIN_SAMPLES) == convergence_threshold(batch)  # the rules' log
    assert grid.samples_count(grid.every) == s["eval_interval_samples"]


# --- the optimizer settings the rules fix ------------------------------------------------------

SMALL = ["train.progress_bar=false", "data.val_samples=1024", "data.global_batch_size=256",
         "train.eval_every=0", "optim.embedding=sgd", "optim.dense=sgd", "optim.dense_lr=0.5",
         "optim.warmup_steps=0", "optim.decay_steps=0", "optim.decay_start_step=0"]


def _one_step(tmp_path, process_group, *overrides):
    """One training step of the demo ranker on its first batch: (the dense parameters before,
    after, and their gradients as the step left them, i.e. as the dense optimizer used them)."""
    import torch

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import make_loader, open_dataset
    from dlrm_hybrid.train.loop import build_sharded_model
    from dlrm_hybrid.train.optim import build_optimizer
    from dlrm_hybrid.train.step import TrainStep

    cfg = load_config(str(Path(__file__).parents[1] / "configs/demo.yaml"),
                      [*SMALL, f"train.run_dir={tmp_path}", *overrides])
    dataset = open_dataset(cfg.data)
    torch.manual_seed(0)
    dmp, _ = build_sharded_model(cfg, dataset.spec, process_group, lambda line: None)
    optimizer, schedule = build_optimizer(dmp, cfg.optim)
    step = TrainStep(dmp, optimizer, schedule, cfg.train, process_group.device)
    dense = list(optimizer.optimizers[-1][1].params.values())
    before = [p.detach().clone() for p in dense]
    batches = make_loader(cfg.data, dataset, "train", process_group)
    try:
        step(batches)
    finally:
        batches.close()
    local = [_local(p) for p in dense]
    return [_local(b) for b in before], local, [_local(p.grad) for p in dense]


def _local(tensor):
    """A copy of this rank's part: of a DTensor (FSDP's parameters and gradients) its shard."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def _norm(tensors) -> float:
    import torch

    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


@pytest.mark.parametrize("dense", ["ddp", "fsdp"])
def test_the_clip_bounds_the_dense_gradient_norm_and_the_step_uses_it(tmp_path, process_group,
                                                                     dense):
    """SGD at lr 0.5: the update is -0.5 x the clipped gradient, which is the unclipped one
    (norm 0.4) scaled to norm 0.05; under FSDP the gradients are DTensors."""
    _, _, free = _one_step(tmp_path / "free", process_group, f"parallel.dense={dense}")
    before, after, clipped = _one_step(tmp_path / "clip", process_group, f"parallel.dense={dense}",
                                       "optim.dense_clip_norm=0.05")
    assert _norm(free) > 0.2
    assert _norm(clipped) == pytest.approx(0.05, rel=1e-5)
    scale = 0.05 / (_norm(free) + 1e-6)  # torch's clip_grad_norm_ coefficient
    for g, c, b, a in zip(free, clipped, before, after):
        assert (c.double() - g.double() * scale).abs().max() < 1e-9
        assert (b - a - 0.5 * c).abs().max() < 1e-7


def test_under_fp16_the_clip_sees_the_unscaled_gradient(tmp_path, process_group):
    """The loss scaler multiplies gradients by 2^16: clipped before its unscale, the update
    would be 2^16 times too small."""
    before, after, clipped = _one_step(tmp_path, process_group, "train.precision=fp16",
                                       "train.precision_fallback=false",
                                       "optim.dense_clip_norm=0.05")
    assert _norm(clipped) == pytest.approx(0.05, rel=1e-4)
    assert _norm([b - a for b, a in zip(before, after)]) == pytest.approx(0.025, rel=1e-4)


def test_adams_betas_and_epsilon_reach_torchs_optimizer(process_group, tmp_path):
    import torch

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.source import open_dataset
    from dlrm_hybrid.train.loop import build_sharded_model
    from dlrm_hybrid.train.optim import build_optimizer

    cfg = load_config(str(Path(__file__).parents[1] / "configs/demo.yaml"),
                      [*SMALL, f"train.run_dir={tmp_path}", "optim.dense=adam",
                       "optim.dense_betas=[0.95, 0.999]", "optim.dense_clip_norm=1.0"])
    dmp, _ = build_sharded_model(cfg, open_dataset(cfg.data).spec, process_group,
                                 lambda line: None)
    dense = build_optimizer(dmp, cfg.optim)[0].optimizers[-1][1]._optimizer
    assert isinstance(dense, torch.optim.Adam) and dense.max_norm == 1.0
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in dense.param_groups] == [
        ((0.95, 0.999), 1e-8, 0)] * len(dense.param_groups)


# --- the config and its plan -------------------------------------------------------------------

CONFIG = Path(__file__).parents[1] / "configs/mlperf_dlrmv4.yaml"


def test_the_config_holds_what_the_rules_fix():
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.train.mlperf_dlrmv4 import EVAL_SAMPLES, MAX_SEQUENCE_LENGTH, TARGET_AUC

    cfg = load_config(str(CONFIG), world_size=8)
    o, d, h = cfg.optim, cfg.data, cfg.model.hstu
    assert (o.dense, o.dense_betas, o.eps, o.dense_clip_norm) == ("adam", [0.95, 0.999], 1e-8, 1.0)
    assert (o.embedding, o.embedding_lr, o.warmup_steps) == ("rowwise_adagrad", o.dense_lr, 24000)
    assert 0.5e-6 * d.global_batch_size / 8192 <= o.dense_lr <= 1.5e-6 * d.global_batch_size / 8192
    assert (d.train_samples, d.val_samples) == (TRAIN_SAMPLES, EVAL_SAMPLES)
    assert h.max_length + 1 == MAX_SEQUENCE_LENGTH  # the history and the candidate
    assert cfg.train.eval_every == EvalGrid.of(d.global_batch_size).every
    assert cfg.train.target_auc == TARGET_AUC
    assert (cfg.model.embedding_dim, h.layers, h.heads, h.attention_dim, h.linear_dim) == (
        512, 5, 4, 128, 128)


@pytest.mark.parametrize("ranks,memory,per_node", [(8, "80GiB", None), (8, "141GiB", None),
                                                   (64, "80GiB", 8)])
def test_plan_places_every_table_within_each_ranks_memory(tmp_path, ranks, memory, per_node):
    import json

    from conftest import failure, run_cli

    out = tmp_path / "plan.json"
    hosts = ["--gpus-per-node", str(per_node)] if per_node else []
    result = run_cli(["plan", "--config", str(CONFIG), "--world-size", str(ranks),
                      "--gpu-memory", memory, *hosts, "--out", str(out)])
    assert result.returncode == 0, failure(result)
    plan = json.loads(out.read_text())
    assert set(plan["tables"]) == {"t_user_id", "t_item_id", "t_user_action"}
    for name, table in plan["tables"].items():
        assert table["sharding"] == "data_parallel" or table["ranks"], f"{name} is not placed"
    assert plan["tables"]["t_item_id"]["rows"] == 9_390_000
    assert plan["tables"]["t_item_id"]["bags"] == 4096  # the candidate and 4095 history slots
    budget = plan["budget_bytes"]
    assert budget == int(memory[:-3]) * 2**30 - 8 * 2**30  # less parallel.reserve_per_rank
    assert len(plan["ranks"]) == ranks
    assert all(0 < r["bytes"] <= budget for r in plan["ranks"])
    assert "dense part fits in parallel.reserve_per_rank 8GiB" in result.stdout


def test_a_sequence_ranker_plans_without_a_dataset_only_from_three_cardinalities():
    from conftest import run_cli

    result = run_cli(["plan", "--config", str(CONFIG), "--set", "data.cardinalities=[10, 20]"])
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: model.sequence: hstu reads each row's history, which the planted click data has "
        "not; set data.path to a ranking dataset made by `preprocess interactions --labels ... "
        "--history L`, or, to plan without one, data.cardinalities to [users, items, action "
        "rows] (not [10, 20])"]


# --- the MLPerf log of a DLRMv4 run, and the compliance checker ---------------------------------

# The DLRMv4 config scaled down (small widths, 8 history slots), its optimizer as the rules fix it
# (learning rate 1e-6 x 256 / 8192), on a generated Yambda log: 17,170 training rows, 714 val.
TINY = ["data.global_batch_size=256", "optim.dense_lr=3.125e-8", "optim.embedding_lr=3.125e-8",
        "model.embedding_dim=16", "model.hstu.max_length=8", "model.hstu.layers=1",
        "model.hstu.heads=2", "model.hstu.attention_dim=8", "model.hstu.linear_dim=8",
        "model.bottom_mlp=[16, 16]", "model.top_mlp=[16, 1]", "train.max_steps=4",
        "train.eval_every=0", "train.progress_bar=false", "checkpoint.resume=none",
        "parallel.reserve_per_rank=1MiB"]
# The rule copy's only edits: the dataset's sizes, and the first-evaluation threshold as the same
# share of the tiny log (train/mlperf_dlrmv4.scaled_threshold); every other line is the rules'.
THRESHOLD = "math.floor((4480 * v['value'] + 135331840) / 3)"


def _rule_copy(folder: Path, train_samples: int, eval_samples: int) -> Path:
    text = RULES.read_text()
    edits = {"'train_samples': 2290835423,": f"'train_samples': {train_samples},",
             "v['value'] == 2058204": f"v['value'] == {eval_samples}",
             THRESHOLD: f"(4480 * v['value'] + 135331840) * {train_samples} // (3 * 2290835423)"}
    for old, new in edits.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (folder / "closed_dlrmv4.yaml").write_text(text)
    return folder / "closed_dlrmv4.yaml"


def _complaints(log: Path, folder: Path, *config: str) -> tuple:
    """The 6.1.0 checker's complaints, each as (key, failed test or requirement), or (None, its
    text) where it names no key; the rule files it ran; its output."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
         "--ruleset", "6.1.0", *config, "--log_output", str(folder / "checker.log"), str(log)],
        capture_output=True, text=True, cwd=folder, timeout=60)
    out = result.stdout + result.stderr
    ran = re.findall(r"Compliance checks: (\S+)", out)
    if result.returncode == 0:
        return set(), ran, out
    messages = out.split("WARNING - ", 1)[-1].split("ERROR - FAILED")[0].split("-" * 30)
    patterns = [r"CHECK for '(\w+)' failed in line \d+:.*?failed test:([^\n]*)",
                r"Failed checks for (\w+) :([^\n]*)", r"Required (\w+) occurrence of '(\w+)'"]
    pairs = set()
    for message in map(str.strip, messages):
        found = [m.groups() for m in (re.search(p, message, re.S) for p in patterns) if m]
        key, test = found[0] if found else (None, message)
        pairs.add((test, key) if key and key.isupper() else (key, test.strip()))  # Required: REQ, key
    return pairs, ran, out


def test_a_tiny_dlrmv4_run_passes_the_6_1_0_checker_but_for_what_its_size_cannot(tmp_path):
    """What a CPU run on a small log can show: every key of the 6.1.0 common rules, and of
    closed_dlrmv4.yaml with only the data's size constants scaled, holds; the rules' 4096-long
    sequences and AUC 0.75 (at the rules' learning rate within a 24,000-step warm-up) cannot."""
    import json

    from conftest import failure, run_cli

    for args in (["--generate", "20000", "--output", "synth"],
                 ["--input", "synth", "--output", "rank", "--history", "8"]):
        result = run_cli(["preprocess", "yambda", *args], cwd=tmp_path)
        assert result.returncode == 0, failure(result)
    log = tmp_path / "mlperf.log"
    other = run_cli(["train", "--config", str(CONFIG), *[a for s in [
        *TINY, "data.path=rank", "train.run_dir=run", f"train.mlperf_log={log}",
        "model.hstu.max_length=7"] for a in ("--set", s)]], cwd=tmp_path)
    assert other.returncode == 2 and not log.exists() and not (tmp_path / "run").exists()
    assert other.stderr.strip().splitlines()[-1] == (
        "error: model.hstu.max_length: 7, and rank has 8 history slots: the MLPerf log's "
        "max_sequence_length would not be the length trained; preprocess with --history 7, or "
        "set model.hstu.max_length=8")
    result = run_cli(["train", "--config", str(CONFIG), *[a for s in [
        *TINY, "data.path=rank", "train.run_dir=run", f"train.mlperf_log={log}"]
        for a in ("--set", s)]], cwd=tmp_path)
    assert result.returncode == 0, failure(result)
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines()]
    value = {e["key"]: e["value"] for e in events}
    assert (value["submission_benchmark"], value["train_samples"], value["eval_samples"]) == (
        "dlrmv4", 17170, 714)
    grid = EvalGrid.for_run(256, 17170)
    assert (grid.every, grid.first) == (1, 2)  # 0.1% of 17,170 < one batch; 340 samples -> 512
    evals = [e["metadata"]["samples_count"] for e in events if e["key"] == "eval_accuracy"]
    assert evals == [512, 768, 1024]  # steps 2, 3, 4: from grid.first on, none before

    copy = _rule_copy(tmp_path, 17170, 714)
    pairs, ran, out = _complaints(log, tmp_path, "--config", str(copy))
    assert pairs == {("max_sequence_length", "v['value'] == 4096"),
                     ("eval_accuracy", "v['value'] >= s['target_accuracy']")}, out
    pairs, ran, out = _complaints(log, tmp_path)  # the rules as shipped, common ones included
    assert ran == ["training_6.1.0/common.yaml", "training_6.1.0/closed_common.yaml",
                   "training_6.1.0/closed_dlrmv4.yaml"]
    dlrmv4_keys = {r["KEY"]["NAME"] for r in yaml.safe_load(RULES.read_text()) if "KEY" in r}
    assert pairs and {key for key, _ in pairs} <= dlrmv4_keys, out  # none of the common rules'


@pytest.mark.parametrize("override,key", [
    ("optim.dense=sgd", "optim.dense"), ("optim.dense_betas=[0.9, 0.999]", "optim.dense_betas"),
    ("optim.dense_clip_norm=0", "optim.dense_clip_norm"), ("optim.eps=1e-6", "optim.eps"),
    ("optim.embedding=adagrad", "optim.embedding"), ("optim.warmup_steps=0", "optim.warmup_steps"),
    ("optim.dense_lr=2e-6", "optim.dense_lr"),
    # the rules ramp to a constant rate: a decay the log does not name was once admitted
    ("optim.decay_start_step=100", "optim.decay_start_step"),
    ("optim.decay_steps=100", "optim.decay_steps")])
def test_a_dlrmv4_mlperf_run_refuses_what_the_closed_rules_forbid_in_one_line(override, key):
    from dlrm_hybrid.config import ConfigError
    from dlrm_hybrid.config_loading import load_config

    sets = ["train.mlperf_log=x.log", override]
    if key == "optim.dense_lr":
        sets.append("optim.embedding_lr=2e-6")
    with pytest.raises(ConfigError) as e:
        load_config(str(CONFIG), sets)
    assert str(e.value).startswith(f"{key}: ") and "\n" not in str(e.value)
    load_config(str(CONFIG), ["train.mlperf_log=x.log"])  # the config itself is admitted


def test_a_dataset_without_history_is_refused_with_a_remedy_that_exists():
    """It said 'or set model.hstu.max_length=0', a length HSTU cannot have."""
    from dlrm_hybrid.config import ConfigError
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.train.mlperf_dlrmv4 import check_history

    cfg = load_config(str(CONFIG), ["train.mlperf_log=x.log"])
    with pytest.raises(ConfigError) as e:
        check_history(cfg, ["user_id", "item_id"], "rank")
    assert str(e.value) == ("model.hstu.max_length: 4095, and rank has no history slots: "
                            "preprocess it with --history 4095")


def test_the_dlrmv4_schedule_is_the_grid_and_the_dcnv2_one_unchanged():
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.train.run_schedule import run_schedule

    cfg = load_config(str(CONFIG), ["train.mlperf_log=x.log"])
    run = run_schedule(cfg, TRAIN_SAMPLES)
    assert [s for s in range(1, 7841) if run.evaluates_at(s)] == [7000, 7280, 7560, 7840]
    assert run.mlperf_metadata(7000)["samples_count"] == 57_344_000
    assert run.mlperf_metadata(7001) is None  # off the grid: not an MLPerf evaluation
    plain = run_schedule(load_config(str(CONFIG)), TRAIN_SAMPLES)  # no MLPerf log: eval_every
    assert plain.grid is None and plain.evaluates_at(280)
    assert plain.mlperf_metadata(280) == {"epoch_num": 280 * 8192 / TRAIN_SAMPLES}
