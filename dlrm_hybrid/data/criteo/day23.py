"""Day 23 of Criteo 1TB: which half is validation, as recorded in a dataset, and
`preprocess day23`, which brings a dataset split by the earlier rule up to date in place.

The rule (the MLPerf DLRM-DCNv2 reference's `data/multi_hot_criteo.py` and torchrec's
`datasets/criteo.py`: `second_half_start_index = N // 2 + N % 2`): day 23's first ceil(N/2)
rows are validation, the set the target AUC is measured on, the rest test. Datasets record it
in feature_spec.yaml as `metadata.day_23: validation_first` (`none`: not split by days).

Earlier versions sent the first floor(N/2) rows to test and the rest to validation, recording
nothing: their `preprocess criteo|npy` output is known by its preprocess_report.json (`"split":
"days"`), and `preprocess multihot`'s by having a validation split, no report and no planted
probabilities. With N = 178,274,637 both rules give validation 89,137,319 rows and test
89,137,318, so no count tells them apart. The upgrade writes the new halves (hard links where a half is unchanged,
copies otherwise) into DIR/.day23.partial-HOST-PID, renames that to DIR/.day23.ready once whole,
then swaps the split folders and records the rule; running it again finishes an upgrade that
was interrupted after the rename (readers refuse the dataset until then).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dlrm_hybrid.data.feature_spec import FeatureSpec, load_feature_spec
from dlrm_hybrid.data.split_binary_writer import REPORT, partial_name, remove_stale_partials
from dlrm_hybrid.errors import DataError

RULE_KEY = "day_23"
VALIDATION_FIRST, TEST_FIRST, NOT_DAYS, UNRECORDED = ("validation_first", "test_first", "none",
                                                      "unrecorded")
HALVES = ("validation", "test")
READY = ".day23.ready"
BLOCK = 16 << 20


def validation_rows(day_rows: int) -> int:
    """How many of day 23's rows, from its first, are validation: ceil(N/2)."""
    return day_rows // 2 + day_rows % 2


def upgrade_command(dataset) -> str:
    return f"python -m dlrm_hybrid preprocess day23 --dataset {dataset}"


def recorded_rule(root: Path, fspec: Optional[FeatureSpec] = None) -> str:
    """The dataset's day-23 rule: recorded, or known from what an earlier version wrote."""
    fspec = fspec or load_feature_spec(str(root))
    if RULE_KEY in fspec.notes:
        return str(fspec.notes[RULE_KEY])
    if (root / REPORT).exists():
        split = json.loads((root / REPORT).read_text()).get("split")
        return TEST_FIRST if split == "days" else NOT_DAYS
    if fspec.true_prob or "validation" not in fspec.splits:
        return NOT_DAYS  # planted synthetic data; NVIDIA's layout (train and test)
    return UNRECORDED  # an earlier `preprocess multihot` copied its input's halves, unrecorded


def require_reference_rule(data_path: str) -> None:
    """MLPerf mode: refuse a dataset whose validation split is not the reference's half."""
    rule = recorded_rule(Path(data_path))
    if rule == TEST_FIRST:
        raise DataError(f"{data_path}: day 23 was split by an earlier rule (first half test, not "
                        f"validation as in the MLPerf reference); exchange the halves in place "
                        f"with `{upgrade_command(data_path)}` (no new preprocessing)")
    if rule == UNRECORDED:
        raise DataError(f"{data_path}: how day 23 was split is not recorded (an earlier "
                        f"`preprocess multihot` wrote it); run `{upgrade_command(data_path)} "
                        f"--source ONE_HOT_DIR` with the dataset it was made from")


def require_no_interrupted_upgrade(path: str) -> None:
    if (Path(path) / READY).exists():
        raise DataError(f"{path}: an upgrade of its day-23 split was interrupted; run "
                        f"`{upgrade_command(path)}` again to finish it")


# ---- the upgrade ------------------------------------------------------------------------------

def upgrade_day_23(dataset: str, source: Optional[str] = None) -> Dict[str, object]:
    """Bring `dataset` to the reference's rule in place; rows out = rows in. Returns
    {"rule": the rule it had, "validation": rows, "test": rows}."""
    root = Path(dataset)
    fspec = load_feature_spec(dataset, "--dataset")
    if (root / READY).exists():
        return _commit(root, fspec, TEST_FIRST)
    rule = recorded_rule(root, fspec)
    if rule == UNRECORDED:
        if source is None:
            raise DataError(f"--dataset: {dataset} records no day-23 rule (an earlier `preprocess "
                            f"multihot` wrote it); add --source ONE_HOT_DIR, the dataset it was "
                            f"made from")
        rule = rule_from_source(fspec, Path(source))
    if rule == VALIDATION_FIRST:
        return {"rule": rule, **_rows(fspec)}
    if rule != TEST_FIRST:
        raise DataError(f"--dataset: {dataset} is not split by days (day_23: {rule}); there are "
                        f"no day-23 halves to exchange")
    _check_layout(root, fspec)
    rows = _rows(fspec)
    n, moved = rows["test"] + rows["validation"], (rows["test"] + rows["validation"]) % 2
    if rows["test"] != n // 2:
        raise DataError(f"--dataset: {dataset} has {rows['test']} test and {rows['validation']} "
                        f"validation rows, not the earlier rule's floor(N/2) test rows; left as "
                        f"it is")
    plan = {"validation": [("test", 0, rows["test"]), ("validation", 0, moved)],
            "test": [("validation", moved, rows["validation"] - moved)]}
    remove_stale_partials(root / "day23")
    tmp = root / partial_name("day23")
    try:
        for half, pieces in plan.items():
            _write_half(fspec, tmp / half, [p for p in pieces if p[2]])
        tmp.rename(root / READY)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _commit(root, fspec, TEST_FIRST)


def rule_from_source(fspec: FeatureSpec, source: Path) -> str:
    """The rule of a dataset made from `source` (which records one): day 23's labels and dense
    values, read in the rule's order, are the source's."""
    source_rule = recorded_rule(source, load_feature_spec(str(source), "--source"))
    if source_rule not in (VALIDATION_FIRST, TEST_FIRST):
        raise DataError(f"--source: {source} records no day-23 rule either (day_23: "
                        f"{source_rule}); give the one-hot dataset `preprocess criteo|npy "
                        f"--split days` wrote")
    want = _day_digest(load_feature_spec(str(source)), source_rule)
    for rule in (TEST_FIRST, VALIDATION_FIRST):
        if _day_digest(fspec, rule) == want:
            return rule
    raise DataError(f"--source: {fspec.root}'s validation and test rows are not {source}'s day "
                    f"23 in either order; give the dataset it was made from")


def _day_digest(fspec: FeatureSpec, rule: str) -> str:
    """sha256 of day 23's labels, then its dense values, in day order under `rule`."""
    order = ("test", "validation") if rule == TEST_FIRST else HALVES
    digest = hashlib.sha256()
    for column in ("label", "numerical"):
        for path in [getattr(fspec.splits[split], column) for split in order]:
            with open(path, "rb") as f:
                while block := f.read(BLOCK):
                    digest.update(block)
    return digest.hexdigest()


def _columns(fspec: FeatureSpec, split: str) -> List[Tuple[Path, int]]:
    """(file, bytes per row) of each column of `split`."""
    files, spec = fspec.splits[split], fspec.spec
    cats = [h * d.itemsize for h, d in zip(spec.hotness, fspec.categorical_dtypes)]
    return list(zip([files.label, files.numerical, *files.categorical],
                    [1, 2 * spec.num_dense, *cats]))


def _rows(fspec: FeatureSpec) -> Dict[str, int]:
    return {s: fspec.splits[s].label.stat().st_size for s in HALVES}


def _check_layout(root: Path, fspec: FeatureSpec) -> None:
    """Only folders laid out as `preprocess` writes them: every file in DIR/<split>/."""
    for split in HALVES:
        outside = [p for p, _ in _columns(fspec, split) if p.parent != root / split]
        if outside or split in fspec.true_prob:
            raise DataError(f"--dataset: {root}'s {split} files are not laid out as preprocess "
                            f"writes them (DIR/{split}/...); left as it is")


def _write_half(fspec: FeatureSpec, out: Path, pieces: List[Tuple[str, int, int]]) -> None:
    """Folder `out` with the rows (split, first, count) of each piece in turn, every column."""
    out.mkdir(parents=True)
    columns = {split: _columns(fspec, split) for split, _, _ in pieces}
    for column, (name, _) in enumerate(columns[pieces[0][0]]):
        target = out / name.name
        if len(pieces) == 1 and pieces[0][1] == 0:  # a whole old split, unchanged
            try:
                os.link(name, target)
                continue
            except OSError:
                pass  # storage without hard links: copy it
        with open(target, "wb") as g:
            for split, first, count in pieces:
                path, width = columns[split][column]
                with open(path, "rb") as f:
                    f.seek(first * width)
                    left = count * width
                    while block := f.read(min(BLOCK, left)):
                        g.write(block)
                        left -= len(block)
                if left:
                    raise DataError(f"{path}: ends before row {first + count}; the dataset is "
                                    f"truncated")


def _commit(root: Path, fspec: FeatureSpec, old_rule: str) -> Dict[str, object]:
    """Swap in the halves of DIR/.day23.ready and record the rule; each step can be redone."""
    ready = root / READY
    for half in HALVES:
        if (ready / half).exists():
            if (root / half).exists():
                (root / half).rename(ready / f"old-{half}")
            (ready / half).rename(root / half)
    rows = _rows(fspec)
    if (root / REPORT).exists():
        report = json.loads((root / REPORT).read_text())
        report["rows_written"].update(rows)
        report[RULE_KEY] = VALIDATION_FIRST
        (root / f".{REPORT}.tmp").write_text(json.dumps(report, indent=2) + "\n")
        (root / f".{REPORT}.tmp").replace(root / REPORT)
    fspec.notes[RULE_KEY] = VALIDATION_FIRST
    fspec.save()
    shutil.rmtree(ready)
    return {"rule": old_rule, **rows}


# ---- command line -------------------------------------------------------------------------

def add_arguments(parser) -> None:
    parser.add_argument("--dataset", required=True, metavar="DIR",
                        help="a dataset whose day 23 was split by the earlier rule (first half "
                             "test); changed in place")
    parser.add_argument("--source", metavar="DIR",
                        help="for a multi-hot dataset that records no rule: the one-hot dataset "
                             "it was made from")


def run(args) -> None:
    result = upgrade_day_23(args.dataset, args.source)
    rows = f"validation={result['validation']} test={result['test']}"
    if result["rule"] == VALIDATION_FIRST:
        print(f"{args.dataset}: day 23 already split as the MLPerf reference does; nothing to do "
              f"({rows})")
    else:
        print(f"{args.dataset}: day 23's first ceil(N/2) rows are now validation, the rest test, "
              f"as the MLPerf reference splits it ({rows})")
