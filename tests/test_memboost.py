"""Memboost (serve/memboost.py, impressions.py, memboost_features.py, memboost_command.py): COEC
on a hand-computed log, the position curve recovered from the random-order share of a planted
log, incremental = all at once, the bound per query, no feature from the future, and bad
settings or impression files refused in one line with nothing written."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import failure, run_cli
from dlrm_hybrid.errors import UserError
from dlrm_hybrid.serve.impressions import (HEADER, Impressions, append_impressions, concat,
                                           lines, read_impressions, served, write_impressions)
from dlrm_hybrid.serve.memboost import (MemboostSettings, MemboostStats, load_stats,
                                        save_stats)
from dlrm_hybrid.serve.memboost_features import features_before

HAND = """request\ttime\tquery_kind\tquery\titem\tposition\trandom\tclicked
r1\t1\tuser\tu1\ta\t1\t1\t1
r1\t1\tuser\tu1\tb\t2\t1\t0
r2\t2\tuser\tu1\tb\t1\t1\t1
r2\t2\tuser\tu1\ta\t2\t1\t1
r3\t3\tuser\tu2\ta\t1\t0\t0
r3\t3\tuser\tu2\tc\t2\t0\t1
r4\t4\titem\ta\tc\t1\t0\t2
"""


def test_coec_on_a_hand_computed_log(tmp_path):
    (tmp_path / "log.tsv").write_bytes(b"\xef\xbb\xbf" + HAND.replace("\n", "\r\n").encode())
    stats = MemboostStats(MemboostSettings(prior=1.0))
    stats.update(read_impressions(str(tmp_path / "log.tsv")))
    # random-order rows r1, r2: position 1 shown twice, clicked twice; position 2 twice, once
    assert stats.curve()[:3].tolist() == [1.0, 0.5, 0.5]  # position 3: position 2's rate
    # (u1, a) at 1 and 2: C 2, E 1 + 0.5; (u1, b) at 2 and 1: C 1, E 1.5; (u2, c) at 2: C 1,
    # E 0.5; (item a, c) at 1: C 2, E 1; (u2, a) at 1: C 0, E 1
    got = {(q, i): m for q, i, m in zip(
        ["u1", "u1", "u2", "u2", "a"], ["a", "b", "c", "a", "c"],
        [*stats.scores("user", "u1", ["a", "b"]), *stats.scores("user", "u2", ["c", "a"]),
         *stats.scores("item", "a", ["c"])])}
    want = {("u1", "a"): np.log(3 / 2.5), ("u1", "b"): np.log(2 / 2.5),
            ("u2", "c"): np.log(2 / 1.5), ("u2", "a"): np.log(1 / 2), ("a", "c"): np.log(3 / 2)}
    assert got == pytest.approx(want, abs=1e-12)
    assert stats.scores("user", "u1", ["c", "zz"]).tolist() == [0.0, 0.0]  # not held: 0
    # without the correction: E = impressions x the overall rate 6 / 7
    rate = 6 / 7
    assert stats.scores("user", "u1", ["a"], corrected=False)[0] == pytest.approx(
        np.log(3 / (2 * rate + 1)))
    # the prior pulls a pair with little evidence to 0 the more, the larger it is
    strong = MemboostStats(MemboostSettings(prior=100.0))
    strong.update(read_impressions(str(tmp_path / "log.tsv")))
    assert abs(strong.scores("user", "u2", ["c"])[0]) < 0.01


def planted(seed: int, requests: int, random_share: float):
    """A log of `requests` from 20 queries over 50 items each with a known relevance, K = 10
    shown, clicked with probability theta_p * relevance: ranked requests show the most relevant
    first (so their click rate per position mixes position and relevance), a `random_share`
    shows a random 10 in random order."""
    rng = np.random.default_rng(seed)
    theta = np.arange(1, 11) ** -0.7
    relevance = rng.uniform(0.05, 0.6, (20, 50))
    query = rng.integers(0, 20, requests)
    is_random = rng.random(requests) < random_share
    best = np.argsort(-relevance, 1)[:, :10]
    lists = np.where(is_random[:, None], np.argsort(rng.random((requests, 50)), 1)[:, :10],
                     best[query])
    clicked = rng.random((requests, 10)) < theta * relevance[query[:, None], lists]
    n = requests * 10
    log = Impressions(np.repeat(np.arange(requests).astype(str), 10),
                      np.repeat(np.arange(requests, dtype=float), 10), np.zeros(n, np.int8),
                      np.repeat(np.char.add("q", query.astype(str)), 10),
                      np.char.add("i", lists.reshape(-1).astype(str)),
                      np.tile(np.arange(1, 11, dtype=np.int32), requests),
                      np.repeat(is_random, 10), clicked.reshape(-1).astype(float))
    return log, theta / theta[0]


def test_the_position_curve_is_recovered_from_the_random_share_of_a_planted_log():
    log, true = planted(0, 60_000, 0.2)
    stats = MemboostStats()
    stats.update(log)
    assert np.abs(stats.relative_curve(10) / true - 1).max() < 0.06
    # the whole log's rate per position (what ignoring the random share would give) is not it
    naive = np.bincount(log.position - 1, log.clicked) / np.bincount(log.position - 1)
    assert np.abs(naive / naive[0] / true - 1).max() > 0.12


def random_log(rng: np.random.Generator, requests: int, start: int) -> Impressions:
    parts = []
    for r in range(requests):
        shown = rng.choice(8, int(rng.integers(1, 6)), replace=False)
        parts.append(served(f"r{start + r}", float(start + r), str(rng.choice(["user", "item"])),
                            f"q{rng.integers(3)}", [f"i{i}" for i in shown],
                            bool(rng.random() < 0.5), rng.integers(0, 2, len(shown))))
    return concat(parts)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 30), st.integers(0, 30))
def test_a_new_log_updates_the_statistics_as_reading_all_logs_at_once(seed, first, second):
    rng = np.random.default_rng(seed)
    a, b = random_log(rng, first, 0), random_log(rng, second, first)
    a.random[0] = True  # position 1 of the random-order share is known
    one, two = MemboostStats(), MemboostStats()
    one.update(a)
    one.update(b)
    two.update(concat([a, b]))
    assert one.keys.tolist() == two.keys.tolist()
    assert np.allclose(one.boost(), two.boost()) and np.allclose(one.shown, two.shown)
    assert np.allclose(one.boost(False), two.boost(False))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 40), st.integers(1, 5))
def test_each_query_keeps_its_pairs_with_the_most_impressions(seed, requests, bound):
    rng = np.random.default_rng(seed)
    log = random_log(rng, requests, 0)
    kept, full = MemboostStats(MemboostSettings(max_pairs=bound)), MemboostStats()
    kept.update(log)
    full.update(log)
    fk, fq, fi = full.pairs()
    shown, clicks = full.shown.sum(1), full.clicks
    for kind, query in set(zip(fk.tolist(), fq.tolist())):
        rows = np.flatnonzero((fk == kind) & (fq == query))
        best = sorted(rows, key=lambda r: (-shown[r], -clicks[r], fi[r]))[:bound]
        kk, kq, ki = kept.pairs()
        assert sorted(ki[(kk == kind) & (kq == query)].tolist()) == sorted(fi[best].tolist())


def test_no_feature_reads_an_impression_at_or_after_its_row():
    log, _ = planted(1, 3000, 0.3)
    rows = np.random.default_rng(2).integers(0, len(log), 200)
    when = log.time[rows]  # each row at the time of an impression of its pair
    args = (log.kind[rows], log.query[rows], log.item[rows], when)
    got = features_before(log, *args)
    assert (got[:, 0] > 0).mean() > 0.5  # most rows have engagements before them
    for r in range(0, 200, 20):
        # the row's own impression and every later one clicked and moved: the same features
        future = log.time >= when[r]
        changed = Impressions(log.request, log.time, log.kind, log.query, log.item,
                              np.where(future, 1, log.position).astype(np.int32),
                              log.random | future, np.where(future, 5.0, log.clicked))
        one = tuple(a[r:r + 1] for a in args)
        assert np.array_equal(features_before(changed, *one)[0], got[r])
        # and they are the statistics of the impressions before it
        before = MemboostStats()
        before.update(log.take(np.flatnonzero(log.time < when[r])))
        key = f"user\x1f{args[1][r]}\x1f{args[2][r]}"
        held = key in before.keys.tolist()
        clicks = before.clicks[before.keys.tolist().index(key)] if held else 0.0
        assert got[r, 0] == pytest.approx(np.log1p(clicks), abs=1e-5)
        assert got[r, 2] == pytest.approx(before.scores("user", str(args[1][r]),
                                                        [str(args[2][r])])[0], abs=1e-5)


def test_stats_files_round_trip_and_the_commands_write_whole(tmp_path):
    (tmp_path / "log.tsv").write_text(HAND)
    result = run_cli(["memboost", "update", "--impressions", str(tmp_path / "log.tsv"),
                      "--out", str(tmp_path / "s.npz"), "--prior", "2"])
    assert result.returncode == 0, failure(result)
    assert "pairs=5 logs=1 random_impressions=4 prior=2" in result.stdout
    stats = load_stats(str(tmp_path / "s.npz"))
    save_stats(stats, str(tmp_path / "t.npz"))
    again = load_stats(str(tmp_path / "t.npz"))
    assert np.array_equal(again.boost(), stats.boost()) and again.settings.prior == 2.0
    log = read_impressions(str(tmp_path / "log.tsv"))
    write_impressions(str(tmp_path / "copy.tsv"), log)
    (tmp_path / "added.tsv").write_text(HAND.rstrip("\n"))  # its last line unended
    append_impressions(str(tmp_path / "added.tsv"), served("r9", 9, "item", "b", ["a"], True),
                       "--log-impressions")
    assert len(read_impressions(str(tmp_path / "added.tsv"))) == len(log) + 1
    assert (tmp_path / "copy.tsv").read_text().splitlines()[0] == HEADER
    assert read_impressions(str(tmp_path / "copy.tsv")).clicked.tolist() == log.clicked.tolist()
    (tmp_path / "clicks.tsv").write_text("r3\ta\n")
    result = run_cli(["memboost", "update", "--impressions", str(tmp_path / "copy.tsv"),
                      "--clicks", str(tmp_path / "clicks.tsv"), "--stats",
                      str(tmp_path / "s.npz"), "--out", str(tmp_path / "s2.npz")])
    assert result.returncode == 0, failure(result)
    two = load_stats(str(tmp_path / "s2.npz"))
    assert two.clicks.sum() == 2 * stats.clicks.sum() + 1 and len(two.logs) == 2
    show = run_cli(["memboost", "show", "--stats", str(tmp_path / "s2.npz"), "--query",
                    "user:u1"])
    assert show.returncode == 0 and "2\t4\t0.50000\t0.5000" in show.stdout, failure(show)
    assert not list(tmp_path.glob(".*partial*"))


def test_a_log_with_a_byte_order_mark_and_windows_line_ends_takes_appended_rows(tmp_path):
    """A log `memboost update` reads (a byte-order mark, CRLF) is one `recommend
    --log-impressions` appends to, not one it refuses."""
    log = tmp_path / "bom.tsv"
    log.write_bytes(b"\xef\xbb\xbf" + HAND.replace("\n", "\r\n").encode())
    before = read_impressions(str(log))
    append_impressions(str(log), served("r9", 9, "item", "b", ["a"], True), "--log-impressions")
    assert len(read_impressions(str(log))) == len(before) + 1


def test_a_log_appended_to_since_it_was_added_is_refused_not_counted_twice(tmp_path):
    """`--log-impressions` appends to its file: given again with the statistics it was added
    to, its earlier rows would count twice (with --clicks too); a log of the new rows adds
    them once."""
    log, stats = tmp_path / "log.tsv", tmp_path / "s1.npz"
    log.write_text(HAND)
    assert run_cli(["memboost", "update", "--impressions", str(log), "--out",
                    str(stats)]).returncode == 0
    append_impressions(str(log), served("r9", 9, "user", "u1", ["c"], True), "--log-impressions")
    (tmp_path / "clicks.tsv").write_text("r9\tc\n")
    for clicks in ([], ["--clicks", str(tmp_path / "clicks.tsv")]):
        result = run_cli(["memboost", "update", "--impressions", str(log), "--stats", str(stats),
                          *clicks, "--out", str(tmp_path / "s2.npz")])
        assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
        assert result.stderr.startswith(f"error: memboost update: {log} begins with a log "
                                        f"already added to the statistics"), result.stderr
        assert not (tmp_path / "s2.npz").exists()
    (tmp_path / "new.tsv").write_text(HEADER + "\n" + "".join(lines(
        served("r9", 9, "user", "u1", ["c"], True))))
    result = run_cli(["memboost", "update", "--impressions", str(tmp_path / "new.tsv"),
                      "--stats", str(stats), "--out", str(tmp_path / "s2.npz")])
    assert result.returncode == 0, failure(result)
    assert load_stats(str(tmp_path / "s2.npz")).random_shown.sum() == 5


def test_memboost_features_gives_each_row_the_statistics_before_its_time(tmp_path):
    (tmp_path / "log.tsv").write_text(HAND)
    rows = tmp_path / "rows.tsv"
    rows.write_text("query_kind\tquery\titem\ttime\nuser\tu1\ta\t1\nuser\tu1\ta\t2.5\n"
                    "item\ta\tc\t4\nitem\ta\tc\t4.5\n")
    result = run_cli(["memboost", "features", "--impressions", str(tmp_path / "log.tsv"),
                      "--rows", str(rows), "--out", str(tmp_path / "f.tsv")])
    assert result.returncode == 0, failure(result)
    got = [line.split("\t")[4:] for line in (tmp_path / "f.tsv").read_text().splitlines()]
    assert got[0] == ["memboost_clicks", "memboost_expected", "memboost"]
    assert [float(v) for v in got[1]] == [0, 0, 0]  # nothing before time 1
    # before 2.5: r1, r2 (the curve 1, 0.5): C 2, E 1.5; before 4.5: (a, c) once at 1, C 2
    assert [float(v) for v in got[2]] == pytest.approx([np.log1p(2), np.log1p(1.5),
                                                        np.log(3 / 2.5)], abs=1e-5)
    assert [float(v) for v in got[3]] == [0, 0, 0]  # its own impression is at time 4
    assert [float(v) for v in got[4]] == pytest.approx([np.log1p(2), np.log1p(1),
                                                        np.log(3 / 2)], abs=1e-5)
    # a file saved on Windows with blank lines at its end: the same rows, nothing more
    rows.write_bytes(rows.read_bytes().replace(b"\n", b"\r\n") + b"\r\n\r\n")
    result = run_cli(["memboost", "features", "--impressions", str(tmp_path / "log.tsv"),
                      "--rows", str(rows), "--out", str(tmp_path / "crlf.tsv")])
    assert result.returncode == 0, failure(result)
    assert (tmp_path / "crlf.tsv").read_text() == (tmp_path / "f.tsv").read_text()
    rows.write_text("query_kind\tquery\titem\ttime\nuser\tu1\ta\tsoon\n")
    result = run_cli(["memboost", "features", "--impressions", str(tmp_path / "log.tsv"),
                      "--rows", str(rows), "--out", str(tmp_path / "g.tsv")])
    assert result.returncode == 2 and result.stderr == (
        f"error: --rows: {rows} row 2 column time: 'soon' is not a number\n")
    assert not (tmp_path / "g.tsv").exists()


BAD = [
    ("request\ttime\n", [], "--impressions: {log}: the first line is not the impression log's "
                            "header"),
    (HEAD := HAND.splitlines()[0] + "\n", ["r1\t1\tuser\tu1\ta\t0\t1\t1"],
     "--impressions: {log} row 2 column position: '0' is not a whole number 1 or more"),
    (HEAD, ["r1\t1\tuser\tu1\ta\t1\t1\t1", "r1\t1\tuser\tu1\tb\t1\t1\t0"],
     "--impressions: {log} row 3 column position: request 'r1' shows two items at position 1"),
    (HEAD, ["r1\t1\tuser\tu1\ta\t1\tyes\t1"],
     "--impressions: {log} row 2 column random: 'yes' is not 0 or 1"),
    (HEAD, ["r1\t1\tuser\tu1\ta\t1\t1\t-1"],
     "--impressions: {log} row 2 column clicked: '-1' is not a number 0 or more"),
    (HEAD, ["r1\t1\tpin\tu1\ta\t1\t1\t1"],
     "--impressions: {log} row 2 column query_kind: 'pin' is not one of user, item"),
    (HEAD, ["r1\t1\tuser\tu1\ta\t1\t1"], "--impressions: {log} row 2: 7 fields, the header has 8"),
    (HEAD, ["r1\t1\tuser\tu1\ta\t1\t1\t1", "r1\t2\tuser\tu1\tb\t2\t1\t0"],
     "--impressions: {log} row 3 column time: request 'r1' has another time"),
]


@pytest.mark.parametrize("head, rows, says", BAD, ids=[f"bad{n}" for n in range(len(BAD))])
def test_a_bad_impression_log_is_one_line_and_nothing_is_written(tmp_path, head, rows, says):
    log = tmp_path / "log.tsv"
    log.write_text(head + "".join(r + "\n" for r in rows))
    result = run_cli(["memboost", "update", "--impressions", str(log), "--out",
                      str(tmp_path / "s.npz")])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
    assert result.stderr.startswith("error: " + says.format(log=log)), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.tsv"]


@pytest.mark.parametrize("args, says", [
    (["--prior", "0"], "memboost update: --prior must be a number above 0"),
    (["--max-pairs", "0"], "memboost update: --max-pairs must be at least 1"),
    (["--out", "{log}"], "memboost update: --out {log} is --impressions {log}, an input"),
    (["--stats", "{log}"], "--stats: {log}: not Memboost statistics"),
    (["--stats", "{stats}", "--prior", "3"], "memboost update: --prior 3.0 differs from"),
    (["--stats", "{stats}"], "memboost update: this impression log was already added"),
    (["--clicks", "{clicks}"], "--clicks: {clicks} line 1: 'r9\\tz' is not `request<TAB>item`"),
])
def test_bad_settings_are_one_line_and_nothing_is_written(tmp_path, args, says):
    log, stats, clicks = tmp_path / "log.tsv", tmp_path / "s.npz", tmp_path / "clicks.tsv"
    log.write_text(HAND)
    clicks.write_text("r9\tz\n")
    assert run_cli(["memboost", "update", "--impressions", str(log), "--out",
                    str(stats)]).returncode == 0
    names = {"log": log, "stats": stats, "clicks": clicks}
    args = [a.format(**names) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    out = [] if "--out" in args else ["--out", str(tmp_path / "new.npz")]
    result = run_cli(["memboost", "update", "--impressions", str(log), *out, *args])
    assert result.returncode == 2 and result.stderr.count("\n") == 1, failure(result)
    assert result.stderr.startswith("error: " + says.format(**names)), result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_no_random_order_traffic_is_refused_in_one_line(tmp_path):
    (tmp_path / "log.tsv").write_text(HAND)
    log = read_impressions(str(tmp_path / "log.tsv"))
    stats = MemboostStats()
    stats.update(log.take(np.flatnonzero(~log.random)))
    with pytest.raises(UserError, match="no random-order impressions at position 1"):
        stats.boost()
    assert np.isfinite(stats.boost(corrected=False)).all()


def test_the_memboost_weight_is_the_smallest_within_one_standard_error_of_the_best():
    """recommend-tune's gamma (funnel_tuning.memboost_weight): 0 where Memboost's gain is a
    net two users of 900 (noise), the smallest gamma of a real gain, and with it the largest prior
    that keeps the gain."""
    from dlrm_hybrid.serve.funnel_tuning import memboost_weight

    rng = np.random.default_rng(0)
    plain = (rng.random(900) < 0.3).astype(float)
    noisy = plain.copy()
    noisy[np.flatnonzero(plain == 0)[:5]] = 1  # five users gained, three lost: noise
    noisy[np.flatnonzero(plain == 1)[:3]] = 0
    assert memboost_weight({(0.0, 0.0): plain, (1.0, 0.0): noisy, (2.0, 0.0): noisy}) == (0, 0)
    better = plain.copy()
    better[np.flatnonzero(plain == 0)[:60]] = 1
    found = {(0.0, 0.0): plain, (0.0, 1.0): plain, (0.5, 0.0): better, (0.5, 1.0): better,
             (0.5, float("inf")): plain, (2.0, 0.0): np.maximum(better, noisy)}
    assert memboost_weight(found) == (0.5, 1.0)
