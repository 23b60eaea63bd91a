"""The torchrec peer `bench` times beside ours (dlrm_hybrid/bench/torchrec_peer.py): it trains,
it is our model, its steps are the plain math of the config's optimizers on the batches in
order, and it runs on 2 gloo ranks with the 1-rank losses."""

import json
import os
import re
from collections import Counter

import pytest
import torch
from torch.nn.functional import binary_cross_entropy_with_logits

from conftest import ROOT, run_cli
from dlrm_hybrid.model import alignment
from dlrm_hybrid.bench.torchrec_peer import peer_model, torchrec_peer_step
from dlrm_hybrid.config_loading import load_config
from dlrm_hybrid.data.source import open_dataset
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.model.dlrm import build_model
from dlrm_hybrid.train.loop import build_sharded_model
from dlrm_hybrid.train.optim import build_optimizer
from dlrm_hybrid.train.step import TrainStep

BATCH = 256  # configs/demo.yaml's model and data, a quarter of its batch


def demo(*overrides):
    cfg = load_config(str(ROOT / "configs/demo.yaml"), [f"data.global_batch_size={BATCH}",
                                                       *overrides])
    dataset = open_dataset(cfg.data, cfg.model)
    return cfg, dataset, [dataset.batch("train", i * BATCH, BATCH) for i in range(40)]


DCN = ["model.interaction=dcn", "model.dcn.layers=2", "model.dcn.rank=24"]


@pytest.mark.parametrize("overrides", [[], DCN])
def test_peer_trains(process_group, overrides):
    cfg, dataset, batches = demo(*overrides)
    step, batches = torchrec_peer_step(cfg, dataset.spec, process_group), iter(batches)
    losses = [step(batches).item() for _ in range(30)]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.05, losses


@pytest.mark.parametrize("overrides", [[], DCN])
def test_same_shapes_as_ours(overrides, monkeypatch):
    """Ours unpadded (model/alignment.py: its zero columns are not torchrec's)."""
    cfg, dataset, _ = demo(*overrides)
    peer = peer_model(cfg.model, dataset.spec, torch.device("cpu"), cfg.train.seed)
    monkeypatch.setattr(alignment, "ALIGN", 1)
    ours = build_model(cfg.model, dataset.spec)
    tables = lambda ebc: {t.name: (t.num_embeddings, t.embedding_dim)  # noqa: E731
                          for t in ebc.embedding_bag_configs()}
    assert tables(peer.sparse_arch.embedding_bag_collection) == tables(ours.embedding_bags)
    assert len(tables(ours.embedding_bags)) == len(dataset.spec.cardinalities)
    shapes = lambda model: Counter(tuple(p.shape) for p in model.parameters())  # noqa: E731
    assert shapes(peer) == shapes(ours)


def test_refuses_what_torchrec_has_not():
    cfg, dataset, _ = demo("model.interaction=cat")
    with pytest.raises(UserError, match="model.interaction cat"):
        peer_model(cfg.model, dataset.spec, torch.device("cpu"), cfg.train.seed)


def test_same_losses_as_ours(process_group):
    """Same seed, same tables' values, same optimizers (row-wise Adagrad fused, dense Adagrad,
    the warmup): the peer and ours are one model, so `bench` compares two ways of training it."""
    cfg, dataset, batches = demo()
    dmp, _ = build_sharded_model(cfg, dataset.spec, process_group, lambda line: None)
    ours = TrainStep(dmp, *build_optimizer(dmp, cfg.optim), cfg.train, process_group.device)
    peer = torchrec_peer_step(cfg, dataset.spec, process_group)
    ours_batches, peer_batches = iter(batches), iter(batches)
    ours_losses = [ours(ours_batches).item() for _ in range(8)]
    peer_losses = [peer(peer_batches).item() for _ in range(8)]
    assert ours_losses == pytest.approx(peer_losses, rel=1e-5)


@pytest.mark.parametrize("embedding, dense", [("sgd", "sgd"), ("rowwise_adagrad", "adagrad")])
def test_steps_equal_hand_computed(process_group, embedding, dense):
    """Three pipelined steps against the same torchrec DLRM, unsharded, from the peer's initial
    weights, stepped by hand with the optimizers' formulas and the warmup's LR: the losses of
    batches 0, 1, 2 in that order, and the weights after them (the two batches the pipeline
    took ahead are not trained yet)."""
    cfg, dataset, batches = demo(f"optim.embedding={embedding}", f"optim.dense={dense}")
    peer = torchrec_peer_step(cfg, dataset.spec, process_group)
    initial = full_state(peer.dmp)
    it = iter(batches)
    peer_losses = [peer(it).item() for _ in range(3)]

    model = peer_model(cfg.model, dataset.spec, torch.device("cpu"), 0, torch.device("cpu"))
    model.load_state_dict(initial)
    sums = {name: None for name, _ in model.named_parameters()}
    hand_losses = []
    for step, batch in enumerate(batches[:3]):
        model.zero_grad()
        loss = binary_cross_entropy_with_logits(
            model(batch.dense, batch.sparse).squeeze(-1), batch.labels)
        loss.backward()
        hand_losses.append(loss.item())
        factor = (step + 1) / cfg.optim.warmup_steps
        with torch.no_grad():
            for name, p in model.named_parameters():
                table = "embedding_bags" in name
                rule = embedding if table else dense
                lr = (cfg.optim.embedding_lr if table else cfg.optim.dense_lr) * factor
                g = p.grad
                if rule == "sgd":
                    p -= lr * g
                    continue
                square = g.pow(2).mean(1, keepdim=True) if rule == "rowwise_adagrad" else g.pow(2)
                sums[name] = square if sums[name] is None else sums[name] + square
                p -= lr * g / (sums[name].sqrt() + cfg.optim.eps)
    assert peer_losses == pytest.approx(hand_losses, rel=1e-6)
    trained = full_state(peer.dmp)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-6, msg=name)


def full_state(dmp) -> dict:
    """The peer's weights by the unsharded DLRM's names: one rank holds every table whole."""
    return {key.removeprefix("model."): (value.local_shards()[0].tensor
                                        if hasattr(value, "local_shards") else value).clone()
            for key, value in dmp.state_dict().items()}


def test_two_ranks_give_the_one_rank_losses(tmp_path, process_group):
    """torchrec averages over ranks both the dense gradients (DDP) and the pooled vectors'
    (its all-to-all backward divides by the world size), and each rank's loss is the mean
    over its half: the global batch's losses, on any world size, to rounding."""
    from torchrec_peer_job import EMBEDDING, STEPS, peer_losses

    result = run_cli([str(tmp_path)], nproc=2, script=ROOT / "tests/torchrec_peer_job.py")
    assert result.returncode == 0, result.stderr[-3000:]
    two = json.loads((tmp_path / "losses.json").read_text())
    for embedding in EMBEDDING:
        one = peer_losses(process_group, embedding)
        assert len(two[embedding]) == len(one) == STEPS
        assert two[embedding] == pytest.approx(one, rel=1e-5), embedding
        assert one[-1] < one[0]
