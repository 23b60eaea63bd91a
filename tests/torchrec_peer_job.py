"""Run under torchrun by test_torchrec_peer.py: the torchrec peer's first steps on this world
size, each rank on its slice of every global batch, with each embedding optimizer of EMBEDDING;
rank 0 writes the global-batch losses (the mean of the ranks' losses) to OUT/losses.json.

usage: torchrec_peer_job.py OUT
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_hybrid.bench.torchrec_peer import torchrec_peer_step  # noqa: E402
from dlrm_hybrid.config_loading import load_config  # noqa: E402
from dlrm_hybrid.data.source import open_dataset  # noqa: E402
from dlrm_hybrid.parallel.process_group import init_distributed, shutdown  # noqa: E402

# Dense SGD: Adagrad's first steps move each weight by +-lr whatever its gradient's size, so
# another summation order's rounding would decide near-zero ones (tests/des_job.py).
OVERRIDES = ["data.global_batch_size=256", "optim.dense=sgd", "optim.dense_lr=0.5",
             "optim.warmup_steps=0"]
# {embedding optimizer: its LR}: the fused row-wise Adagrad bench runs, and SGD. Row-wise
# Adagrad's step does not change when a row's gradients are all scaled alike (by the world
# size, say); SGD's does, at an LR where the tables' steps move the loss (a row's gradient
# is a 1/B share of its samples').
EMBEDDING = {"rowwise_adagrad": 0.1, "sgd": 20.0}
STEPS = 6


def peer_losses(env, embedding: str) -> list:
    """The global batch's loss at each of the first STEPS steps."""
    cfg = load_config(str(ROOT / "configs/demo.yaml"),
                      OVERRIDES + [f"optim.embedding={embedding}",
                                   f"optim.embedding_lr={EMBEDDING[embedding]}"])
    dataset, B = open_dataset(cfg.data, cfg.model), cfg.data.global_batch_size
    local = B // env.world_size
    batches = iter([dataset.batch("train", i * B + env.rank * local, local)
                    for i in range(STEPS + 2)])  # the pipeline takes two ahead
    step = torchrec_peer_step(cfg, dataset.spec, env)
    losses = []
    for _ in range(STEPS):
        loss = step(batches).clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / env.world_size)
    return losses


def main() -> None:
    env = init_distributed("gloo")
    losses = {embedding: peer_losses(env, embedding) for embedding in EMBEDDING}
    if env.is_main:
        (Path(sys.argv[1]) / "losses.json").write_text(json.dumps(losses))
    shutdown()


if __name__ == "__main__":
    main()
