"""A real log's habits: a row written twice, a re-rating and timestamps that tie. A row equal to
an earlier one in every column is one engagement, kept once by every dataset of the log
(retrieval, early, ranking; interaction_split.duplicate_rows); a pair's row that differs is
another engagement (a re-watch, which the candidate models may know from the earlier one); ties
are broken by file order everywhere. So the funnel's commands go through a MovieLens ratings.csv
with a hand-added user whose rows all read time 0, one of them twice; and every row read is
counted once (--holdout-recent's rows too)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import done_fields, failure, run_cli
from test_candidate_negatives import TOWER

HAND = "999"  # the hand-added user: every timestamp 0, its first row written again at the end
DOUBLED = (HAND, "7", "5.0", "0")
RERATED = (HAND, "13", "4.0", "0")  # its second row (4.5) rated again, last of all


def ratings_csv(path: Path, users: int = 40, movies: int = 48) -> list:
    """A ratings.csv shaped as MovieLens' generator writes it (header userId,movieId,rating,
    timestamp; rows by user, then movie; half-star ratings; Unix times), each user rating 16
    movies, mostly of its quarter of the catalogue; then the hand-added user, whose 16 rows
    read time 0, whose first row is written again after every other row, and whose second
    is rated again after that. The rows."""
    rng = np.random.default_rng(3)
    rows = []
    for user in range(1, users + 1):
        quarter = (user % 4) * (movies // 4) + 1
        mine = quarter + rng.choice(movies // 4, 10, replace=False)
        other = rng.choice(np.setdiff1d(np.arange(1, movies + 1), mine), 6, replace=False)
        start = 1_100_000_000 + int(rng.integers(0, 10**8))
        times = start + np.sort(rng.choice(10**6, 16, replace=False))
        liked = set(mine.tolist())
        for movie, when in zip(rng.permutation(np.concatenate([mine, other])), times):
            stars = rng.choice([4.0, 4.5, 5.0]) if movie in liked else rng.choice([1.0, 2.5, 3.5])
            rows.append((str(user), str(movie), f"{stars:.1f}", str(when)))
    rows.sort(key=lambda r: (int(r[0]), int(r[1])))
    hand = [DOUBLED] + [(HAND, str(m), "4.5" if m % 3 else "2.0", "0")
                        for m in range(13, 28)]
    rows += hand + [DOUBLED, RERATED]
    path.write_text("userId,movieId,rating,timestamp\n" + "".join(",".join(r) + "\n"
                                                                   for r in rows))
    return rows


def cli(*args: str):
    result = run_cli(list(args))
    assert result.returncode == 0, failure(result)
    return result


def split_pairs(folder: Path, split: str) -> list:
    users = (folder / "users.txt").read_text().split()
    items = (folder / "items.txt").read_text().split()
    return [(users[u], items[i]) for u, i in zip(np.load(folder / f"{split}_user.npy"),
                                                 np.load(folder / f"{split}_item.npy"))]


@pytest.fixture(scope="module")
def funnel(tmp_path_factory):
    """The log's retrieval dataset, its early one (--holdout-recent 3), the early tower and
    graph, and the ranking dataset of their candidates: the commands a user runs."""
    root = tmp_path_factory.mktemp("duplicates")
    rows = ratings_csv(root / "ratings.csv")
    read = ["preprocess", "interactions", "--input", str(root / "ratings.csv")]
    made = {"ret": cli(*read, "--output", str(root / "ret")),
            "early": cli(*read, "--output", str(root / "early"), "--holdout-recent", "3")}
    (root / "tt.yaml").write_text(TOWER)
    cli("train", "--config", str(root / "tt.yaml"), "--set", f"data.path={root / 'early'}",
        "--set", f"train.run_dir={root / 'T_run'}")
    cli("export", "--retrieval", "--checkpoint", str(root / "T_run/checkpoints/step_40"),
        "--out", str(root / "T"))
    cli("pixie", "build", "--data", str(root / "early"), "--out", str(root / "G"))
    ranking = [*read, "--labels", "watched,liked:rating>=4", "--ranking-negatives", "3",
               "--holdout", str(root / "ret"), "--candidates", f"{root / 'T'},{root / 'G'}"]
    made["rank"] = run_cli([*ranking, "--output", str(root / "rank")])
    return root, rows, made


def test_the_funnel_goes_through_a_row_written_twice_a_re_rating_and_tied_timestamps(funnel):
    """Without the rule the early tower trains on the first copy while the second is the
    retrieval test pair, and the ranking dataset is refused as a leak; a re-rating is an
    engagement of its own, the early tower knowing its pair from the first rating is no leak."""
    root, rows, made = funnel
    assert made["rank"].returncode == 0, failure(made["rank"])
    for name in ("ret", "early"):
        assert done_fields(made[name].stdout)["duplicate"] == 1
    done = done_fields(made["rank"].stdout)
    assert done["duplicate"] == 1 and done["rows"] == len(rows) == sum(
        done[k] for k in ("kept", "skipped", "duplicate", "below_min_count", "held_out",
                          "not_candidates"))  # every row counted once
    # the hand-added user: file order breaks the ties, the second copy is no engagement
    rows = rows[:-2] + rows[-1:]
    liked = [m for u, m, r, _ in rows if u == HAND and float(r) >= 4]
    assert liked[-1] == RERATED[1] and liked.count(RERATED[1]) == 2
    assert (HAND, liked[-1]) in split_pairs(root / "ret", "test")
    assert (HAND, liked[-2]) in split_pairs(root / "ret", "val")
    early = split_pairs(root / "early", "train")
    assert sorted(m for u, m in early if u == HAND) == sorted(liked[:-5])
    evaluation = {p for s in ("val", "test") for p in split_pairs(root / "ret", s)}
    # what the early tower knows of the evaluation pairs: re-watches only, known from training
    assert set(early) & evaluation == {(HAND, RERATED[1])}
    assert (HAND, RERATED[1]) in split_pairs(root / "ret", "train")


def test_a_duplicate_is_a_row_equal_in_every_column(tmp_path):
    """Copies anywhere in the file, the first kept; another rating, time or side value is
    another engagement (a re-watch)."""
    from dlrm_hybrid.data.interactions.interaction_log import parse_columns, read_log
    from dlrm_hybrid.data.interactions.interaction_split import duplicate_rows

    lines = ["a,x,5,1,p", "a,x,4,1,p", "b,x,5,1,p", "a,x,5,1,p", "a,x,5,2,p", "a,y,5,1,p",
             "a,x,5,1,q", "a,x,5,1,p", "b,x,5,1,p"]
    (tmp_path / "log.csv").write_text("\n".join(lines) + "\n")
    log = read_log([str(tmp_path / "log.csv")], parse_columns("user,item,rating,timestamp,"
                                                              "user:device"))
    assert duplicate_rows(log).tolist() == [False, False, False, True, False, False, False,
                                            True, True]


def test_every_row_is_counted_once_with_holdout_recent(tmp_path):
    """30 rows of 5 users, --holdout-recent 2: the 10 recent positives are counted as held, not
    again below --min-count; the users and items they alone had are not dropped by it."""
    rows = [f"u{u},i{u * 6 + k},5,{k}" for u in range(5) for k in range(6)]
    rows[:2] = ["u0,i0,5,0", "u0,i0,5,0"]  # one row written twice
    rows[2] = "u0,i2,1,2"  # not positive
    (tmp_path / "log.csv").write_text("\n".join(rows) + "\n")
    result = cli("preprocess", "interactions", "--input", str(tmp_path / "log.csv"), "--columns",
                 "user,item,rating,timestamp", "--output", str(tmp_path / "out"),
                 "--holdout-recent", "2")
    done = done_fields(result.stdout)
    assert (done["duplicate"], done["not_positive"], done["below_min_count"],
            done["held_recent"]) == (1, 1, 0, 10)
    kept = sum(int(done[s]) for s in ("train", "val", "test"))
    assert kept + 1 + 1 + 0 + 10 == 30
    import yaml

    extra = yaml.safe_load((tmp_path / "out/interactions.yaml").read_text())["extra"]
    assert extra["dropped_users"] == extra["dropped_items"] == 0
    assert extra["recent_only_items"] == 10 and extra["recent_only_users"] == 0
    assert "10 positives left out (--holdout-recent 2" in result.stdout


def test_the_benchmarks_validation_world_stops_before_the_deduplicated_test_item(funnel):
    """benchmarks/recommend_build.validation_log: the world's test items are the log's
    validation items, the hand-added user's too (its last positive row is the second copy,
    no engagement of its own)."""
    from conftest import load_script

    root = funnel[0]
    build = load_script("benchmarks/recommend_build.py", "recommend_build_duplicates")
    world = build.validation_log(str(root / "ratings.csv"), root / "world")
    cli("preprocess", "interactions", "--input", world, "--output", str(root / "world_ret"))
    assert split_pairs(root / "world_ret", "test") == split_pairs(root / "ret", "val")
