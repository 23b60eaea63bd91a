"""parallel/dense_memory.py: the planner's dense parameter count and per-rank bytes, checked
against the parameters the model really builds."""

from collections import Counter

import pytest

from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.spec import DataSpec
from dlrm_hybrid.parallel.dense_memory import Unit, model_dense_units, per_rank

TINY = ["model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[12,6,1]",
        "data.num_dense=5", "data.cardinalities=[50,40,30,20]"]
DHEN = ["model.interaction=dhen", "model.dhen.heads=2"]
ALL_FIVE = "model.dhen.modules=[linear,self_attention,conv,dot,dcn]"
CONFIGS = {
    "dot": ["model.interaction=dot"],
    "dot self": ["model.interaction=dot", "model.self_interaction=true"],
    "cat": ["model.interaction=cat"],
    "fm": ["model.interaction=fm", "model.bottom_mlp=[16,6]"],
    "dcn stacked": ["model.interaction=dcn", "model.dcn.layers=2", "model.dcn.rank=6"],
    "dcn stacked 3 experts": ["model.interaction=dcn", "model.dcn.layers=2", "model.dcn.rank=6",
                              "model.dcn.experts=3"],
    "dcn parallel": ["model.interaction=dcn", "model.dcn.structure=parallel", "model.dcn.rank=6"],
    "dcn parallel 3 experts": ["model.interaction=dcn", "model.dcn.structure=parallel",
                               "model.dcn.rank=6", "model.dcn.experts=3"],
    "dcn parallel no hidden": ["model.interaction=dcn", "model.dcn.structure=parallel",
                               "model.dcn.rank=6", "model.top_mlp=[1]"],
    **{f"dhen {m}": DHEN + [f"model.dhen.modules=[{m}]", "model.dhen.layers=1"]
       for m in ("linear", "self_attention", "conv", "dot", "dcn")},
    "dhen all five concat 3 layers": DHEN + [ALL_FIVE, "model.dhen.layers=3"],
    "dhen all five sum width 7": DHEN + [ALL_FIVE, "model.dhen.ensemble=sum",
                                         "model.dhen.width=7", "model.dhen.layers=3"],
    "dhen concat width 3 one layer": DHEN + [ALL_FIVE, "model.dhen.width=3",
                                             "model.dhen.layers=1"],
    "dcn mixed dimensions": ["model.interaction=dcn", "model.dcn.rank=6",
                             "model.mixed_dimensions.temperature=0.5",
                             "model.mixed_dimensions.threshold=10"],
}


def config(case):
    cfg = load_config(None, TINY + CONFIGS[case])
    return cfg, DataSpec.from_config(cfg.data)


def dense_shapes(cfg, spec):
    """Shapes of the model's parameters outside the embedding tables, as build_model makes them."""
    from dlrm_hybrid.model.dlrm import build_model

    model = build_model(cfg.model, spec)
    return Counter(tuple(p.shape) for name, p in model.named_parameters()
                   if not name.startswith("embedding_bags."))


@pytest.mark.parametrize("case", CONFIGS)
def test_the_analytic_dense_parameters_are_the_models(case):
    """Same shapes (so the same count, and the same fsdp padding) as the built model's."""
    cfg, spec = config(case)
    units = model_dense_units(cfg.model, spec)
    analytic = Counter(s for u in units for s in u.shapes)
    assert analytic == dense_shapes(cfg, spec)


def test_per_rank_bytes_shard_each_parameter_padded_and_add_the_largest_unit_gathered():
    """A [10, 3] weight over 4 shards: ceil(10 / 4) = 3 rows each, 9 elements; a [2] bias: 1."""
    units = [Unit("a", {"w": [(10, 3), (2,)]}), Unit("b", {"w": [(4, 4)]})]
    ddp = per_rank(units, "ddp", 1, "adam")
    assert (ddp.parameters, ddp.gradients, ddp.optimizer, ddp.transient) == (4 * 48, 4 * 48,
                                                                             8 * 48, 0)
    fsdp = per_rank(units, "fsdp", 4, "adagrad")
    local = 9 + 1 + 4
    assert (fsdp.parameters, fsdp.gradients, fsdp.optimizer) == (4 * local, 4 * local, 4 * local)
    assert fsdp.largest == "a" and fsdp.transient == 8 * (12 * 3 + 4)  # padded rows, gathered
    assert per_rank(units, "hsdp", 2, "sgd").optimizer == 0
