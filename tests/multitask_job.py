"""Run under torchrun (or alone, one rank) by test_multitask.py: tiny multi-task rankers on the
planted data, trained with each variant of VARIANTS on this world size (10 steps unless the
variant says; checkpoints at its end, and at step 5 where it says). Each run's record is
OUT/<variant>/ (metrics.jsonl, tensorboard/, checkpoints/); rank 0 prints each run's done line.

usage: multitask_job.py OUT [VARIANT ...] [--resume DIR] (tests/variant_job.py)
  VARIANT: those to train fresh (default: all)
  --resume DIR: then each of those variants that has a step 5 checkpoint in DIR (another
                launch's OUT), resumed from it on this world size, into OUT/resumed_<variant>/
"""

from variant_job import run_variants

# Dense SGD: Adagrad's first steps move each weight by about +-lr whatever its gradient's size,
# so rounding of another reduction order would decide them. Tables sharded (not replicated), so
# the lookups cross ranks. The multi-task variants leave out 30% of every label but the first.
COMMON = ["model.embedding_dim=8", "model.bottom_mlp=[16,8]", "model.top_mlp=[32,16,1]",
          "data.cardinalities=[200,100,50,20]", "data.hotness=[1,2,1,1]", "data.num_dense=4",
          "data.train_samples=20000", "data.val_samples=2048", "data.global_batch_size=128",
          "optim.embedding=rowwise_adagrad", "optim.embedding_lr=0.05", "optim.dense=sgd",
          "optim.dense_lr=0.5", "train.max_steps=10", "train.log_every=1", "train.eval_every=0",
          "train.progress_bar=false", "checkpoint.resume=none", "parallel.replicate=false"]
THREE = ["model.tasks=[{name: click}, {name: like, weight: 0.5, head: [8]}, "
         "{name: see_less, weight: 2.0}]", "data.label_missing=0.3"]
# THREE with each task's own dot interaction (model/task_dots.py) is trained on 2 ranks too.
# Two tasks over 3 experts, on cat (des applies to it); step 5 is resumed on another world size
MMOE = ["model.tasks=[{name: click}, {name: like, weight: 0.5, head: [8]}]",
        "data.label_missing=0.3", "model.mmoe.experts=3", "model.mmoe.expert_mlp=[16,12]",
        "model.interaction=cat", "checkpoint.every=5"]
SHORT = ["train.max_steps=3"]  # the interactions that only need to train with tasks
VARIANTS = {
    "three": THREE,
    "mmoe": MMOE,
    "task_dots": [*THREE, "model.task_dot_dim=3"],
    "des": [*MMOE, "parallel.exchange=des"],
    "pipeline": [*THREE, "train.pipeline=enabled"],
    "bf16": [*THREE, "train.precision=bf16", "train.precision_fallback=false"],
    "dhen": [*THREE, *SHORT, "model.interaction=dhen", "model.dhen.layers=1"],
    "dcn_stacked": [*THREE, *SHORT, "model.interaction=dcn", "model.dcn.layers=2",
                    "model.dcn.rank=8"],
    "dcn_parallel": [*THREE, *SHORT, "model.interaction=dcn", "model.dcn.layers=2",
                     "model.dcn.rank=8", "model.dcn.structure=parallel"],
    "single": ["train.max_steps=2"],  # one click logit: a single-task checkpoint
}


if __name__ == "__main__":
    run_variants(COMMON, VARIANTS)
