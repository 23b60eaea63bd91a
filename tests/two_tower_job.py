"""Run under torchrun (or alone, one rank) by test_two_tower.py: a tiny two-tower model trained
10 steps on the planted log with each variant of VARIANTS on this world size, a checkpoint at
step 5 and at the end. Each run's record is OUT/<variant>/ (metrics.jsonl, checkpoints/).

usage: two_tower_job.py OUT [VARIANT ...] [--resume DIR]
  VARIANT: those to train fresh (default: all)
  --resume DIR: then each of those variants that DIR (another launch's OUT) has, resumed from
                its step 5 on this world size, into OUT/resumed_<variant>/
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_hybrid.config import load_config  # noqa: E402
from dlrm_hybrid.parallel.process_group import init_distributed, shutdown  # noqa: E402
from dlrm_hybrid.train.loop import train  # noqa: E402

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


def config(run_dir: Path, variant: str, env, extra=()):
    return load_config(None, [*COMMON, *VARIANTS[variant], f"train.run_dir={run_dir}", *extra],
                       env.world_size)


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    resume = Path(args.pop(args.index("--resume") + 1)) if "--resume" in args else None
    args = [a for a in args if a != "--resume"]
    env = init_distributed("gloo")
    variants = args or list(VARIANTS)
    for variant in variants:
        train(config(out / variant, variant, env), env)
    if resume is not None:
        for variant in [v for v in variants if (resume / v).is_dir()]:
            checkpoint = resume / variant / "checkpoints" / "step_5"
            train(config(out / f"resumed_{variant}", variant, env,
                         [f"checkpoint.resume={checkpoint}"]), env)
    shutdown()


if __name__ == "__main__":
    main()
