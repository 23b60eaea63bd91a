"""The funnel's settings file (YAML): what `recommend-tune` chose on validation (the sources and
their merge weights, the candidate counts, the ranker and its value model, each stage's prior,
Memboost's weight and statistics),
written whole or not at all, and read by `recommend --settings`, each key checked."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Optional

import numpy as np
import yaml

from dlrm_hybrid.errors import UserError
from dlrm_hybrid.output_paths import temporary_beside

FORMAT = "dlrm_hybrid funnel settings 1"
# what the file sets, each also a `recommend` flag that overrides it
TUNED = ("sources", "per_source", "rank_top", "first_stage_keep", "fusion", "value",
         "rank_prior", "first_stage_prior", "memboost_weight")


def write_settings(target: Path, content: dict) -> None:
    """The file, whole or not at all (written beside it, then renamed)."""
    partial = temporary_beside(target)
    try:
        partial.write_text("# recommend-tune's choices on validation; `recommend --settings` "
                           "reads them\n" + yaml.safe_dump(content, sort_keys=False))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def read_settings(path: str) -> dict:
    """The file's `ranker`, `first_stage` and tuned settings (TUNED), each checked: a file
    that is not one, or a key of the wrong kind, is one line naming it."""
    def bad(what: str) -> UserError:
        return UserError(f"--settings: {path}: {what}; write it with `recommend-tune --out`")

    try:
        content = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"--settings: cannot read {path} ({e.strerror})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise bad(f"not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise bad(f"not a funnel settings file (no format: {FORMAT})")
    tuned = content.get("settings")
    if not isinstance(tuned, dict):
        raise bad("no settings mapping")
    unknown = sorted(set(tuned) - set(TUNED))
    if unknown:
        raise bad(f"settings.{unknown[0]} is not a setting (known: {', '.join(TUNED)})")
    out = {key: content.get(key) for key in ("ranker", "first_stage", "memboost", "retrieval")}
    for key in ("ranker", "first_stage", "memboost", "retrieval"):
        if out[key] is not None and not isinstance(out[key], str):
            raise bad(f"{key} is not a path")
    for key, value in tuned.items():
        out[key] = _checked(key, value, bad)
    return out


def _checked(key: str, value, bad):
    """One tuned setting, of the kind `recommend` takes."""
    if value is None and key in ("value", "first_stage_prior", "fusion"):
        return None
    if key == "sources":
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise bad(f"settings.sources is not a list of sources ({value!r})")
        return ",".join(value)
    if key in ("per_source", "rank_top", "first_stage_keep"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(f"settings.{key} is not a whole number ({value!r})")
        return value
    if key in ("fusion", "value"):
        if not isinstance(value, dict) or not all(
                isinstance(n, str) and _number(w) for n, w in value.items()):
            raise bad(f"settings.{key} is not a mapping of names to numbers ({value!r})")
        return {n: float(w) for n, w in value.items()}
    if not _number(value) or not float(value) >= 0:
        raise bad(f"settings.{key} is not a number 0 or more ({value!r})")
    return float(value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        not np.isnan(value)


def same_path(a: Optional[str], b: Optional[str]) -> bool:
    return (a is None) == (b is None) and (a is None or Path(a).resolve() == Path(b).resolve())


def tuned_inputs(args: argparse.Namespace, tuned: dict) -> None:
    """`recommend`'s --ranker and --first-stage from the settings file where not given; the
    file's weights, priors and value model belong to its ranker, first stage and retrieval
    model, so others are refused in one line (a file without `retrieval`: any)."""
    if tuned.get("retrieval") and not same_path(args.retrieval, tuned["retrieval"]):
        raise UserError(f"--retrieval: {args.retrieval} is not what --settings {args.settings} "
                        f"was tuned with ({tuned['retrieval']}); give that one, or tune again "
                        f"with recommend-tune")
    for key, flag in (("ranker", "--ranker"), ("first_stage", "--first-stage")):
        given = getattr(args, key)
        if given is None:
            if tuned[key] and not Path(tuned[key]).exists():
                raise UserError(f"--settings: {args.settings}: its {key.replace('_', ' ')} "
                                f"{tuned[key]} does not exist; give {flag}, or tune again")
            setattr(args, key, tuned[key])
        elif not same_path(given, tuned[key]):
            raise UserError(f"{flag}: {given} is not what --settings {args.settings} was tuned "
                            f"with ({tuned[key] or 'none'}); leave {flag} out, or tune again "
                            f"with recommend-tune")
    if args.ranker is None:
        raise UserError(f"--settings: {args.settings} names no ranker; give --ranker")
    if getattr(args, "memboost", None) is None:  # newer statistics may replace the tuned ones
        args.memboost = tuned.get("memboost")
