"""A history user tower trains on 2 gloo ranks as on 1, step by step (its slots are lookups of
the sharded item table, the encoder data-parallel), and evaluates alike; a 2-rank checkpoint
resumes on 1 rank as the uninterrupted run."""

from __future__ import annotations

import pytest

from conftest import ROOT
from test_two_tower import assert_same_model, final_state
from variant_job import assert_close, assert_same_evaluations, launch, losses

JOB = ROOT / "tests/history_tower_job.py"
VARIANTS = ("mean", "attention")
METRICS = ("val_recall@10", "val_ndcg@10", "val_recall@100", "val_mrr")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("history_tower"), JOB, VARIANTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_train_the_one_rank_model_step_by_step(jobs, variant):
    assert_close(losses(jobs["two"] / variant), losses(jobs["one"] / variant), 1e-5)
    assert_same_model(jobs["two"] / variant, jobs["one"] / variant)
    state = final_state(jobs["one"] / variant)
    assert not [k for k in state if "user_id" in k]  # the history reads the item table only
    if variant == "attention":
        assert any(k.startswith("history.transformer.") for k in state)


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_ranks_evaluate_as_one(jobs, variant):
    assert_same_evaluations(jobs, variant, METRICS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_two_rank_checkpoint_resumed_on_one_rank_continues_the_run(jobs, variant):
    assert_close(losses(jobs["one"] / f"resumed_{variant}"), losses(jobs["two"] / variant)[5:],
                 1e-5)
