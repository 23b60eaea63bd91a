"""Run under torchrun by test_des_exchange.py: the same short trainings with each embedding
exchange, on this world size; rank 0 writes their per-step losses to OUT/losses.json.

usage: des_job.py OUT [--more]   (--more: also the cross-path checkpoints, compositional
                                  features and the train pipeline)
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_hybrid.config_loading import load_config  # noqa: E402
from dlrm_hybrid.parallel.process_group import init_distributed, shutdown  # noqa: E402
from dlrm_hybrid.train.loop import train  # noqa: E402

# Dense SGD for the equivalence: Adagrad's first steps move each weight by +-lr whatever its
# gradient's size, so rounding of another summation order would decide near-zero ones.
# A first top layer of 48: cat's des then sends P * 48 values per sample over the job, pooled
# T * D = 128, so the counted bytes tell the paths apart on 2 ranks too (demo: 64, equal there).
# Every table sharded in both paths (des runs with no replicated table): the same plan, and the
# pooled bytes follow the formula over all T * D columns.
COMMON = ["train.max_steps=6", "train.log_every=1", "train.eval_every=0",
          "train.progress_bar=false", "train.rank_logs=true", "data.train_samples=40000",
          "data.val_samples=4096", "optim.dense=sgd", "optim.dense_lr=0.5",
          "model.top_mlp=[48,32,1]", "checkpoint.resume=none", "parallel.replicate=false"]


# On 4 ranks, 112 KiB for tables per rank: t_cat_0 (2000 x 16 fp32 = 125 KiB, 132.8 KiB with
# row-wise state) must be split column-wise, so des runs with a column shard.
# 112 KiB for tables per rank (each rank holds its share); 1 MiB kept for the dense part
SPLIT_ON_4 = ["parallel.memory_per_rank=1163264", "parallel.reserve_per_rank=1MiB"]


def run(out: Path, name: str, overrides, env) -> list:
    split = SPLIT_ON_4 if env.world_size == 4 else []
    cfg = load_config(str(ROOT / "configs/demo.yaml"),
                      COMMON + split + overrides + [f"train.run_dir={out / name}"])
    return train(cfg, env).losses


def main() -> None:
    out = Path(sys.argv[1])
    env = init_distributed("gloo")
    losses = {}
    for interaction in ("cat", "fm"):
        for optimizer in ("sgd", "rowwise_adagrad"):
            for exchange in ("pooled", "des"):
                name = f"{interaction}-{optimizer}-{exchange}"
                losses[name] = run(out, name, [f"model.interaction={interaction}",
                                               f"optim.embedding={optimizer}",
                                               f"parallel.exchange={exchange}"], env)
    if "--more" in sys.argv:
        # cat with dense Adagrad: its state for the W_t columns must travel too. Each path's
        # checkpoint at step 3 resumed by the other, against the first path's own steps 4-6.
        cat = ["model.interaction=cat", "optim.dense=adagrad", "optim.dense_lr=0.05",
               "checkpoint.every=3"]
        for first, then in (("des", "pooled"), ("pooled", "des")):
            losses[f"resume-{first}"] = run(out, f"resume-{first}",
                                            cat + [f"parallel.exchange={first}"], env)
            step_3 = out / f"resume-{first}" / "checkpoints" / "step_3"
            losses[f"resume-{first}-then-{then}"] = run(
                out, f"resume-{first}-then-{then}",
                cat + [f"parallel.exchange={then}", f"checkpoint.resume={step_3}"], env)
        # Compositional features (QR concat, hashing) and torchrec's train pipeline.
        hashed = "{technique: hash, features: [cat_1], buckets: 100}"
        for interaction, rules in (("cat", f"[{{technique: qr, features: [cat_0], collisions: 4, "
                                           f"operation: concat}}, {hashed}]"),
                                   ("fm", f"[{hashed}]")):
            for exchange in ("pooled", "des"):
                losses[f"parts-{interaction}-{exchange}"] = run(
                    out, f"parts-{interaction}-{exchange}",
                    [f"model.interaction={interaction}", f"model.compositional={rules}",
                     f"parallel.exchange={exchange}"], env)
        losses["cat-sgd-des-pipelined"] = run(
            out, "pipelined", ["model.interaction=cat", "optim.embedding=sgd",
                               "parallel.exchange=des", "train.pipeline=enabled"], env)
    if env.is_main:
        (out / "losses.json").write_text(json.dumps(losses))
    shutdown()


if __name__ == "__main__":
    main()
