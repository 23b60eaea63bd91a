"""`memboost update` (impression logs into Memboost statistics, earlier statistics updated
without their logs), `memboost show` (the position curve, a query's pairs) and `memboost
features` (a ranker's rows given the statistics of the impressions before each)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import (refuse_overwriting_inputs, require_file_target,
                                      temporary_beside)
from dlrm_hybrid.serve.impressions import QUERY_KINDS, apply_clicks, concat, read_impressions
from dlrm_hybrid.serve.memboost import (MemboostSettings, MemboostStats, begins_with_added,
                                        digest_of, load_stats, save_stats)
from dlrm_hybrid.serve.memboost_features import FEATURES, features_before

ROW_COLUMNS = ("query_kind", "query", "item", "time")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True)
    update = actions.add_parser("update", help="add impression logs to Memboost statistics")
    update.add_argument("--impressions", required=True, action="append", metavar="LOG",
                        help="an impression log (docs/memboost.md; repeat for several)")
    update.add_argument("--clicks", metavar="FILE", help="engagements to join to the (one) log: "
                        "lines `request<TAB>item`, one per engagement")
    update.add_argument("--stats", metavar="STATS", help="earlier statistics to update (default: "
                        "start from none)")
    update.add_argument("--out", required=True, metavar="NEW", help="the statistics to write "
                        "(.npz); never one of the inputs")
    update.add_argument("--prior", type=float, help="alpha of MB = log((C + alpha) / (E + "
                        "alpha)), in engagements (default 1; with --stats: theirs)")
    update.add_argument("--max-pairs", type=int, help="pairs kept per query, those with the "
                        "most impressions (default 1000; with --stats: theirs)")
    features = actions.add_parser("features", help="Memboost's features of a ranker's rows, "
                                  "each from the impressions before its time")
    features.add_argument("--impressions", required=True, action="append", metavar="LOG",
                          help="impression logs (repeat for several)")
    features.add_argument("--rows", required=True, metavar="FILE", help="tab-separated, header "
                          "`query_kind query item time`: the ranker's rows")
    features.add_argument("--out", required=True, metavar="FILE", help="the rows with "
                          f"{', '.join(FEATURES)} after them (tab-separated)")
    features.add_argument("--prior", type=float, default=1.0, help="alpha (default 1)")
    show = actions.add_parser("show", help="the position curve and the top pairs of a query")
    show.add_argument("--stats", required=True, help="statistics `memboost update` wrote")
    show.add_argument("--query", metavar="KIND:ID", help="a query's pairs by MB, e.g. user:196")
    show.add_argument("--k", type=int, default=10, help="pairs and positions shown (default 10)")


def run(args: argparse.Namespace) -> None:
    return {"update": run_update, "show": run_show, "features": run_features}[args.action](args)


def run_update(args: argparse.Namespace) -> None:
    refuse_overwriting_inputs([("--out", args.out)], [
        ("--stats", args.stats), ("--clicks", args.clicks),
        *(("--impressions", log) for log in args.impressions)], "memboost update")
    require_file_target("--out", args.out)
    if args.clicks and len(args.impressions) > 1:
        raise UserError("memboost update: --clicks joins one log; give one --impressions with it")
    if args.stats:
        stats = load_stats(args.stats)
        for flag, given, kept in (("--prior", args.prior, stats.settings.prior),
                                  ("--max-pairs", args.max_pairs, stats.settings.max_pairs)):
            if given is not None and given != kept:
                raise UserError(f"memboost update: {flag} {given} differs from --stats "
                                f"{args.stats}'s {kept}; leave {flag} out, or start new "
                                f"statistics without --stats")
    else:
        plain = MemboostSettings()
        settings = MemboostSettings(plain.prior if args.prior is None else args.prior,
                                    plain.max_pairs if args.max_pairs is None else args.max_pairs)
        settings.check("memboost update")
        stats = MemboostStats(settings)
    rows = 0
    for path in args.impressions:
        log = read_impressions(path)
        digest, size = digest_of(path), os.path.getsize(path)
        if digest not in stats.logs and begins_with_added(stats, path):  # the same: update's
            raise UserError(f"memboost update: {path} begins with a log already added to the "
                            f"statistics (appended to since: its earlier rows would count "
                            f"twice); give a log of the new impressions only")
        if args.clicks:
            log = apply_clicks(log, args.clicks)
            digest += "+" + digest_of(args.clicks)
        stats.update(log, digest, size)
        rows += len(log)
    save_stats(stats, args.out)
    random = int(stats.random_shown.sum())
    print(f"memboost: wrote {args.out} rows_added={rows} pairs={len(stats.keys)} "
          f"logs={len(stats.logs)} random_impressions={random} prior={stats.settings.prior:g} "
          f"max_pairs={stats.settings.max_pairs}")


def run_features(args: argparse.Namespace) -> None:
    refuse_overwriting_inputs([("--out", args.out)], [
        ("--rows", args.rows), *(("--impressions", log) for log in args.impressions)],
        "memboost features")
    require_file_target("--out", args.out)
    log = concat([read_impressions(path) for path in args.impressions])
    kinds, queries, items, times, lines = _rows(args.rows)
    found = features_before(log, kinds, queries, items, times, args.prior)
    target = Path(args.out)
    partial = temporary_beside(target)
    try:
        partial.write_text("\t".join((*ROW_COLUMNS, *FEATURES)) + "\n" + "".join(
            f"{line}\t" + "\t".join(f"{v:.6g}" for v in row) + "\n"
            for line, row in zip(lines, found.tolist())), encoding="utf-8")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    print(f"memboost: wrote {args.out} rows={len(lines)} impressions={len(log)} "
          f"rows_with_history={int((found[:, 1] > 0).sum())}")


def _rows(path: str):
    """The --rows file's columns (kind indices, queries, items, times) and its lines."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--rows: cannot read {path} ({getattr(e, 'strerror', None) or e})"
                        ) from None
    lines = text.splitlines()
    if not lines or lines[0].strip().split("\t") != list(ROW_COLUMNS):
        raise UserError(f"--rows: {path}: the first line is not the header "
                        f"{' '.join(ROW_COLUMNS)} (tab-separated)")
    kinds, queries, items, times, kept = [], [], [], [], []
    for n, line in enumerate(lines[1:]):
        if not line.strip():  # a blank line (one at the end, say) is no row
            continue
        kept.append(line)
        fields = line.split("\t")
        if len(fields) != len(ROW_COLUMNS):
            raise UserError(f"--rows: {path} row {n + 2}: {len(fields)} fields, the header has "
                            f"{len(ROW_COLUMNS)}")
        if fields[0] not in QUERY_KINDS:
            raise UserError(f"--rows: {path} row {n + 2} column query_kind: {fields[0]!r} is not "
                            f"one of {', '.join(QUERY_KINDS)}")
        try:
            times.append(float(fields[3]))
        except ValueError:
            times.append(float("nan"))
        if not np.isfinite(times[-1]):
            raise UserError(f"--rows: {path} row {n + 2} column time: {fields[3]!r} is not a "
                            f"number")
        kinds.append(QUERY_KINDS.index(fields[0]))
        queries.append(fields[1])
        items.append(fields[2])
    return (np.array(kinds, np.int8), np.array(queries, dtype=str), np.array(items, dtype=str),
            np.array(times), kept)


def run_show(args: argparse.Namespace) -> None:
    stats = load_stats(args.stats)
    if args.k < 1:
        raise UserError(f"memboost show: --k must be at least 1, got {args.k}")
    if stats.random_shown[0]:
        curve = stats.relative_curve(args.k)
        print("position\trandom_impressions\tctr\trelative")
        for p in range(len(curve)):
            print(f"{p + 1}\t{int(stats.random_shown[p])}\t{stats.curve()[p]:.5f}\t{curve[p]:.4f}")
    else:
        print("memboost: no random-order traffic yet: no position curve")
    if args.query:
        kind, _, query = args.query.partition(":")
        if kind not in QUERY_KINDS or not query:
            raise UserError(f"--query: {args.query!r}; write KIND:ID with KIND one of "
                            f"{', '.join(QUERY_KINDS)}, e.g. user:196")
        kinds, queries, items = stats.pairs()
        rows = np.flatnonzero((kinds == kind) & (queries == query))
        if not len(rows):
            print(f"memboost: no pairs of {args.query}")
        else:
            mb, expected = stats.boost()[rows], stats.expected()[rows]
            print("item\tclicks\texpected\timpressions\tmb")
            for r in rows[np.argsort(-mb, kind="stable")][:args.k]:
                n = int(np.searchsorted(rows, r))
                print(f"{items[r]}\t{stats.clicks[r]:g}\t{expected[n]:.3f}\t"
                      f"{int(stats.shown[r].sum())}\t{mb[n]:.4f}")
    print(f"memboost: {Path(args.stats).name} pairs={len(stats.keys)} logs={len(stats.logs)} "
          f"impressions={int(stats.all_shown)} random_impressions={int(stats.random_shown.sum())}")
