"""Multi-task models in the tools around training: the planner's dense memory model, `plot`,
and `bench`'s refusal."""

import argparse
import json
from collections import Counter

import pytest

from conftest import run_cli
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.curves import read_run, run as plot
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.parallel.dense_memory import dense_units

TASKS = ["model.tasks=[{name: click}, {name: like, head: [7, 5]}, {name: see_less, head: [3]}]",
         "model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[12,6,1]",
         "data.num_dense=5", "data.cardinalities=[50,40,30,20]"]
CASES = {
    "dot": [],
    "mmoe": ["model.mmoe.experts=3", "model.mmoe.expert_mlp=[9,4]"],
    "dcn parallel": ["model.interaction=dcn", "model.dcn.structure=parallel", "model.dcn.rank=6"],
    "dcn parallel no hidden, mmoe": ["model.interaction=dcn", "model.dcn.structure=parallel",
                                     "model.dcn.rank=6", "model.top_mlp=[1]",
                                     "model.mmoe.experts=2"],
    "per-task dots": ["model.task_dot_dim=3"],
    "per-task dots around dhen's layers": ["model.task_dot_dim=2", "model.interaction=dhen"],
}


@pytest.mark.parametrize("case", CASES)
def test_the_planners_dense_parameters_include_the_task_heads_and_experts(case):
    from dlrm_hybrid.model.dlrm import build_model

    cfg = load_config(None, TASKS + CASES[case])
    spec = DataSpec.from_config(cfg.data)
    analytic = Counter(s for u in dense_units(cfg.model, spec.num_dense, len(spec.cardinalities))
                       for s in u.shapes)
    model = build_model(cfg.model, spec)
    built = Counter(tuple(p.shape) for name, p in model.named_parameters()
                    if not name.startswith("embedding_bags."))
    assert analytic == built


def test_plot_draws_each_tasks_auc(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": 10, "loss": 0.9, "elapsed_s": 1.0},
               {"step": 10, "val_auc_click": 0.61, "val_auc_like": 0.58, "val_logloss_like": 0.4,
                "oracle_auc_like": 0.8, "elapsed_s": 1.5},
               {"step": 20, "val_auc_click": 0.66, "val_auc_like": 0.6, "elapsed_s": 2.5}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = dict(read_run(str(run), "run").eval_curves())
    assert curves == {" click": [(10, 1.5, 0.61), (20, 2.5, 0.66)],
                      " like": [(10, 1.5, 0.58), (20, 2.5, 0.6)]}
    plot(argparse.Namespace(run_dirs=[str(run)], out=None))  # the CLI: tests/test_curves.py
    assert (run / "curves.png").stat().st_size > 0


def test_bench_refuses_a_multi_task_config_in_one_line():
    result = run_cli(["bench", "--set", TASKS[0]])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: bench: its baseline is a one-logit DLRM, and model.tasks names 3 tasks; "
        "benchmarks/multitask.py measures the cost of each task per step"]


def test_a_model_of_some_planted_labels_learns_their_own_teachers():
    """data.labels plants click, like, see_less; a model of `like` alone reads like's labels and
    true probabilities, not the first teacher's."""
    import numpy as np

    from dlrm_hybrid.data.source import open_dataset
    from dlrm_hybrid.data.synthetic import SyntheticClicks

    planted = ["data.labels=[click,like,see_less]", "data.cardinalities=[50,40]"]
    cfg = load_config(None, planted + ["model.tasks=[{name: like}]"])
    like = open_dataset(cfg.data, cfg.model).columns("val", 0, 512)
    every = SyntheticClicks(cfg.data, ["click", "like", "see_less"])
    every.use_tasks(["click", "like", "see_less"], "planted")
    columns = every.columns("val", 0, 512)
    assert np.array_equal(like.true_prob[:, 0], columns.true_prob[:, 1])
    assert np.array_equal(like.labels[:, 0], columns.labels[:, 1])
    with pytest.raises(ValueError, match=r"^model.tasks: share is not one of data.labels "):
        load_config(None, planted + ["model.tasks=[{name: share}]"])


def test_multihot_keeps_every_label_of_a_multi_label_dataset(tmp_path):
    import numpy as np

    from dlrm_hybrid.data.split_binary import SplitBinaryDataset

    one_hot, multi_hot = tmp_path / "one_hot", tmp_path / "multi_hot"
    synth = run_cli(["synth", "--output", str(one_hot), "--set", "data.cardinalities=[30,20]",
                     "--set", "data.train_samples=300", "--set", "data.val_samples=100",
                     "--set", "model.tasks=[{name: click}, {name: like}]",
                     "--set", "data.label_missing=0.4"])
    assert synth.returncode == 0, synth.stderr
    result = run_cli(["preprocess", "multihot", "--input", str(one_hot), "--output",
                      str(multi_hot), "--hotness", "3,2"])
    assert result.returncode == 0, result.stderr
    before, after = SplitBinaryDataset(str(one_hot)), SplitBinaryDataset(str(multi_hot))
    assert after.label_names == ("click", "like")
    for split in ("train", "val"):
        a, b = (d.columns(split, 0, d.num_samples(split)) for d in (before, after))
        assert np.isnan(a.labels[:, 1]).any()
        np.testing.assert_array_equal(a.labels, b.labels)  # NaN where missing, in both
