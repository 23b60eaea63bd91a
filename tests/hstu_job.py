"""Run under torchrun (or alone, one rank) by test_hstu_ranks.py: a tiny sequence model
(model.kind hstu) trained 10 steps on the planted log on this world size, a checkpoint at step
5 and at the end. Dropout 0: each rank would draw its own masks.

usage: hstu_job.py OUT [VARIANT ...] [--resume DIR] (tests/variant_job.py)
"""

from variant_job import run_variants

COMMON = ["model.kind=hstu", "model.embedding_dim=16", "model.hstu.max_length=8",
          "model.hstu.dropout=0", "data.users=200", "data.items=300",
          "data.global_batch_size=32", "retrieval.uniform_negatives=16",
          "optim.embedding=rowwise_adagrad", "optim.embedding_lr=0.05", "optim.dense=adam",
          "optim.dense_lr=0.01", "train.max_steps=10", "train.log_every=1",
          "train.eval_every=5", "train.progress_bar=false", "checkpoint.every=5",
          "checkpoint.keep=5", "checkpoint.resume=none", "parallel.replicate=false"]
VARIANTS = {  # one: each run costs the suite ~3 s; the loss's other option is unit-tested
    "in_batch": ["model.hstu.heads=2"],  # every position's next item and the uniform draws
}


if __name__ == "__main__":
    run_variants(COMMON, VARIANTS)
