"""MLPerf DLRMv4 mode: the evaluation grid as closed_dlrmv4.yaml computes it (checked against the
rule file's own code), the optimizer settings the rules fix, and `plan` for its config."""

from __future__ import annotations

import math
from pathlib import Path

import mlperf_logging
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from dlrm_hybrid.train.mlperf_dlrmv4 import (TRAIN_SAMPLES, EvalGrid, eval_interval_samples,
                                             first_eval_samples)

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
    assert grid.samples_count(grid.every) == s["eval_interval_samples"]
