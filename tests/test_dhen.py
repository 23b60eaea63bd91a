"""DHEN (model/dhen.py): each module and the layer against their equations written out from
docs/dhen.md, activation checkpointing against the plain forward, and a tiny DHEN trained,
evaluated, exported and served through the CLI; its config mistakes are one-line errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import done_fields, failure, read_metrics, run_cli
from dlrm_hybrid.config import DHEN_MODULES, DcnConfig, DhenConfig
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.model.dhen import DHEN, MODULES, DhenLayer
from dlrm_hybrid.model.interactions import build_interaction

B, L_IN, L_OUT, D, HEADS = 3, 4, 3, 4, 2  # tiny: a batch of lists of 4 vectors of 4, mapped to 3


def along(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W X for every sample: a map along the list."""
    return torch.einsum("ol,bld->bod", w, x)


def randomized(module: nn.Module) -> nn.Module:
    """In float64 with every parameter random (biases and norms included), so none is a no-op."""
    torch.manual_seed(0)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
    return module


def list_input() -> torch.Tensor:
    return torch.randn(B, L_IN, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def encoder_reference(m, x):
    encoder = nn.TransformerEncoderLayer(D, HEADS, dim_feedforward=4 * D, dropout=0.0,
                                         batch_first=True).double()
    encoder.load_state_dict(m.encoder.state_dict())  # its shapes are the defined ones
    return along(m.w.weight, encoder(x)), sum(p.numel() for p in encoder.parameters())


def conv_reference(m, x):
    kernel, (bias,) = m.conv.weight[0, 0], m.conv.bias
    padded = F.pad(x, (1, 1, 1, 1))
    conv = bias + sum(kernel[a, b] * padded[:, a:a + L_IN, b:b + D]
                      for a in range(3) for b in range(3))
    return along(m.w.weight, conv), 0


def dot_reference(m, x):
    pairs = torch.stack([(x[:, i] * x[:, j]).sum(1)
                         for i in range(L_IN) for j in range(i + 1, L_IN)], dim=1)
    return (pairs @ m.out.weight.T + m.out.bias).reshape(B, L_OUT, D), 0


def dcn_reference(m, x):
    outer_sum = sum(torch.einsum("bi,bj->bij", x[:, i], x[:, i]) for i in range(L_IN))
    return m.weight @ outer_sum + m.bias, 0


PAIRS = L_IN * (L_IN - 1) // 2
REFERENCES = {  # (u from the definition, parameters of the module beyond the reference's own)
    "linear": (lambda m, x: (along(m.w.weight, x), 0), L_OUT * L_IN),
    "self_attention": (encoder_reference, L_OUT * L_IN),
    "conv": (conv_reference, 9 + 1 + L_OUT * L_IN),
    "dot": (dot_reference, PAIRS * L_OUT * D + L_OUT * D),
    "dcn": (dcn_reference, 2 * L_OUT * D),
}


def test_the_config_names_the_modules_the_model_has():
    assert set(DHEN_MODULES) == set(MODULES) == set(REFERENCES)


@pytest.mark.parametrize("name", REFERENCES)
def test_each_module_computes_its_definition(name):
    module = randomized(MODULES[name](L_IN, L_OUT, D, HEADS))
    x = list_input()
    reference, counted = REFERENCES[name]
    expected, reference_parameters = reference(module, x)
    torch.testing.assert_close(module(x), expected)
    assert sum(p.numel() for p in module.parameters()) == counted + reference_parameters


@pytest.mark.parametrize("ensemble", ["concat", "sum"])
@pytest.mark.parametrize("width", [L_OUT, L_IN])
def test_a_layer_ensembles_its_modules_adds_the_skip_and_normalises(ensemble, width):
    """X_{n+1} = LayerNorm(ensemble(u_1..u_k) + skip(X_n)); the skip is a map S along the list
    only when the widths differ."""
    layer = randomized(DhenLayer(["linear", "dcn"], L_IN, width, D, HEADS, ensemble))
    x = list_input()
    outputs = [module(x) for module in layer.interactions]
    if ensemble == "concat":
        mixed = along(layer.project.weight, torch.cat(outputs, dim=1))
    else:
        mixed = outputs[0] + outputs[1]
    skip = x if width == L_IN else along(layer.skip.weight, x)
    expected = F.layer_norm(mixed + skip, (D,), layer.norm.weight, layer.norm.bias)
    torch.testing.assert_close(layer(x), expected)
    own = sum(p.numel() for p in layer.parameters()) - sum(
        p.numel() for m in layer.interactions for p in m.parameters())
    assert own == ((2 * width * width if ensemble == "concat" else 0)
                   + (0 if width == L_IN else width * L_IN) + 2 * D)


def test_the_stack_feeds_each_layer_the_one_before_and_flattens_the_last():
    cfg = DhenConfig(layers=2, modules=list(MODULES), width=2, heads=HEADS)
    dhen, out_width = build_interaction("dhen", L_IN - 1, D, D, False, DcnConfig(), cfg)
    randomized(dhen)
    x = list_input()
    first, second = dhen.layers
    expected = second(first(x)).flatten(1)  # layer 2 reads layer 1's [B, 2, d]
    assert second.interactions[0].w.weight.shape == (2, 2) and out_width == 2 * D
    torch.testing.assert_close(dhen(x[:, 0], x[:, 1:]), expected)


def backward_of(dhen: DHEN, dense: torch.Tensor, sparse: torch.Tensor):
    """(loss, its gradients, tensors the forward saved for the backward)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = dhen(dense, sparse).square().mean()
    loss.backward()
    grads = [p.grad for p in dhen.parameters()] + [dense.grad]
    return loss, grads, len(saved)


def test_activation_checkpointing_gives_the_same_gradients_and_saves_fewer_tensors():
    cfg = DhenConfig(layers=2, modules=list(MODULES), width=3, heads=HEADS)
    torch.manual_seed(0)
    plain = DHEN(L_IN - 1, D, cfg)
    recomputed = DHEN(L_IN - 1, D, dataclasses.replace(cfg, activation_checkpointing=True))
    recomputed.load_state_dict(plain.state_dict())
    x = list_input().float()
    results = [backward_of(m, x[:, 0].clone().requires_grad_(), x[:, 1:]) for m in
               (plain, recomputed)]
    (loss, grads, saved), (loss_r, grads_r, saved_r) = results
    torch.testing.assert_close(loss_r, loss)
    for grad, grad_r in zip(grads, grads_r, strict=True):
        torch.testing.assert_close(grad_r, grad)
    assert saved_r < saved / 10, (saved_r, saved)
    plain.eval()  # evaluation keeps what it needs: it recomputes nothing
    recomputed.eval()
    eval_saved = [backward_of(m, x[:, 0].clone().requires_grad_(), x[:, 1:])[2]
                  for m in (plain, recomputed)]
    assert eval_saved == [saved, saved]


ALL_MODULES = "model.dhen.modules=[linear, self_attention, conv, dot, dcn]"
TINY = """\
model: {embedding_dim: 8, bottom_mlp: [16, 8], top_mlp: [16, 1], interaction: dhen,
        dhen: {layers: 2, width: 3, heads: 2}}
data: {global_batch_size: 128, num_dense: 3, cardinalities: [50, 20, 7], hotness: [1, 2, 1],
       train_samples: 4096, val_samples: 1024, teacher_scale: 2.0}
train: {max_steps: 30, log_every: 10, progress_bar: false}
checkpoint: {resume: none}
"""


def sets(*overrides: str) -> list:
    return [arg for o in overrides for arg in ("--set", o)]


@pytest.fixture(scope="module")
def dhen_run(tmp_path_factory):
    """A tiny two-layer DHEN of all five modules trained for 30 steps on a `synth` dataset."""
    root = tmp_path_factory.mktemp("dhen")
    (root / "tiny.yaml").write_text(TINY)
    synth = run_cli(["synth", "--config", str(root / "tiny.yaml"), "--output", str(root / "data")])
    assert synth.returncode == 0, failure(synth)
    train = run_cli(["train", "--config", str(root / "tiny.yaml"), *sets(
        ALL_MODULES, f"data.path={root / 'data'}", f"train.run_dir={root / 'run'}")])
    assert train.returncode == 0, failure(train)
    return {"root": root, "train": train, "checkpoint": root / "run" / "checkpoints" / "step_30"}


def test_a_dhen_trains_through_the_cli_and_writes_its_checkpoint(dhen_run):
    done = done_fields(dhen_run["train"].stdout)
    assert done["steps"] == 30 and math.isfinite(done["train_loss"])
    assert 0.5 < done["val_auc"] < 1
    assert (dhen_run["checkpoint"] / "meta.json").is_file()


def test_its_exported_model_predicts_evals_auc(dhen_run):
    root, checkpoint = dhen_run["root"], dhen_run["checkpoint"]
    evaluated = run_cli(["eval", "--checkpoint", str(checkpoint), "--split", "val"])
    assert evaluated.returncode == 0, failure(evaluated)
    auc = f"{done_fields(dhen_run['train'].stdout)['val_auc']:.5f}"
    assert f" val_auc={auc} " in evaluated.stdout.splitlines()[-1]
    exported = run_cli(["export", "--checkpoint", str(checkpoint), "--out", str(root / "m.pt")])
    assert exported.returncode == 0, failure(exported)
    predicted = run_cli(["predict", "--model", str(root / "m.pt"), "--data", str(root / "data"),
                         "--split", "val", "--out", str(root / "p.txt")])
    assert predicted.returncode == 0, failure(predicted)
    assert f" samples=1024 auc={auc} " in predicted.stdout


def test_a_dhen_trains_in_bf16_with_qr_tables_the_train_pipeline_and_checkpointing(tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY)
    result = run_cli(["train", "--config", str(tmp_path / "tiny.yaml"), *sets(
        ALL_MODULES, "train.precision=bf16", "train.precision_fallback=false",
        "train.pipeline=enabled",
        "model.dhen.activation_checkpointing=true", f"train.run_dir={tmp_path / 'run'}",
        "model.compositional=[{technique: qr, collisions: 4, operation: mult, rows_above: 30}]")])
    assert result.returncode == 0, failure(result)
    assert "cat_0 (50 rows): qr mult c=4" in result.stdout
    first = read_metrics(tmp_path / "run")[0]
    assert first["step_driver"] == "torchrec pipeline" and first["precision"] == "bf16"
    done = done_fields(result.stdout)
    assert math.isfinite(done["train_loss"]) and done["val_auc"] > 0.5


@pytest.mark.parametrize("overrides, message", [
    (["model.dhen.modules=[dot, attention]"], "model.dhen.modules: 'attention' is not a module; "
     "use linear, self_attention, conv, dot, dcn"),
    (["model.dhen.modules=[]"], "model.dhen.modules: empty; name at least one of linear, "
     "self_attention, conv, dot, dcn"),
    (["model.dhen.modules=[dot, conv, dot]"], "model.dhen.modules: dot is listed twice; name "
     "each module once"),
    (["model.dhen.heads=3"], "model.dhen.heads: 3 does not divide model.embedding_dim (16), "
     "which self_attention splits among its heads; use a divisor of 16"),
    (["model.dhen.width=-1"], "model.dhen.width: must be >= 0 (0: the input's length, the "
     "tables + 1), got -1"),
    (["model.dhen.width=1"], "model.dhen.width: 1 leaves the dot module of layers 2.. a list of "
     "one vector, without pairs to dot; use a width of 2 or more (or 0)"),
])
def test_dhen_config_mistakes_are_one_line_errors(overrides, message):
    result = run_cli(["train", *sets("model.interaction=dhen", *overrides)])
    assert result.returncode == 2, failure(result)
    assert result.stderr.strip().splitlines() == [f"error: {message}"]


def test_dhen_settings_are_unused_by_other_interactions():
    """Nothing reads model.dhen with `dot`; with one layer, dot needs no second layer's pairs;
    without self_attention, heads are unused."""
    load_config(None, ["model.dhen.modules=[]", "model.dhen.heads=3", "model.dhen.width=-1"])
    load_config(None, ["model.interaction=dhen", "model.dhen.modules=[dot]", "model.dhen.heads=3",
                       "model.dhen.width=1", "model.dhen.layers=1"])
