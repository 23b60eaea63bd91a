"""The DLRM and its interactions."""

import pytest
import torch
from torchrec import EmbeddingBagCollection
from torchrec.models.dlrm import DLRM as TorchrecDLRM

from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.data.synthetic import SyntheticClicks
from dlrm_hybrid.config import DataConfig, DcnConfig
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


def test_dot_matches_torchrec_dlrm_with_the_same_weights():
    ours = make_model("dot")
    ebc = EmbeddingBagCollection(tables=embedding_tables(LOOKUPS))
    reference = TorchrecDLRM(ebc, SPEC.num_dense, [8, 4], [16, 1])
    renamed = {k.replace("sparse_arch.embedding_bag_collection.", "embedding_bags.")
                .replace("inter_arch.", "interaction."): v
               for k, v in reference.state_dict().items()}
    ours.load_state_dict(renamed)
    batch = sample_batch()
    expected = reference(batch.dense, batch.sparse).squeeze(1)
    torch.testing.assert_close(ours(batch.dense, batch.sparse), expected, rtol=0, atol=0)


@pytest.mark.parametrize("interaction, kwargs, width", [
    ("dot", {}, 4 + 6),  # dense + C(4, 2) pairs
    ("dot", {"self_interaction": True}, 4 + 10),  # ... + the 4 self dots
    ("cat", {}, 4 + 3 * 4),
    ("dcn", {"dcn": DcnConfig(layers=2, rank=3)}, 4 * 4),
])
def test_interactions_feed_the_top_mlp_and_train(interaction, kwargs, width):
    model = make_model(interaction, **kwargs)
    assert model.over_arch.model[0]._mlp[0]._linear.in_features == width
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
    assert out.shape[1] - plain.interaction(dense, sparse).shape[1] == 4
