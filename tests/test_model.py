"""The DLRM and its interactions."""

import hashlib
import json
import warnings

import pytest
import torch
import yaml
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM as TorchrecDLRM
from torchrec.modules.crossnet import LowRankCrossNet, LowRankMixtureCrossNet

from conftest import done_fields, failure, run_cli

from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.config import DataConfig, DcnConfig
from dlrm_hybrid.model import alignment
from dlrm_hybrid.model.dlrm import DLRM
from dlrm_hybrid.model.compositional import feature_lookups
from dlrm_hybrid.model.embeddings import embedding_tables

SPEC = DataSpec(num_dense=5, cardinalities=[30, 20, 10], hotness=[1, 3, 2])
LOOKUPS = feature_lookups(SPEC.feature_names, SPEC.cardinalities, SPEC.hotness, 4, [])


def sample_batch(batch_size=16):
    cfg = DataConfig(num_dense=SPEC.num_dense, cardinalities=SPEC.cardinalities,
                     hotness=SPEC.hotness, train_samples=batch_size)
    return SyntheticClicks(cfg).batch("train", 0, batch_size)


def make_model(interaction, **kwargs):
    torch.manual_seed(0)
    return DLRM(SPEC.num_dense, LOOKUPS, [8, 4], [16, 1], interaction,
                embedding_device=torch.device("cpu"), **kwargs)


FIRST_LAYERS = ("dense_arch.model._mlp.0._linear.weight", "over_arch.model.0._mlp.0._linear.weight")


def torchrec_dlrm_and_ours():
    """torchrec's DLRM and ours with its weights: the two first layers' weights padded with
    zero columns, where ours reads inputs padded to an aligned width (5 -> 8, 10 -> 16)."""
    ours = make_model("dot")
    ebc = EmbeddingBagCollection(tables=embedding_tables(LOOKUPS))
    reference = TorchrecDLRM(ebc, SPEC.num_dense, [8, 4], [16, 1])
    renamed = {k.replace("sparse_arch.embedding_bag_collection.", "embedding_bags.")
                .replace("inter_arch.", "interaction."): v
               for k, v in reference.state_dict().items()}
    own = ours.state_dict()
    for key in FIRST_LAYERS:
        assert own[key].shape[1] > renamed[key].shape[1] and own[key].shape[1] % 8 == 0
        renamed[key] = torch.nn.functional.pad(renamed[key], [0, own[key].shape[1] - renamed[key].shape[1]])
    ours.load_state_dict(renamed)
    return reference, ours


def test_dot_matches_torchrec_dlrm_with_the_same_weights():
    reference, ours = torchrec_dlrm_and_ours()
    batch = sample_batch()
    expected = reference(batch.dense, batch.sparse).squeeze(1)
    torch.testing.assert_close(ours(batch.dense, batch.sparse), expected, rtol=0, atol=1e-6)


def test_padded_layers_start_and_stay_the_unpadded_function(monkeypatch):
    """Built from the same init draws as the unpadded model, with zero weights on the padding;
    training leaves those zero and the losses equal the unpadded model's."""
    padded = make_model("dot")
    monkeypatch.setattr(alignment, "ALIGN", 1)
    unpadded = make_model("dot")
    plain = unpadded.state_dict()
    for key, value in padded.state_dict().items():
        width = plain[key].shape[-1] if plain[key].dim() else 0
        assert torch.equal(value[..., :width], plain[key]), key
        assert key in FIRST_LAYERS or value.shape == plain[key].shape, key
        assert not value[..., width:].any(), key
    optimizers = [torch.optim.Adagrad(m.parameters(), lr=0.5) for m in (unpadded, padded)]
    for step in range(5):
        batch = sample_batch(16 + step)
        losses = []
        for model, optimizer in zip((unpadded, padded), optimizers):
            optimizer.zero_grad()
            loss = model(batch.dense, batch.sparse, batch.labels)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-6)  # summation order differs by CPU
    trained = padded.state_dict()
    for key in FIRST_LAYERS:
        assert not trained[key][:, plain[key].shape[1]:].any(), key


@pytest.mark.parametrize("interaction, kwargs, width", [
    ("dot", {}, 4 + 6),  # dense + C(4, 2) pairs
    ("dot", {"self_interaction": True}, 4 + 10),  # ... + the 4 self dots
    ("cat", {}, 4 + 3 * 4),
    ("dcn", {"dcn": DcnConfig(layers=2, rank=3)}, 4 * 4),
])
def test_interactions_feed_the_top_mlp_and_train(interaction, kwargs, width):
    model = make_model(interaction, **kwargs)
    aligned = -(-width // 8) * 8 if interaction == "dot" else width  # dot: zero-padded
    assert model.over_arch.model[0]._mlp[0]._linear.in_features == aligned
    batch = sample_batch()
    logits = model(batch.dense, batch.sparse)
    assert logits.shape == (16,)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_self_interaction_adds_each_vectors_own_dot():
    plain, with_self = make_model("dot"), make_model("dot", self_interaction=True)
    dense, sparse = torch.randn(2, 4), torch.randn(2, 3, 4)
    out = with_self.interaction(dense, sparse)
    vectors = torch.cat([dense[:, None], sparse], dim=1)
    assert torch.allclose(out[:, 4], (vectors[:, 0] ** 2).sum(1))  # first pair is (0, 0)
    unpadded = [m.interaction(dense, sparse).shape[1] - m.interaction.padding
                for m in (with_self, plain)]
    assert unpadded[0] - unpadded[1] == 4
    assert not out[:, unpadded[0]:].any() and out.shape[1] % 8 == 0


def dcn_model(top_mlp=(16, 1), **dcn):
    torch.manual_seed(0)
    return DLRM(SPEC.num_dense, LOOKUPS, [8, 4], list(top_mlp), "dcn",
                dcn=DcnConfig(layers=2, rank=3, **dcn), embedding_device=torch.device("cpu"))


def cross_input(model, batch):
    """x_0 = [bottom-MLP output, pooled embeddings] flattened: N = 4 * 4 = 16 wide."""
    return torch.cat((model.dense_arch(batch.dense),
                      model.pooled_embeddings(batch.sparse).flatten(1)), dim=1)


@pytest.mark.parametrize("top_mlp", [(16, 8, 1), (1,)])
def test_dcn_parallel_feeds_the_cross_net_and_the_hidden_layers_on_x0_to_the_last_layer(top_mlp):
    model, batch = dcn_model(top_mlp, structure="parallel"), sample_batch()
    x0 = cross_input(model, batch)
    cross = model.interaction.crossnet.crossnet
    assert isinstance(cross, LowRankCrossNet)
    hidden = x0  # no hidden layer: the last layer reads [c; x_0]
    for layer in (model.over_arch.hidden._mlp if len(top_mlp) > 1 else []):
        hidden = torch.relu(torch.nn.functional.linear(hidden, layer._linear.weight,
                                                       layer._linear.bias))
    last = model.over_arch.last
    assert last.in_features == 16 + (top_mlp[-2] if len(top_mlp) > 1 else 16)
    expected = torch.nn.functional.linear(torch.cat((cross(x0), hidden), 1), last.weight,
                                          last.bias).squeeze(1)
    torch.testing.assert_close(model(batch.dense, batch.sparse), expected, rtol=0, atol=0)


@pytest.mark.parametrize("structure", ["stacked", "parallel"])
def test_dcn_experts_are_torchrecs_mixture_of_low_rank_experts_and_train(structure):
    model, batch = dcn_model(structure=structure, experts=3), sample_batch()
    crossnet = model.interaction.crossnet
    if structure == "parallel":
        crossnet = crossnet.crossnet
    reference = LowRankMixtureCrossNet(16, 2, num_experts=3, low_rank=3)
    reference.load_state_dict(crossnet.state_dict())  # the same parameters, by name and shape
    x0 = cross_input(model, batch)
    over_arch_input = reference(x0) if structure == "stacked" else torch.cat((reference(x0), x0), 1)
    expected = model.over_arch(over_arch_input).squeeze(1)
    logits = model(batch.dense, batch.sparse)
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)
    torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_a_linear_cross_rank_above_its_width_is_said_where_a_mixture_rank_is_not():
    """(F + 1) * d = 16: U V has rank <= 16 however wide its factors; the experts' relu between
    the factors makes their rank a hidden width, which may exceed it. Said once, as a line of
    the run (RankerKind.plan_lines, rank 0), never as a Python warning from each rank."""
    from dlrm_hybrid.model.cross import rank_above_width

    num_sparse, dim = len(LOOKUPS), LOOKUPS[0].dim
    assert (num_sparse + 1) * dim == 16
    assert rank_above_width(DcnConfig(rank=17), num_sparse, dim) == (
        "warning: model.dcn.rank: 17 is above the cross network's width (F + 1) * d = 16, the "
        "most rank its layers can have: the extra factors only cost time and memory; train "
        "with model.dcn.rank=16 or less")
    assert rank_above_width(DcnConfig(rank=16), num_sparse, dim) is None
    assert rank_above_width(DcnConfig(rank=17, experts=2), num_sparse, dim) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # building the model warns of nothing
        DLRM(SPEC.num_dense, LOOKUPS, [8, 4], [16, 1], "dcn", dcn=DcnConfig(rank=17),
             embedding_device=torch.device("cpu"))


OLD_DCN_CONFIG = """\
model: {embedding_dim: 4, bottom_mlp: [8, 4], top_mlp: [8, 1], interaction: dcn,
        dcn_layers: 2, dcn_low_rank: 512}
data: {num_dense: 5, cardinalities: [30, 20, 10], global_batch_size: 32, train_samples: 64,
       val_samples: 64}
train: {max_steps: 2, eval_every: 0, progress_bar: 'false', tensorboard: 'false'}
"""


def test_a_config_and_a_checkpoint_with_the_old_dcn_keys_train_and_evaluate(tmp_path):
    """Before `model.dcn`, configs (and the config.yaml of every checkpoint) said
    model.dcn_layers and model.dcn_low_rank, the latter 512 by default: wider than a narrow
    model's cross network (here 16), which warns and still trains."""
    config = tmp_path / "old.yaml"
    config.write_text(OLD_DCN_CONFIG)
    result = run_cli(["train", "--config", str(config), "--set", f"train.run_dir={tmp_path}"])
    assert result.returncode == 0, failure(result)
    said = [line for line in result.stdout.splitlines() if "model.dcn.rank" in line]
    assert len(said) == 1 and said[0].startswith(
        "warning: model.dcn.rank: 512 is above the cross network's width (F + 1) * d = 16")
    assert "UserWarning" not in result.stderr and "model.dcn.rank" not in result.stderr
    val_auc = done_fields(result.stdout)["val_auc"]
    checkpoint = tmp_path / "checkpoints/step_2"
    saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    assert saved["model"]["dcn"] == {"layers": 2, "rank": 512, "structure": "stacked",
                                     "experts": 1}
    model = saved["model"]  # as the earlier version wrote it, with its digest in meta.json
    del model["dhen"]
    dcn = model.pop("dcn")
    model["dcn_layers"], model["dcn_low_rank"] = dcn["layers"], dcn["rank"]
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["sha256"]["config.yaml"] = hashlib.sha256(
        (checkpoint / "config.yaml").read_bytes()).hexdigest()
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    result = run_cli(["eval", "--checkpoint", str(checkpoint), "--split", "val"])
    assert result.returncode == 0, failure(result)
    assert f"val_auc={val_auc:.5f}" in result.stdout.strip().splitlines()[-1]


def test_dcn_settings_leave_other_interactions_alone():
    plain = make_model("dot")
    configured = make_model("dot", dcn=DcnConfig(structure="parallel", experts=3))
    batch = sample_batch()
    torch.testing.assert_close(configured(batch.dense, batch.sparse),
                               plain(batch.dense, batch.sparse), rtol=0, atol=0)
