"""HSTU and the SASRec-style reference on a planted sequential log, against its known ceiling
(issue 61): is HSTU within 0.9 of the ceiling, and above SASRec by more than 3 standard errors?

    .venv/bin/python benchmarks/sequential_planted.py [--users 20000] [--seeds 3] [--quick]
        [--work DIR] [--setting HSTU_DROPOUT,SASREC_DROPOUT] [--epochs N]

1. The log: data/interactions/planted_sequences.py's world (sessions on topics of a ring that
   drift to the next topic, a home topic, gaps that show where sessions start; WORLD below,
   seed 0), --users users over ITEMS items, written as MovieLens u.data (every rating 5) and
   preprocessed (`preprocess interactions`: leave-last-out by timestamp, so each user's test
   item is its last generated one, checked here).
2. The ceiling on the same test users, the catalogue the dataset ranks, each user's earlier
   items left out: the oracle that knows the home and current topic (`ceiling`), the exact
   posterior from the log with its times (`bayes`, what a learner can reach) and without them
   (`bayes_untimed`), and popularity.
3. benchmarks/sequential.py on that dataset as a subprocess (--dataset, --name planted, --seeds,
   --quick), its output streamed, its summary line read back.

Last line (se: over seeds, sqrt(se_hstu^2 + se_sasrec^2) for the difference; binomial_se:
sqrt(p (1 - p) / users) per model, as the test users' own noise):

    sequential_planted: users=U items=I ceiling_hr@10=X hstu_hr@10=X sasrec_hr@10=X
        hstu_share_of_ceiling=X hstu_minus_sasrec_in_se=X bayes_hr@10=X bayes_untimed_hr@10=X
        popularity_hr@10=X ceiling_ndcg@10=X hstu_ndcg@10=X sasrec_ndcg@10=X
        hstu_hr@10_binomial_se=X sasrec_hr@10_binomial_se=X hstu_minus_sasrec_in_binomial_se=X

--quick: QUICK's small world (default 1,000 users) and sequential.py --quick: a check that it
runs.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dlrm_hybrid.data.interactions.planted_sequences import (  # noqa: E402
    World, ceiling, planted_sequences, write_log)

ITEMS = 2000
# planted_sequences' defaults, written out: ceiling HR@10 ~0.41, the posterior with times ~0.99
# of it, without times ~0.95, popularity ~0.04 (2,000 users)
WORLD = {"topics": 50, "topic_size": 100, "zipf": 1.0, "continue_p": 0.5, "home_q": 0.1,
         "drift": 0.8, "min_len": 8, "max_len": 40}
QUICK = (1000, 500, {**WORLD, "topics": 20, "topic_size": 50, "max_len": 30})  # users, items
SEED = 0


def run(cmd, **kw) -> None:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, **kw)
    if done.returncode:
        sys.exit(f"{' '.join(map(str, cmd))} failed:\n{done.stdout}\n{done.stderr}")


def sequential(folder: Path, args) -> Dict[str, float]:
    """benchmarks/sequential.py on the dataset folder, streamed; its summary line's numbers."""
    cmd = [sys.executable, "-u", str(ROOT / "benchmarks/sequential.py"), "--dataset",
           str(folder), "--name", "planted", "--seeds", str(args.seeds)]
    cmd += [*(["--setting", args.setting] if args.setting else []),
            *(["--epochs", str(args.epochs)] if args.epochs else [])]
    proc = subprocess.Popen(cmd + (["--quick"] if args.quick else []), cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1)
    summary = None
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("sequential:"):
            summary = line
    if proc.wait() or summary is None:
        sys.exit(f"sequential.py failed (exit {proc.returncode}) or printed no summary line")
    return {k: float(v) for k, v in re.findall(r"(\S+)=([-+0-9.eE]+|nan)\b", summary)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, help="users (default 20,000; --quick: 1,000)")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per model")
    parser.add_argument("--setting", help="sequential.py --setting HSTU_DROPOUT,SASREC_DROPOUT "
                        "(no grids)")
    parser.add_argument("--epochs", type=int, default=0, help="sequential.py --epochs")
    parser.add_argument("--quick", action="store_true", help="a small world, sequential.py "
                        "--quick: a check that it runs")
    parser.add_argument("--work", help="keep the log and dataset here, in a folder named by the "
                        "world, reused by a later run of the same world (default: a temporary "
                        "folder)")
    args = parser.parse_args()
    users, items, world = QUICK if args.quick else (20000, ITEMS, WORLD)
    users = args.users or users
    with tempfile.TemporaryDirectory() as tmp:
        key = "_".join(f"{v:g}" for v in (users, items, SEED, *world.values()))
        work = Path(args.work).resolve() / f"planted_{key}" if args.work else Path(tmp)
        started = time.time()
        log = planted_sequences(users, items, SEED, **world)
        if not (work / "data/interactions.yaml").is_file():  # another world: another folder
            write_log(work / "u.data", log)
            run([sys.executable, "-m", "dlrm_hybrid", "preprocess", "interactions", "--input",
                 str(work / "u.data"), "--output", str(work / "data")])
        raw_items = np.array((work / "data/items.txt").read_text().split(), np.int64) - 1
        raw_users = np.array((work / "data/users.txt").read_text().split(), np.int64) - 1
        test_user = raw_users[np.load(work / "data/test_user.npy")]
        test_item = raw_items[np.load(work / "data/test_item.npy")]
        last = log.item[log.starts[1:] - 1]
        if sorted(test_user) != list(range(users)) or (last[test_user] != test_item).any():
            sys.exit("the dataset's test split is not each user's last generated item")
        corpus = np.zeros(items, bool)
        corpus[raw_items] = True
        best = ceiling(log, corpus)
        print(f"planted log: {users} users, {items} items ({int(corpus.sum())} in the "
              f"catalogue), {len(log.item)} rows; {World(users, items, SEED, **world)}",
              flush=True)
        print("ceiling on the test users: " + " ".join(
            f"{k}={v:.4f}" for k, v in best.items() if k != "users")
              + f" ({time.time() - started:.0f} s)", flush=True)
        got = sequential(work / "data", args)

    def binomial(p: float) -> float:
        return math.sqrt(p * (1 - p) / users)

    h, s = got["hstu_hr@10"], got["sasrec_hr@10"]
    seed_se = math.hypot(got["hstu_hr@10_se"], got["sasrec_hr@10_se"])
    bin_se = math.hypot(binomial(h), binomial(s))
    print(f"sequential_planted: users={users} items={items} ceiling_hr@10={best['hr@10']:.4f} "
          f"hstu_hr@10={h:.4f} sasrec_hr@10={s:.4f} "
          f"hstu_share_of_ceiling={h / best['hr@10']:.3f} "
          f"hstu_minus_sasrec_in_se={(h - s) / seed_se if seed_se else math.nan:.2f} "
          f"bayes_hr@10={best['bayes_hr@10']:.4f} "
          f"bayes_untimed_hr@10={best['bayes_untimed_hr@10']:.4f} "
          f"popularity_hr@10={best['popularity_hr@10']:.4f} "
          f"ceiling_ndcg@10={best['ndcg@10']:.4f} hstu_ndcg@10={got['hstu_ndcg@10']:.4f} "
          f"sasrec_ndcg@10={got['sasrec_ndcg@10']:.4f} "
          f"hstu_hr@10_binomial_se={binomial(h):.4f} sasrec_hr@10_binomial_se={binomial(s):.4f} "
          f"hstu_minus_sasrec_in_binomial_se={(h - s) / bin_se:.2f}")


if __name__ == "__main__":
    main()
