"""Run under torchrun (or alone, one rank) by test_sequence_ranker_ranks.py: a tiny multi-task
ranker with the sequence feature (model.sequence hstu) trained 10 steps on a ranking dataset
with histories (--data DIR), a checkpoint at step 5 and at the end. Dropout 0: each rank would
draw its own masks. Its tables are sharded (parallel.replicate=false), so the history slots'
ids and vectors cross the ranks.

usage: sequence_ranker_job.py OUT [VARIANT ...] [--resume DIR] --data DIR (tests/variant_job.py)
"""

import sys

from variant_job import run_variants

DATA = sys.argv.pop(sys.argv.index("--data") + 1)
sys.argv.remove("--data")
COMMON = [f"data.path={DATA}", "model.sequence=hstu", "model.embedding_dim=8",
          "model.bottom_mlp=[16,8]", "model.top_mlp=[16,1]", "model.hstu.dropout=0",
          "model.tasks=[{name: watched}, {name: liked, head: [8]}]",
          "data.global_batch_size=64", "optim.embedding=rowwise_adagrad",
          "optim.embedding_lr=0.05", "optim.dense=adam", "optim.dense_lr=0.01",
          "train.max_steps=10", "train.log_every=1", "train.eval_every=5",
          "train.progress_bar=false", "checkpoint.every=5", "checkpoint.keep=5",
          "checkpoint.resume=none", "parallel.replicate=false"]
VARIANTS = {"dcn": ["model.interaction=dcn", "model.hstu.heads=2"]}  # one: ~4 s each


if __name__ == "__main__":
    run_variants(COMMON, VARIANTS)
