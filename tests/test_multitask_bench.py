"""benchmarks/multitask.py: what its comparison rests on (a single-task model trains on the same
planted labels as the multi-task model, its loss that task's alone) and its summary line."""

import re

import pytest

from conftest import load_script
from dlrm_hybrid.config_loading import load_config

TASKS = ("click", "like", "see_less")
PLANTED = ["data.label_missing=0.3"]


@pytest.fixture(scope="module")
def bench():
    """benchmarks/multitask.py, loaded from its file (benchmarks/ is no package)."""
    return load_script("benchmarks/multitask.py", "multitask_bench")


def test_a_single_task_model_trains_its_task_alone_on_the_multi_task_models_data(bench):
    """The planted labels are a function of the data settings and the task list (task t's
    teacher is the t-th), so the single-task model keeps every task, and the same data
    settings, and weighs the others 0: its loss is its task's alone."""
    multi = load_config(None, PLANTED + [bench.tasks_set(TASKS)])
    single = load_config(None, PLANTED + [bench.tasks_set(TASKS, only="like")])
    assert [t.name for t in single.model.tasks] == [t.name for t in multi.model.tasks] \
        == list(TASKS)
    assert single.data == multi.data
    assert [t.weight for t in multi.model.tasks] == [1.0, 1.0, 1.0]
    assert [t.weight for t in single.model.tasks] == [0.0, 1.0, 0.0]
    assert [t.head for t in single.model.tasks] == [t.head for t in multi.model.tasks] \
        == [bench.HEAD] * 3


def test_the_summary_line_names_each_tasks_auc_in_task_order(bench):
    line = bench.summary_line(TASKS, [0.71, 0.7, 0.69], [0.65, 0.64444, 0.63],
                              [0.795, 0.7949, 0.8132], [0.75, 0.74, 0.76])
    assert line == ("multitask: tasks=3 multi_auc=0.7100,0.7000,0.6900 "
                    "single_auc=0.6500,0.6444,0.6300 oracle_auc=0.7950,0.7949,0.8132 "
                    "own_dots_auc=0.7500,0.7400,0.7600")
    number = r"\d\.\d{4}"
    assert re.fullmatch(rf"multitask: tasks=3( \w+_auc={number}(,{number}){{2}}){{4}}", line)


def test_the_own_dots_row_gives_each_task_room_and_its_own_dots(bench):
    """The row's model holds the shared and every task's own teacher latents (8 each) in a
    row, and projects them per task: a model the planted teacher's task logits fit."""
    cfg = load_config(None, PLANTED + [bench.tasks_set(TASKS), *bench.OWN_DOTS])
    assert cfg.model.embedding_dim >= cfg.data.teacher_dim * (1 + len(TASKS))
    assert cfg.model.task_dot_dim >= 2 * cfg.data.teacher_dim


@pytest.mark.parametrize("steps", [1500, 60])
def test_one_model_per_task_is_trained_at_the_own_dots_rows_budget(bench, steps):
    """The own-dots row trains OWN_DOTS_BUDGET x S steps; a row of one model per task at the
    same number of training samples stands beside it, and the shared trunk keeps S."""
    rows = bench.plans(TASKS, steps)
    own_steps, own_runs = rows[bench.OWN_DOTS_ROW]
    assert own_steps == steps * bench.OWN_DOTS_BUDGET and len(own_runs) == 1
    singles = {name: n * len(runs) for name, (n, runs) in rows.items()
               if name.startswith("single-task")}
    assert own_steps in singles.values()
    assert singles["single-task, one per task"] == steps
    assert rows["multi-task, shared trunk"][0] == steps
