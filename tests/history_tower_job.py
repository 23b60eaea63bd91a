"""Run under torchrun (or alone, one rank) by test_history_tower_ranks.py: a tiny two-tower
model with a history user tower (mean, attention) trained 10 steps on the planted log on this
world size, a checkpoint at step 5 and at the end (two_tower_job.py's settings).

usage: history_tower_job.py OUT [VARIANT ...] [--resume DIR] (tests/variant_job.py)
"""

from two_tower_job import COMMON
from variant_job import run_variants

HISTORY = ["model.user_tower.history_length=8", "train.eval_every=5"]
VARIANTS = {
    "mean": [*HISTORY, "model.user_tower.encoder=history_mean"],
    "attention": [*HISTORY, "model.user_tower.encoder=history_attention",
                  "model.user_tower.attention_layers=1"],
}


if __name__ == "__main__":
    run_variants(COMMON, VARIANTS)
