"""A SASRec-style next-item model (Kang & McAuley 2018), the published reference the history user
towers of benchmarks/retrieval.py are measured against, trained and scored by that script.

As published: a table of item embeddings (scaled by sqrt(dim)) plus learned position embeddings,
dropout, BLOCKS causal self-attention blocks (torch's pre-norm TransformerEncoderLayer: one
head, a point-wise feed-forward of width dim, dropout), a last LayerNorm; the output at position
t scores item i by its dot product with i's input embedding (shared), and training predicts the
next item at EVERY position of each user's training sequence (its last `maxlen` + 1 training
items, oldest first), with Adam (betas 0.9, 0.98). Positions count back from the sequence's
end, as the paper's left padding makes them: the latest item is always at position maxlen - 1.

The loss is the full softmax cross-entropy over the corpus, not the paper's binary cross-entropy
on one sampled negative per position: with a corpus of 1-2 thousand items the [positions, items]
logits cost little more than the sampled ones, every item is a negative at every position (no
sampling noise; the softmax form is the one reported to make SASRec strongest: Klenitskiy &
Vasilev, RecSys 2023), and it is the loss the towers train with (an in-batch softmax).

Training reads the training split only (`training_sequences`: the histories before the
validation split); validation scores each user's vector from their training items, test from
their training and validation items, both through retrieval/evaluate.py (the peers' path: the
corpus ranked, the user's earlier items left out). The setting and epoch with the best
validation recall@10 are chosen (GRID x up to EPOCHS, validated after each epoch; Adam's rate is
constant, so one run gives every shorter run's result) and that epoch's weights tested once.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Dict, Tuple

import numpy as np
import torch
from torch import nn

DIM, BLOCKS, HEADS, BATCH, LR = 64, 2, 1, 128, 0.001  # dim as the towers' (paper: 50)
GRID = {"maxlen": (50,), "dropout": (0.2, 0.5)}  # 200 (paper, ML-1M): 4x the CPU, lower val
EPOCHS = 60
QUICK = ({"maxlen": 10, "dropout": 0.2}, 2)  # --quick: one setting, 2 epochs


class SASRec(nn.Module):
    """Item and position embeddings through causal self-attention blocks."""

    def __init__(self, items: int, maxlen: int, dropout: float, dim: int = DIM) -> None:
        super().__init__()
        self.maxlen, self.scale = maxlen, math.sqrt(dim)
        self.items = nn.Embedding(items, dim)
        self.positions = nn.Embedding(maxlen, dim)
        for table in (self.items, self.positions):  # the paper's (Glorot), not torch's N(0, 1)
            nn.init.xavier_normal_(table.weight)
        self.dropout = nn.Dropout(dropout)
        block = nn.TransformerEncoderLayer(dim, HEADS, dim_feedforward=dim, dropout=dropout,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, BLOCKS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(maxlen),
                             persistent=False)

    def forward(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """ids [B, maxlen] left-aligned (slots from counts[b] on are padding), counts [B] ->
        [B, maxlen, dim]: the output at slot t has read slots <= t only (so never padding)."""
        slots = torch.arange(self.maxlen)
        used = (slots[None, :] < counts[:, None])[:, :, None].float()
        position = (self.maxlen - counts[:, None] + slots[None, :]).clamp(0, self.maxlen - 1)
        x = self.dropout(self.items(ids) * self.scale + self.positions(position)) * used
        return self.norm(self.blocks(x, mask=self.causal, is_causal=True))

    def user_vectors(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """[B, dim]: the output at each sequence's last item (zeros for an empty one)."""
        out = self(ids, counts)[torch.arange(len(counts)), (counts - 1).clamp(min=0)]
        return out * (counts > 0)[:, None].float()


def training_sequences(data, maxlen: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs [U, maxlen], targets [U, maxlen], counts [U]) of every user with two or more
    training items: the last maxlen + 1 of them, oldest first; target t is the item after input
    t, for slots t < count. Only the training split: the histories before validation."""
    histories = data.histories_of(maxlen + 1)
    ids, counts = histories.before("val", np.arange(data.users))
    keep = counts >= 2
    return ids[keep, :-1], ids[keep, 1:], counts[keep] - 1


def user_vectors(model: SASRec, data, split: str, batch: int = 1024) -> np.ndarray:
    """[users, dim]: each user's vector from everything they did before `split`."""
    histories = data.histories_of(model.maxlen)
    training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for first in range(0, data.users, batch):
            ids, counts = histories.before(split, np.arange(first, min(first + batch, data.users)))
            out.append(model.user_vectors(torch.from_numpy(ids), torch.from_numpy(counts)))
    model.train(training)
    return torch.cat(out).numpy()


def evaluate(model: SASRec, data, retrieval_cfg, split: str) -> Dict[str, float]:
    """retrieval/evaluate.py's metrics of the model on `split` (keys prefixed by it)."""
    from dlrm_hybrid.retrieval.peers import evaluate_peer

    items = model.items.weight.detach().numpy()
    return evaluate_peer((user_vectors(model, data, split), items), data, retrieval_cfg, split)


def train(data, retrieval_cfg, maxlen: int, dropout: float, epochs: int, seed: int = 0,
          metric: str = "val_recall@10") -> Tuple[Dict[str, float], dict, int, float]:
    """`epochs` of training, validated after each: (the validation metrics of the epoch with
    the best `metric`, that epoch's weights, the epoch, training CPU seconds)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = SASRec(data.items, maxlen, dropout)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98))
    inputs, targets, counts = (torch.from_numpy(a) for a in training_sequences(data, maxlen))
    used = torch.arange(maxlen)[None, :] < counts[:, None]
    best, seconds = ({metric: -1.0}, None, 0), 0.0
    for epoch in range(1, epochs + 1):
        start = time.process_time()
        for rows in np.array_split(rng.permutation(len(counts)), max(1, len(counts) // BATCH)):
            rows = torch.from_numpy(rows)
            hidden = model(inputs[rows], counts[rows])[used[rows]]  # [positions, dim]
            loss = nn.functional.cross_entropy(hidden @ model.items.weight.T,
                                               targets[rows][used[rows]])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        seconds += time.process_time() - start
        val = evaluate(model, data, retrieval_cfg, "val")
        if val[metric] > best[0][metric]:
            best = (val, {k: v.clone() for k, v in model.state_dict().items()}, epoch)
    return (*best, seconds)


def run(data, retrieval_cfg, quick: bool = False) -> Tuple[Dict[str, float], str]:
    """The grid on validation, the best setting's best epoch tested once, on one thread:
    ({val and test metrics, seconds}, the setting in words)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        grid = [QUICK] if quick else [
            (dict(zip(GRID, values)), EPOCHS) for values in itertools.product(*GRID.values())]
        best = None
        for setting, epochs in grid:
            val, weights, epoch, seconds = train(data, retrieval_cfg, epochs=epochs, **setting)
            print(f"  sasrec {setting}: best val recall@10 {val['val_recall@10']:.4f} after "
                  f"{epoch} of {epochs} epochs ({seconds:.0f} CPU s)", flush=True)
            if best is None or val["val_recall@10"] > best[0]["val_recall@10"]:
                best = (val, weights, epoch, seconds, setting, epochs)
        val, weights, epoch, seconds, setting, epochs = best
        model = SASRec(data.items, setting["maxlen"], setting["dropout"])
        model.load_state_dict(weights)
        test = evaluate(model, data, retrieval_cfg, "test")
    finally:
        torch.set_num_threads(threads)
    words = (f"{BLOCKS} blocks, {HEADS} head, dim {DIM}, maxlen {setting['maxlen']}, dropout "
             f"{setting['dropout']}, full softmax, {epoch} of {epochs} epochs")
    return {**val, **test, "seconds": seconds}, words
