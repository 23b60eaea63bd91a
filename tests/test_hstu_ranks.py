"""The sequence model (model.kind hstu) trains on 2 gloo ranks as on 1, step by step: its item
table is sharded by the plan, its HSTU layers data-parallel, the softmax's candidates gathered
from every rank; it evaluates alike, and a 2-rank checkpoint resumes on 1 rank as the
uninterrupted run."""

from __future__ import annotations

import pytest

from conftest import ROOT
from test_two_tower import assert_same_model, final_state
from variant_job import assert_close, assert_same_evaluations, launch, losses

JOB = ROOT / "tests/hstu_job.py"
VARIANTS = ("in_batch",)
METRICS = ("val_recall@10", "val_ndcg@10", "val_recall@100", "val_mrr")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("hstu"), JOB, VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_train_the_one_rank_model_step_by_step(jobs, variant):
    assert_close(losses(jobs["two"] / variant), losses(jobs["one"] / variant), 1e-5)
    assert_same_model(jobs["two"] / variant, jobs["one"] / variant)
    state = final_state(jobs["one"] / variant)
    assert any(k.startswith("hstu.layers.0.uvqk") for k in state)
    assert not [k for k in state if "user_id" in k]  # a sequence reads the item table only


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_evaluate_as_one(jobs, variant):
    assert_same_evaluations(jobs, variant, METRICS)


def test_the_plan_names_the_sequence_model(jobs):
    assert "hstu: 2 layers, 2 heads" in jobs["stdout"]
    assert "sequences of up to 8 items" in jobs["stdout"]
    assert "t_item_id" in jobs["stdout"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_two_rank_checkpoint_resumed_on_one_rank_continues_the_run(jobs, variant):
    assert_close(losses(jobs["one"] / f"resumed_{variant}"), losses(jobs["two"] / variant)[5:],
                 1e-5)
