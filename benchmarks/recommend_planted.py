"""The funnel on a planted log, against its teacher: is each stage at or above the one before it,
and how far below the teacher's own ranking (issue 44)?

    .venv/bin/python benchmarks/recommend_planted.py [--config configs/two_tower_demo.yaml]
        [--set data.users=943 ...] [--work DIR] [--users N] [--quick] [-- RECOMMEND ARGS]

1. The log: the teacher of the config's data section (planted_interactions.teacher: user and
   item latents around their segment's and category's centres, Zipf popularity; by default
   ml-100k's size, SIZE: 943 users, 1,682 items, 100 engagements each; `--set` changes it)
   draws each user's engagements (planted_interactions.draws, the planted log's own draws) and
   the user rates each one by RULE: q = the item's place (0: the lowest) in the catalogue
   ordered by its affinity <u, v> with the user, over the catalogue's size; rating = 1 + the
   number of EDGES (0.6, 0.8, 0.9, 0.96) at or below q. So rating >= 4
   (`liked`, the funnel's positive) is the user's top 10% of the catalogue by affinity, and
   rating <= 2 (`disliked`) its bottom 80%: a popular item drawn against the user's taste is
   rated low, which the ranker can learn and popularity cannot. Written as MovieLens u.data
   (user, item, rating, timestamp; ids from 1; timestamp = draw number, so leave-last-out's
   test item is the user's last liked draw), rows in time order.
2. The funnel: benchmarks/recommend.py on that log, as a subprocess, with its own arguments
   (those after `--`, and --users, --quick; --work WORK/recommend), choosing its rankers on
   validation as it does; its summary line read back.
3. The teacher on the SAME test items (recommend.py's: the retrieval dataset's test users whose
   item is findable, its first --users of them): for each, the catalogue's items (the retrieval
   dataset's, those with a liked row) outside the user's history (training + validation items,
   the funnel's exclusions) ranked by the teacher's score; `ceiling`: among the items the user
   would like (rating >= 4 by RULE: the test item is one, and the next liked draw is a softmax of
   the teacher's scores over them), `teacher`: over every item; `popularity`: by training count.
4. A table: each stage's HR@10, its share of the ceiling, and whether it is at or above the
   stage before it (ORDER: a source after popularity, merged after the best source, ranked after
   merged; the three-stage funnel: first stage after merged, its ranked list after the first
   stage; recommend.py's summary gives the three-stage funnel's merged list only as the
   two-stage one, which differs in its 400 candidates per source against 200), and last:

    recommend_planted: users=U items=I per_user=N test_users=T ceiling=X teacher=X
        popularity=X pixie=X two_tower=X history=X merged=X ranked=X first_stage=X
        ranked_three_stage=X ordered=true|false

`--quick`: a log of QUICK's size and recommend.py --quick, a check that it runs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from recommend_build import log_folder  # noqa: E402  (the folder recommend.py builds in)
from dlrm_hybrid.config_loading import load_config  # noqa: E402
from dlrm_hybrid.data.interactions.planted_interactions import (  # noqa: E402
    draws, ranking_metrics, teacher, teacher_scores)

EDGES = np.array([0.6, 0.8, 0.9, 0.96])  # RULE: the affinity quantiles where ratings 2..5 start
LIKED = 4  # recommend.py's positive and `liked` label: rating >= 4
SIZE = ("data.users=943", "data.items=1682", "data.interactions_per_user=100")  # ml-100k's
QUICK = ("data.users=300", "data.items=300", "data.interactions_per_user=40")  # the validation
# world's towers need a batch of 256 training pairs (120 users x 30 draws left 250: it failed)
SOURCES = ("pixie", "two_tower", "history")
# (stage, the stage it must be at or above; "sources": the best of SOURCES)
ORDER = (("pixie", "popularity"), ("two_tower", "popularity"), ("history", "popularity"),
         ("merged", "sources"), ("ranked", "merged"), ("first_stage", "merged"),
         ("ranked_three_stage", "first_stage"))
FUNNEL_KEYS = (*SOURCES, "merged", "ranked", "first_stage", "ranked_three_stage")


def ratings(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """RULE: the rating [users, items] each user gives each item, 1 + the EDGES at or below q,
    q = the item's place (0: the lowest) in the catalogue ordered by its affinity <u, v> with
    the user, over the catalogue's size."""
    place = np.argsort(np.argsort(u @ v.T, axis=1, kind="stable"), axis=1, kind="stable")
    return 1 + np.searchsorted(EDGES, place / v.shape[0], side="right")


def planted_log(data_cfg) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(user, item, rating, timestamp) of every draw (0-based teacher ids), in time order: the
    planted log's draws (planted_interactions.draws, the same seed), rated by RULE."""
    u, v, log_pop, _, _ = teacher(data_cfg)
    drawn = draws(data_cfg, teacher_scores(data_cfg, u, v, log_pop),
                  np.random.default_rng(data_cfg.seed + 1))
    timestamp = np.repeat(np.arange(drawn.shape[1]), data_cfg.users)  # draw k of every user
    users = np.tile(np.arange(data_cfg.users), drawn.shape[1])
    items = drawn.T.ravel()
    return users, items, ratings(u, v)[users, items], timestamp


def write_udata(path: Path, data_cfg) -> int:
    """The planted log as MovieLens u.data (tab-separated, ids from 1): its rows."""
    users, items, rating, timestamp = planted_log(data_cfg)
    table = np.stack([users + 1, items + 1, rating, timestamp + 1], axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    np.savetxt(part, table, fmt="%d", delimiter="\t")
    part.replace(path)
    return len(table)


def parse_summary(output: str, prefix: str = "recommend:") -> Dict[str, str]:
    """The fields of the last line starting with `prefix` (key=value words)."""
    lines = [line for line in output.splitlines() if line.startswith(prefix)]
    if not lines:
        sys.exit(f"no `{prefix}` line in the output; its end:\n" + "\n".join(
            output.splitlines()[-20:]))
    return dict(word.split("=", 1) for word in lines[-1].split()[1:] if "=" in word)


def run_funnel(log: Path, work: Path, forwarded: Sequence[str]) -> Tuple[Dict[str, float], int]:
    """benchmarks/recommend.py on `log` (its output shown as it runs): each stage's HR@10 from
    its summary line, and the number of test users it asked."""
    command = [sys.executable, str(ROOT / "benchmarks/recommend.py"), "--data", str(log),
               "--name", "planted", "--work", str(work), *forwarded]
    print("$ " + " ".join(command), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    lines = []
    for line in run.stdout:
        print("  | " + line, end="", flush=True)
        lines.append(line)
    if run.wait():
        sys.exit(f"benchmarks/recommend.py failed (exit {run.returncode}); its output above")
    return funnel_hit_rates("".join(lines))


def funnel_hit_rates(output: str) -> Tuple[Dict[str, float], int]:
    """recommend.py's output -> ({stage: HR@10} of its summary line, test users asked)."""
    fields = parse_summary(output)
    hr = {stage: float(fields[f"hr@10_{stage}"]) for stage in FUNNEL_KEYS
          if f"hr@10_{stage}" in fields}
    asked = re.search(r"^planted: (\d+) test users", output, re.MULTILINE)
    if asked is None:
        sys.exit("recommend.py's output has no 'planted: N test users' line")
    return hr, int(asked.group(1))


def test_items(data, asked: int) -> Tuple[np.ndarray, np.ndarray, List[np.ndarray]]:
    """recommend.py's test requests: (users, test items, each user's history = training and
    validation items), dense ids of the retrieval dataset `data`, its first `asked` findable
    users."""
    indptr, items = data.findable("test", ("train", "val"))
    users = np.repeat(np.arange(data.users), np.diff(indptr))[:asked]
    seen_users = np.concatenate([data.pairs[s][0] for s in ("train", "val")])
    seen_items = np.concatenate([data.pairs[s][1] for s in ("train", "val")])
    order = np.argsort(seen_users, kind="stable")
    bounds = np.searchsorted(seen_users[order], np.arange(data.users + 1))
    history = [seen_items[order[bounds[user]:bounds[user + 1]]] for user in users]
    return users, np.asarray(items[:asked]), history


def ceilings(data_cfg, retrieval: Path, asked: int) -> Dict[str, float]:
    """HR@10 on recommend.py's test items of the teacher's ranking among the items each user
    would like (`ceiling`), among all items (`teacher`), and of training popularity."""
    from dlrm_hybrid.data.interactions.interaction_data import open_interactions

    data = open_interactions(str(retrieval))
    users, targets, history = test_items(data, asked)
    raw_user = np.loadtxt(retrieval / "users.txt", dtype=np.int64, ndmin=1) - 1
    raw_item = np.loadtxt(retrieval / "items.txt", dtype=np.int64, ndmin=1) - 1
    u, v, log_pop, _, _ = teacher(data_cfg)
    score = teacher_scores(data_cfg, u[raw_user[users]], v[raw_item], log_pop[raw_item])
    liked = ratings(u[raw_user[users]], v)[:, raw_item] >= LIKED
    popularity = np.bincount(data.pairs["train"][1], minlength=len(raw_item)).astype(float)
    width = max(1, max(len(h) for h in history))
    seen = np.stack([np.resize(h, width) for h in history])  # repeats: the same exclusions
    rankings = {"ceiling": np.where(liked, score, -np.inf), "teacher": score,
                "popularity": np.broadcast_to(popularity, score.shape)}
    return {name: ranking_metrics(lambda rows, s=s: s[rows], seen, targets)["recall@10"]
            for name, s in rankings.items()}


def order_rows(hr: Dict[str, float]) -> List[Tuple[str, float, str, float, bool]]:
    """(stage, HR@10, the stage before it, its HR@10, at or above it) for each of ORDER that
    the funnel measured."""
    rows = []
    for stage, before in ORDER:
        if stage not in hr:
            continue
        if before == "sources":
            before = max((s for s in SOURCES if s in hr), key=lambda s: hr[s])
        rows.append((stage, hr[stage], before, hr[before], hr[stage] >= hr[before]))
    return rows


def summary_line(data_cfg, asked: int, hr: Dict[str, float]) -> str:
    """The last line, for scripts: sizes, the teacher's, popularity's and each stage's HR@10,
    and whether every stage of ORDER is at or above the one before it."""
    ordered = all(ok for *_, ok in order_rows(hr))
    return (f"recommend_planted: users={data_cfg.users} items={data_cfg.items} "
            f"per_user={data_cfg.interactions_per_user} test_users={asked} "
            + " ".join(f"{k}={hr[k]:.4f}" for k in ("ceiling", "teacher", "popularity",
                                                   *FUNNEL_KEYS) if k in hr)
            + f" ordered={str(ordered).lower()}")


def table(hr: Dict[str, float]) -> str:
    """The markdown table: the teacher and popularity, then each stage against its
    predecessor."""
    out = ["| stage | HR@10 | of the ceiling | at or above |", "|---|---:|---:|---|"]
    for name in ("ceiling", "teacher", "popularity"):
        out.append(f"| {name} | {hr[name]:.4f} | {hr[name] / hr['ceiling']:.2f} | |")
    for stage, value, before, was, ok in order_rows(hr):
        out.append(f"| {stage} | {value:.4f} | {value / hr['ceiling']:.2f} | "
                   f"{'yes' if ok else '**no**'}: {before} {was:.4f} |")
    return "\n".join(out)


def data_section(config: Optional[str], sets: Sequence[str], quick: bool):
    """The config's data section with SIZE (QUICK) and then `sets` applied."""
    from dlrm_hybrid.config import ConfigError
    from dlrm_hybrid.errors import UserError

    try:
        return load_config(config, [*(QUICK if quick else SIZE), *sets]).data
    except (ConfigError, UserError) as e:
        sys.exit(f"error: {e}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    forwarded = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/two_tower_demo.yaml"),
                        help="whose data section is the teacher (default: the two-tower demo's)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, e.g. data.users=500 (after SIZE)")
    parser.add_argument("--work", help="keep the log and recommend.py's --work here, in a "
                        "folder named by the data section (default: a temporary folder)")
    parser.add_argument("--users", type=int, default=0, help="recommend.py --users: test users "
                        "to ask (0: all)")
    parser.add_argument("--quick", action="store_true", help="a small log and recommend.py "
                        "--quick: a check that it runs")
    args = parser.parse_args(argv)
    data_cfg = data_section(args.config, args.set, args.quick)
    forwarded += [*(["--users", str(args.users)] if args.users else []),
                  *(["--quick"] if args.quick else [])]
    with tempfile.TemporaryDirectory() as tmp:
        key = hashlib.sha256(repr(sorted(vars(data_cfg).items())).encode()).hexdigest()[:10]
        work = Path(args.work).resolve() / f"planted_{key}" if args.work else Path(tmp)
        log = work / "u.data"
        if not log.is_file():
            rows = write_udata(log, data_cfg)
            print(f"planted log: {rows:,} rows ({data_cfg.users} users x "
                  f"{data_cfg.interactions_per_user} draws, {data_cfg.items} items) -> {log}",
                  flush=True)
        hr, asked = run_funnel(log, work / "recommend", forwarded)
        built = log_folder(work / "recommend", str(log))  # where recommend.py made them
        hr.update(ceilings(data_cfg, built / "retrieval", asked))
    print(f"\nplanted log ({data_cfg.users} users, {data_cfg.items} items, "
          f"{data_cfg.interactions_per_user} draws each, seed {data_cfg.seed}): HR@10 of the "
          f"{asked} test users recommend.py asked")
    print(table(hr))
    print(summary_line(data_cfg, asked, hr))


if __name__ == "__main__":
    main()
