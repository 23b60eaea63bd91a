"""Training speed of the sequence model (`model.kind: hstu`) beside the SASRec-style reference on
the same batch, and how each grows as the history length doubles.

    .venv/bin/python benchmarks/sequential_speed.py [--lengths 64,128,256,512] [--batch 32]
        [--dim 64] [--steps 5] [--threads N]

For each length L, one batch of B full sequences of L items (every position a training sample:
B x L next-item predictions) over a corpus of ITEMS items, timed over --steps training steps
(forward, backward, optimizer; after one warm-up step) for:
- hstu (product): the product's model, HSTURetrieval: the item table in torchrec's
  EmbeddingBagCollection (one key per history slot), HSTU, the every-position sampled softmax
  (in-batch and 128 uniform negatives), row-wise Adagrad on the table, Adam on the rest;
- hstu (encoder): the same HSTU layers and loss over a plain nn.Embedding (Adam on all):
  what the slot keys of the table cost, by difference;
- sasrec: benchmarks/sasrec.py's model, full softmax over the corpus, Adam, its settings.
All share dimension and layer count (2). Prints a markdown table (ms per step, sequences/s,
samples/s, each time's ratio to the length before) and last the summary line:

    sequential_speed: cpu=NAME threads=T hstu_samples_per_s@L=... sasrec_samples_per_s@L=...
        hstu_growth=X sasrec_growth=X

(growth: the mean ratio of step times between consecutive lengths; 2 is linear, 4 quadratic.)
"""

from __future__ import annotations

import argparse
import time
from typing import Callable, Dict, List

import numpy as np
import torch
from torch.nn import functional as F

from retrieval import cpu_name
import sasrec

ITEMS = 20000
NEGATIVES = 128


def time_steps(step: Callable[[], None], steps: int) -> float:
    """Seconds per step, after one warm-up step."""
    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def product_step(length: int, batch: int, dim: int, ids: np.ndarray) -> Callable[[], None]:
    """The product's HSTURetrieval trained on `ids` [batch, length + 1] (history and target)."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.data.batch import Batch, Columns
    from dlrm_hybrid.data.interactions.interaction_meta import InteractionMeta, tower_features
    from dlrm_hybrid.model.hstu_retrieval import build_hstu
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    cfg = load_config(None, ["model.kind=hstu", f"model.embedding_dim={dim}",
                             f"model.hstu.max_length={length}", "model.hstu.dropout=0.2"])
    spec = tower_features(InteractionMeta(1, ITEMS), cfg.model).spec()
    model = build_hstu(cfg, spec, embedding_device=torch.device("cpu"))
    torch.nn.init.normal_(next(model.embedding_bags.parameters()), std=0.02)
    rows = batch + NEGATIVES
    columns = [*[np.ascontiguousarray(ids[:, j:j + 1]) for j in range(length)],
               ids[:, length:]]
    negatives = np.random.default_rng(1).integers(0, ITEMS, NEGATIVES)
    slots = [np.concatenate([c, np.zeros((NEGATIVES, 1), np.int64)]) for c in columns[:-1]]
    target = np.concatenate([columns[-1], negatives[:, None]])
    lengths = ([np.r_[np.ones(batch, np.int32), np.zeros(NEGATIVES, np.int32)]] * length
               + [np.ones(rows, np.int32)])
    labels = np.r_[np.ones(batch, np.float32), np.zeros(NEGATIVES, np.float32)]
    b = Batch.from_columns(Columns(np.zeros((rows, 0), np.float32), labels, np.ones(rows, bool),
                                   [*slots, target], lengths=lengths), spec.feature_names)
    tables = list(model.embedding_bags.parameters())
    dense = [p for n, p in model.named_parameters() if not n.startswith("embedding_bags")]
    optimizers = [RowWiseAdagrad(tables, lr=0.05), torch.optim.Adam(dense, lr=1e-3)]

    def step() -> None:
        loss = model(b.dense, b.sparse, b.labels)
        for o in optimizers:
            o.zero_grad()
        loss.backward()
        for o in optimizers:
            o.step()
    return step


def encoder_step(length: int, batch: int, dim: int, ids: np.ndarray) -> Callable[[], None]:
    """HSTU and the same loss over a plain nn.Embedding."""
    from dlrm_hybrid.model.hstu import HSTU
    from dlrm_hybrid.retrieval.sequence_loss import SequenceSoftmax

    table = torch.nn.Embedding(ITEMS, dim)
    torch.nn.init.normal_(table.weight, std=0.02)
    hstu = HSTU(dim, length, 2, 1, dim, dim, 0.2, 128)
    loss_fn = SequenceSoftmax(0.05, in_batch=True)
    optimizer = torch.optim.Adam([*table.parameters(), *hstu.parameters()], lr=1e-3)
    history, following = torch.from_numpy(ids[:, :-1]), torch.from_numpy(ids[:, 1:])
    negatives = torch.from_numpy(np.random.default_rng(1).integers(0, ITEMS, NEGATIVES))
    counts = torch.full((batch,), length)

    def step() -> None:
        out = hstu(table(history), counts).reshape(-1, dim)
        positives = F.normalize(table(following).reshape(-1, dim), dim=-1)
        loss = loss_fn(out, positives, following.reshape(-1),
                       F.normalize(table(negatives), dim=-1), negatives)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def sasrec_step(length: int, batch: int, dim: int, ids: np.ndarray) -> Callable[[], None]:
    """benchmarks/sasrec.py's training step at this length (full softmax over the corpus)."""
    model = sasrec.SASRec(ITEMS, length, 0.2, dim=dim)
    optimizer = torch.optim.Adam(model.parameters(), lr=sasrec.LR, betas=(0.9, 0.98))
    inputs, targets = torch.from_numpy(ids[:, :-1]), torch.from_numpy(ids[:, 1:])
    counts = torch.full((batch,), length)

    def step() -> None:
        hidden = model(inputs, counts).reshape(-1, dim)
        loss = F.cross_entropy(hidden @ model.items.weight.T, targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="64,128,256,512")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"sequential speed on {cpu_name()}, {args.threads} threads; batch {args.batch} "
          f"sequences, dim {args.dim}, 2 layers, corpus {ITEMS} items", flush=True)
    models = {"hstu (product)": product_step, "hstu (encoder)": encoder_step,
              "sasrec": sasrec_step}
    seconds: Dict[str, List[float]] = {name: [] for name in models}
    print("| model | length | ms per step | sequences/s | samples/s | time x previous length |")
    print("|---|---:|---:|---:|---:|---:|")
    for length in lengths:
        ids = np.random.default_rng(length).integers(0, ITEMS, (args.batch, length + 1))
        for name, make in models.items():
            torch.manual_seed(0)
            s = time_steps(make(length, args.batch, args.dim, ids), args.steps)
            growth = f"{s / seconds[name][-1]:.2f}" if seconds[name] else ""
            seconds[name].append(s)
            print(f"| {name} | {length} | {s * 1e3:.1f} | {args.batch / s:,.0f} | "
                  f"{args.batch * length / s:,.0f} | {growth} |", flush=True)

    def growth(name: str) -> float:
        times = seconds[name]
        return float(np.mean([b / a for a, b in zip(times, times[1:])])) if len(times) > 1 else 1.0

    rates = " ".join(f"{key}_samples_per_s@{length}={args.batch * length / s:.0f}"
                     for key, name in (("hstu", "hstu (product)"), ("sasrec", "sasrec"))
                     for length, s in zip(lengths, seconds[name]))
    print(f"sequential_speed: cpu={cpu_name().split(',')[0].replace(' ', '_')} "
          f"threads={args.threads} {rates} hstu_growth={growth('hstu (product)'):.2f} "
          f"hstu_encoder_growth={growth('hstu (encoder)'):.2f} "
          f"sasrec_growth={growth('sasrec'):.2f}")


if __name__ == "__main__":
    main()
