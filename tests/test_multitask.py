"""Multi-task ranking trains as the single-task ranker does: 2 gloo ranks train the 1-rank
model step by step with 3 tasks and missing labels (and with MMoE, and with each task's own
dots: model.task_dot_dim), a 2-rank checkpoint resumes on 1 rank as the uninterrupted run and
`eval` of it gives the run's per-task metrics; des, the train pipeline, bf16, dhen and dcn carry
over; a single-task checkpoint does not continue as a multi-task one. The loss, the heads and
the per-task dots against hand computations; the planted tasks' statistics."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, done_fields, failure, read_metrics, run_cli
from variant_job import assert_close, launch, losses

JOB = ROOT / "tests/multitask_job.py"
TWO_RANKS = ("three", "mmoe", "task_dots")  # trained on 1 and 2 ranks; mmoe's step 5 resumed
TASKS = {"three": ("click", "like", "see_less"), "mmoe": ("click", "like"),
         "task_dots": ("click", "like", "see_less")}
VAL_SAMPLES = 2048  # multitask_job.py's


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """variant_job.launch's runs of JOB, TWO_RANKS on 2 ranks."""
    return launch(tmp_path_factory.mktemp("multitask"), JOB, TWO_RANKS)


def last_eval(run_dir: Path) -> dict:
    return [e for e in read_metrics(run_dir) if "eval_s" in e][-1]


def final_state(run_dir: Path, step: int = 10) -> dict:
    from dlrm_hybrid.train.inference import read_model_state

    return read_model_state(run_dir / "checkpoints" / f"step_{step}")


def assert_same_model(a: Path, b: Path) -> None:
    """Every tensor of the two runs' final checkpoints (another reduction order's rounding,
    carried by row-wise Adagrad's first steps, stays far below these tolerances)."""
    import torch

    left, right = final_state(a), final_state(b)
    assert sorted(left) == sorted(right)
    for key in left:
        assert torch.allclose(left[key].double(), right[key].double(), rtol=1e-4, atol=1e-5), key


@pytest.mark.parametrize("variant", TWO_RANKS)
def test_two_ranks_train_the_one_rank_model_step_by_step(jobs, variant):
    assert_close(losses(jobs["two"] / variant), losses(jobs["one"] / variant), 1e-5)
    assert_same_model(jobs["two"] / variant, jobs["one"] / variant)
    record = last_eval(jobs["two"] / variant)
    assert record["samples"] == record["samples_click"] == VAL_SAMPLES  # the first: all labelled
    assert 0.6 < record["samples_like"] / VAL_SAMPLES < 0.8  # data.label_missing=0.3


def test_a_two_rank_checkpoint_resumed_on_one_rank_continues_the_run(jobs):
    resumed = jobs["one"] / "resumed_mmoe"
    assert read_metrics(resumed)[0]["step"] == 5
    assert_close(losses(resumed), losses(jobs["two"] / "mmoe")[5:], 1e-5)
    assert_same_model(resumed, jobs["two"] / "mmoe")


def test_eval_of_a_two_rank_checkpoint_on_one_rank_gives_the_runs_per_task_metrics(jobs):
    run = jobs["two"] / "mmoe"
    record = last_eval(run)
    result = run_cli(["eval", "--checkpoint", str(run / "checkpoints/step_10"), "--split", "val"])
    assert result.returncode == 0, failure(result)
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("eval: ") and " split=val " in line, line
    fields = dict(item.split("=") for item in line.split()[1:])
    names = [f"{m}_{t}" for t in TASKS["mmoe"]
             for m in ("val_auc", "val_logloss", "oracle_auc", "samples")]
    assert {k: float(fields[k]) for k in names} == {k: round(record[k], 5) for k in names}


def test_per_task_metrics_are_recorded_shown_and_mirrored_to_tensorboard(jobs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = jobs["two"] / "three"
    record = last_eval(run)
    assert record["step"] == 10 and "val_auc" not in record
    shown = done_fields(next(line for line in jobs["stdout"].splitlines()
                             if line.startswith("done: ")))  # the first variant's: three
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    oracles = set()
    for task in TASKS["three"]:
        for key in (f"val_auc_{task}", f"val_logloss_{task}", f"oracle_auc_{task}"):
            [point] = events.Scalars(f"eval/{key}")
            assert point.step == 10 and point.value == pytest.approx(record[key], rel=1e-6)
            assert shown[key] == round(record[key], 5), key
        assert 0.6 < record[f"oracle_auc_{task}"] < 0.9
        oracles.add(record[f"oracle_auc_{task}"])
    assert len(oracles) == 3  # each task's own teacher


def test_des_trains_as_the_pooled_exchange(jobs):
    assert read_metrics(jobs["one"] / "des")[0]["step"] == 0
    assert_close(losses(jobs["one"] / "des"), losses(jobs["one"] / "mmoe"), 1e-5)


def test_the_train_pipeline_trains_the_same_model(jobs):
    run = jobs["one"] / "pipeline"
    assert read_metrics(run)[0]["step_driver"] == "torchrec pipeline"
    assert_close(losses(run), losses(jobs["one"] / "three"), 1e-6)


def test_bf16_trains_close_to_fp32(jobs):
    bf16, fp32 = losses(jobs["one"] / "bf16"), losses(jobs["one"] / "three")
    assert bf16 != fp32  # it did compute in bf16
    assert_close(bf16, fp32, 2e-2)


@pytest.mark.parametrize("variant", ["dhen", "dcn_stacked", "dcn_parallel"])
def test_dhen_and_dcn_train_with_task_heads(jobs, variant):
    run = jobs["one"] / variant
    assert len(losses(run)) == 3 and all(math.isfinite(x) for x in losses(run))
    record = last_eval(run)
    assert all(0 < record[f"val_auc_{t}"] < 1 for t in TASKS["three"]), record
    heads = {k.split(".heads.")[1].split(".")[0] for k in final_state(run, 3) if ".heads." in k}
    assert heads == {"0", "1", "2"}


def resume_cli(run: Path, step: int, tmp_path: Path, *sets: str):
    """`train` resuming `run`'s checkpoint at `step` with its own config and `sets`."""
    overrides = [f"train.run_dir={tmp_path}",
                 f"checkpoint.resume={run / 'checkpoints' / f'step_{step}'}", *sets]
    return run_cli(["train", "--config", str(run / "config.yaml"),
                    *[a for o in overrides for a in ("--set", o)]])


def test_a_single_task_checkpoint_does_not_continue_as_a_multi_task_model(jobs, tmp_path):
    result = resume_cli(jobs["one"] / "single", 2, tmp_path,
                        "model.tasks=[{name: click}, {name: like}]")
    assert result.returncode == 2, failure(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: model.tasks: ") and "single-task (click) model" in line, line
    assert "cannot continue as a multi-task one (click, like)" in line
    assert not (tmp_path / "checkpoints").exists()


def test_a_multi_task_checkpoint_does_not_continue_as_a_single_task_model(jobs, tmp_path):
    result = resume_cli(jobs["two"] / "three", 10, tmp_path, "model.tasks=[]",
                        "data.label_missing=0")
    assert result.returncode == 2, failure(result)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: model.tasks: ") and "(click, like, see_less)" in line, line
    assert "multi-task model cannot continue as a single-task (click) one" in line


def test_the_value_model_may_change_on_resume(jobs, tmp_path):
    """Ranking by other weights is no other experiment (nothing is left to train here)."""
    result = resume_cli(jobs["two"] / "three", 10, tmp_path,
                        "value_model={click: 1.0, like: 2.0, see_less: -3.0}")
    assert result.returncode == 0, failure(result)
    assert "nothing left to train: the checkpoint is at step 10" in result.stdout


@pytest.mark.parametrize("sets, message", [
    (["model.tasks=[{name: click}, {name: click}]"], "model.tasks[1].name: click is listed twice"),
    (["model.tasks=[{name: click, weight: 0}]"], "model.tasks: every weight is 0"),
    (["model.mmoe.experts=2"], "model.mmoe.experts: gates one mix of experts per task"),
    (["value_model={like: 1}"], "value_model.like: no such task; the model's tasks are click"),
    (["data.label_missing=0.2", "model.tasks=[{name: click}]"],
     "data.label_missing: 0.2 leaves out the planted labels after the first"),
    (["model.tasks=[{name: a}, {name: b}]", "train.target_auc=0.8"],
     "train.target_auc: 0.8 works with one click label"),
    (["model.task_dot_dim=4"], "model.task_dot_dim: gives each task its own dot interaction, "
                               "and model.tasks is empty"),
    (["model.tasks=[{name: a}]", "model.task_dot_dim=4", "model.interaction=cat"],
     "model.task_dot_dim: needs the bottom-MLP output and the pooled vectors of one width"),
    (["model.tasks=[{name: a}]", "model.task_dot_dim=-1"], "model.task_dot_dim: must be >= 0"),
])
def test_task_settings_that_cannot_train_are_refused_in_one_line(sets, message):
    from dlrm_hybrid.config import ConfigError
    from dlrm_hybrid.config_loading import load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, sets)
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def loop_loss(logits, labels, weights):
    """multitask_loss's definition sample by sample and task by task, missing labels skipped."""
    import torch

    total = torch.zeros((), dtype=torch.float64)
    for i in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            y = float(labels[i, t])
            if math.isnan(y):
                continue
            p = torch.sigmoid(logits[i, t].double())
            total = total - weights[t] * (y * torch.log(p) + (1 - y) * torch.log(1 - p))
    return total / labels.shape[0]


def test_multitask_loss_and_its_gradient_match_a_loop_over_the_labels_present():
    import torch

    from dlrm_hybrid.model.task_heads import multitask_loss

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 3, generator=gen, dtype=torch.float64)
    labels = (torch.rand(16, 3, generator=gen) < 0.4).double()
    labels[torch.rand(16, 3, generator=gen) < 0.3] = math.nan
    labels[:, 0] = torch.where(labels[:, 0].isnan(), 1.0, labels[:, 0])
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    mine = logits.clone().requires_grad_()
    got = multitask_loss(mine, labels, weights)
    got.backward()
    ref_logits = logits.clone().requires_grad_()
    want = loop_loss(ref_logits, labels, weights)
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)  # it computes in float32
    assert torch.allclose(mine.grad, ref_logits.grad, rtol=1e-5, atol=1e-8)
    missing = labels.isnan()
    assert missing.any() and (mine.grad[missing] == 0).all()  # left out, not read as 0
    # The weights scale each task's part: doubling one task's weight adds that part once more.
    heavier = weights.clone()
    heavier[2] *= 2
    part = loop_loss(logits, labels, torch.tensor([0.0, 0.0, 2.0], dtype=torch.float64))
    assert multitask_loss(logits, labels, heavier).item() == pytest.approx(
        want.item() + part.item(), rel=1e-6)


def test_a_task_without_labels_gives_its_head_no_gradient():
    import torch

    from dlrm_hybrid.model.task_heads import TaskHeads, multitask_loss

    torch.manual_seed(0)
    heads = TaskHeads(8, [[4], [4], []], experts=2, expert_mlp=[6])
    labels = (torch.rand(32, 3) < 0.5).float()
    labels[:, 1] = math.nan
    multitask_loss(heads(torch.randn(32, 8)), labels, torch.ones(3)).backward()
    assert all((p.grad == 0).all() for p in heads.heads[1].parameters())
    assert all(p.grad.abs().sum() > 0 for p in heads.heads[0].parameters())
    assert all(p.grad.abs().sum() > 0 for p in heads.heads[2].parameters())


def test_mmoe_heads_read_their_own_softmax_gated_mix_of_experts():
    import torch

    from dlrm_hybrid.model.task_heads import TaskHeads

    torch.manual_seed(0)
    T, K = 3, 4
    heads = TaskHeads(10, [[5], [], [7, 3]], experts=K, expert_mlp=[8, 6])
    x = torch.randn(5, 10)
    experts = [torch.relu(e[0][2](torch.relu(e[0][0](x)))) for e in heads.experts]  # [B, 6] each
    scores = heads.gates(x)  # [B, T * K], task t's K columns together
    want = []
    for t in range(T):
        gate = torch.softmax(scores[:, t * K:(t + 1) * K], dim=1)
        mix = sum(gate[:, k:k + 1] * experts[k] for k in range(K))
        want.append(heads.heads[t](mix))
    assert torch.allclose(heads(x), torch.cat(want, dim=1), atol=1e-6)
    scripted = torch.jit.script(heads)  # the exported model carries the heads
    assert torch.allclose(scripted(x), heads(x))


def test_each_task_adds_its_own_weighted_dots_of_its_own_projections():
    """model.task_dot_dim: task t's logit is its head's plus sum_{i<j} w_t,ij <P_t v_i,
    P_t v_j> over v = [bottom-MLP output, pooled embeddings]; a single-task model is unchanged."""
    import torch

    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synthetic import SyntheticClicks
    from dlrm_hybrid.model.dlrm import build_model

    tasks = "model.tasks=[{name: click}, {name: like, head: [4]}, {name: see_less}]"
    cfg = load_config(None, [tasks, "model.task_dot_dim=3", "data.val_samples=64"])
    data = SyntheticClicks(cfg.data, ("click", "like", "see_less"))
    torch.manual_seed(0)
    model = build_model(cfg.model, data.spec, torch.device("cpu")).eval()
    assert (model.over_arch.pair_weights == 1).all()  # a factorization machine per task at first
    with torch.no_grad():  # then any weights
        model.over_arch.pair_weights.uniform_(-1, 1)
    batch = data.batch("val", 0, 64)
    with torch.no_grad():
        pooled = model.pooled_embeddings(batch.sparse)
        bottom = model.dense_arch(batch.dense)
        shared = model.over_arch.inner(model.interaction.inner(bottom, pooled))
        v = torch.cat((bottom[:, None], pooled), dim=1).double()
        n, projection = v.shape[1], model.interaction.projection.weight.double()
        want = shared.double().clone()
        for t in range(3):
            p_t = v @ projection[3 * t:3 * (t + 1)].T  # [B, n, 3]
            pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
            for k, (i, j) in enumerate(pairs):
                want[:, t] += model.over_arch.pair_weights[t, k].double() * (
                    p_t[:, i] * p_t[:, j]).sum(1)
        got = model(batch.dense, batch.sparse)
    assert (want - shared).abs().min() > 0  # every task's dots count
    assert torch.allclose(got.double(), want, atol=1e-5)
    # without it (the default), the names a multi-task checkpoint written before it holds
    before = build_model(load_config(None, [tasks]).model, data.spec, torch.device("cpu"))
    names = [k for k in before.state_dict() if not k.startswith("embedding_bags.")]
    assert "over_arch.model.1.heads.1.0.weight" in names
    assert not [k for k in names if ".inner." in k or "projection" in k or "pair_weights" in k]


def planted(tasks, **data):
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.synthetic import SyntheticClicks

    sets = [f"data.{k}={v}" for k, v in data.items()]
    cfg = load_config(None, ["model.tasks=[" + ", ".join(f"{{name: {t}}}" for t in tasks) + "]",
                             *sets])
    dataset = SyntheticClicks(cfg.data, tasks)
    dataset.use_tasks(tasks, "the planted data")
    return dataset.columns("val", 0, cfg.data.val_samples)


def test_planted_tasks_have_their_own_rates_oracles_and_missing_labels():
    import torch
    from torchmetrics.functional.classification import binary_auroc

    columns = planted(["click", "like", "see_less"], val_samples=16384, label_missing=0.25)
    labels, prob = columns.labels, columns.true_prob
    assert labels.shape == prob.shape == (16384, 3)
    missing = np.isnan(labels).mean(axis=0)
    assert missing[0] == 0 and all(abs(m - 0.25) < 0.02 for m in missing[1:]), missing
    rates = np.nanmean(labels, axis=0)
    assert rates[0] > rates[1] + 0.03 > rates[2] + 0.06, rates  # biases -1.2, -1.8, -2.4
    oracles = []
    for t in range(3):
        keep = ~np.isnan(labels[:, t])
        oracles.append(binary_auroc(torch.from_numpy(prob[keep, t]),
                                    torch.from_numpy(labels[keep, t]).long()).item())
    assert all(a > 0.65 for a in oracles) and len(set(oracles)) == 3, oracles


@pytest.mark.parametrize("rho, within", [(0.0, 0.05), (0.5, 0.05), (1.0, 1e-4)])
def test_planted_tasks_true_logits_correlate_as_data_task_correlation_says(rho, within):
    """Shared and own latent factors in the proportion rho: corr(logit_s, logit_t) ~ rho on
    8192 samples of seed 1234. A correlation's sampling error is ~1/sqrt(n) = 0.011; on top, a
    fixed teacher's shared and own factors correlate a little over a table's few frequent ids
    (up to 0.034 here; 0.039 with the default tables of 1000, 100, 10 rows)."""
    prob = planted(["a", "b", "c"], task_correlation=rho, val_samples=8192,
                   cardinalities="[5000,2000,1000]").true_prob
    logits = np.log(prob.astype(np.float64)) - np.log1p(-prob.astype(np.float64))
    corr = np.corrcoef(logits.T)
    assert all(abs(corr[s, t] - rho) < within for s in range(3) for t in range(s)), corr
