"""Run under torchrun (or alone, one rank) by test_two_tower.py: a tiny two-tower model trained
10 steps on the planted log with each variant of VARIANTS on this world size, a checkpoint at
step 5 and at the end. Each run's record is OUT/<variant>/ (metrics.jsonl, checkpoints/).

usage: two_tower_job.py OUT [VARIANT ...] [--resume DIR] (tests/variant_job.py)
  VARIANT: those to train fresh (default: all)
  --resume DIR: then each of those variants that DIR (another launch's OUT) has, resumed from
                its step 5 on this world size, into OUT/resumed_<variant>/
"""

from variant_job import run_variants

# Dense SGD: Adagrad's and Adam's first steps move each weight by about +-lr whatever its
# gradient's size, so rounding of another reduction order would decide them. Tables sharded
# (not replicated), so the lookups cross ranks.
COMMON = ["model.kind=two_tower", "model.embedding_dim=16", "model.user_tower.mlp=[32,16]",
          "model.item_tower.mlp=[32,16]", "data.users=200", "data.items=300",
          "data.global_batch_size=64", "optim.embedding=rowwise_adagrad", "optim.embedding_lr=0.05",
          "optim.dense=sgd", "optim.dense_lr=0.5", "train.max_steps=10", "train.log_every=1",
          "train.eval_every=0", "train.progress_bar=false", "checkpoint.every=5",
          "checkpoint.keep=5", "checkpoint.resume=none", "parallel.replicate=false"]
VARIANTS = {
    "defaults": [],  # logq and accidental-hit removal on
    "negatives": ["retrieval.uniform_negatives=32", "retrieval.cross_batch_memory=800"],
    "pipeline": ["train.pipeline=enabled"],
    "bf16": ["train.precision=bf16", "train.precision_fallback=false"],  # bf16 even if emulated
}


if __name__ == "__main__":
    run_variants(COMMON, VARIANTS)
