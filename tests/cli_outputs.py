"""Every CLI command's output on small demo inputs, recorded so that two checkouts can be compared
(issue 43: a pure refactor leaves every command's output on the demo byte-identical).

    .venv/bin/python tests/cli_outputs.py OUTDIR             # run every step, record into OUTDIR
    .venv/bin/python tests/cli_outputs.py OUTDIR --only eval_demo_test  # + the steps it needs
    .venv/bin/python tests/cli_outputs.py --diff DIR_A DIR_B # unified diff; exit 1 if any differ
    .venv/bin/python tests/cli_outputs.py --list             # the steps and the masks

Each step is one `python -m dlrm_hybrid ...` (one 2-rank `python -m dlrm_hybrid.torchrun ...`
train, as `make demo` runs it), run with this script's checkout first on PYTHONPATH, in a fresh
temporary folder (paths on the command lines are relative to it), one thread per process,
CUDA hidden, fixed seeds, PYTHONHASHSEED=0. The inputs (Criteo TSV days, torchrec npy days, an
interaction log, CSV rows, user lists, an old-rule day-23 dataset) are written by this script,
the same every time. OUTDIR/<nn>_<name>.txt holds a step's command line, exit code, stdout,
stderr, and every file it wrote, changed or removed: path, and for text files (.json, .yaml,
.txt, ...) the line count, the sha256 and the text itself; for binary files the size and
sha256; for zip archives (TorchScript, torch.save) each member's. OUTDIR/00_index.txt lists the
steps and the masks. Not collected by pytest (not test_*.py). About 4.5 CPU-minutes: 9 minutes
on 2 cores shared with other jobs, 25-30 minutes for each of two records made at once.

What differs between two runs of the same checkout is masked, in stdout, stderr, file names and
file contents alike (MASKS, BENCH_MASKS, BYTE_MASKS below, each with its reason): wall-clock
measurements, measured memory peaks, random ids, dates, pids, host names, and the paths of the
temporary folder and of the checkout. A loss, AUC, score, count or modeled figure is never
masked. A hash of masked content says "sha256 masked".
"""

from __future__ import annotations

import argparse
import difflib
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900
TEXT_LIMIT = 256 * 1024  # text files larger than this are recorded by hash alone
SHOWN_LINES = 400  # lines of a text file shown in the record (the hash covers all of it)

# ---- masks ------------------------------------------------------------------------------------
# A mask is (regex, replacement: a string or a function of the match, why). Text masks apply to
# stdout, stderr, file names and text files; byte masks to binary files (and zip members) before
# they are hashed. Only what differs between two runs of the same checkout is masked: wall-clock
# measurements, measured memory peaks, random ids, dates, pids, and the two folders' paths.

Mask = Tuple[str, object, str]
NUM = r"-?[0-9][0-9,]*(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|nan|inf"
# Keys whose values are wall-clock measurements (or ratios of them), or measured memory peaks,
# wherever they appear: key=value (progress, done and bench lines), "key": value (metrics.jsonl,
# rank logs, reports), key: value (graph.yaml).
TIMING_KEYS = ("time", "elapsed_s", "eval_s", "time_to_target_s", "seconds", r"\w+_seconds",
               r"ms_\w+", "samples_per_s", r"\w+_samples_per_s", "rows_per_s", "mib_per_s",
               "ratio", "torchrec_ratio", "roofline_fraction",
               "peak_rss_mib", "peak_rss_bytes", "peak_mem_gib")
_KEYS = "|".join(TIMING_KEYS)
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def _numbers_masked(match: re.Match) -> str:
    return re.sub(rf"(: )({NUM})", r"\1<T>", match.group(0))


MASKS: List[Mask] = [
    (rf"\b({_KEYS})=({NUM})", r"\1=<T>", "key=value timings: samples_per_s=, elapsed_s=, ms_*="),
    (rf"\"({_KEYS})\": ({NUM}|null)", r'"\1": <T>', '"key": value timings in JSON'),
    (rf"(?m)^(\s*)({_KEYS}): ({NUM})$", r"\1\2: <T>", "key: value timings in YAML"),
    (r'"ms": \{[^{}]*\}', _numbers_masked, 'recommend --json: its stages\' "ms": {...}'),
    (rf"\b({NUM}) (samples/s|rows/s|MB/s)", r"<T> \2", "measured rates: 24,965 rows/s"),
    (rf"\bin ({NUM}) s\b", "in <T> s", "measured durations: wrote DIR ... in 0.1 s"),
    (r"(?m)^pass (\d+)/(\d+) \(.*\n(?=pass \1/\2 \()", "",
     "preprocess criteo: a pass's progress lines every 10 s but its last (how many: timing)"),
    (r"(?m)^(\w+): [\d,]+ rows, [^\n]*\n(?=\1: [\d,]+ rows, )", "",
     "preprocess npy: its progress lines every 10 s but the last"),
    (r"\bETA \d+:\d\d:\d\d", "ETA <T>", "preprocess criteo: the progress lines' time left"),
    (r"\(([\d,]+) bytes, TorchScript;", "(<SIZE> bytes, TorchScript;",
     "export: the file's size, which varies with the checkout's path (its debug info names the "
     "source files; 64-byte aligned members) and is compared member by member below"),
    (r'"run": "[0-9a-f]+"', '"run": "<RUN>"', "a checkpoint's random run id (meta.json)"),
    (r'"\.metadata": "[0-9a-f]{64}"', '".metadata": "<SHA256>"',
     "meta.json's sha256 of the checkpoint's .metadata, which holds torch's random save_id"),
    (r"\b\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:\.\d+)?", "<DATE>", "dates and times of day"),
    (r"(USDT:<DATE>) \d+:\d+", r"\1 <PID>:<TID>", "the profiler's pid:tid (bench)"),
    (r"events\.out\.tfevents\.\d+(?:\.\d+)?\.[^/\s]+?\.\d+\.(\d+)",
     r"events.out.tfevents.<T>.<HOST>.<PID>.\1", "TensorBoard event file names: time, host, pid"),
    (r"\.partial-[\w.-]*?\d+\b", ".partial-<PID>", "hidden temporaries named by host and pid"),
]
# bench's report is measurements through and through: only its step gets these
BENCH_UNITS = r"ms/step|ms|GB/s|GFLOP/s|GiB|x|%"
BENCH_MASKS: List[Mask] = [
    (rf"\b({NUM}) ({BENCH_UNITS})(?=[\s,;)]|$)", r"<T> \2",
     "bench: measured rates, times, memory with their unit: 8.2 ms/step, 16.8 GB/s"),
    (rf"\bours ({NUM})x", "ours <T>x", "bench: our speed over a peer's"),
    (rf"\b(embedding_fwd|embedding_bwd|exchange|dense|optimizer) ({NUM}) \(\d+%\)",
     r"\1 <T> (<T>%)", "bench: the step split's milliseconds and shares"),
    (rf"\(loader, outside the step\) ({NUM})", "(loader, outside the step) <T>",
     "bench: the loader's milliseconds"),
    (rf"achieved ({NUM}) of it", "achieved <T> of it", "bench: measured rate over the roofline"),
    (r"samples/s \((compute|memory)\)", "samples/s (<compute|memory>)",
     "bench: which roofline bound is lower (from the measured bandwidth and FLOP/s)"),
    (r"measured \d+x\d+ float32 matmul", "measured <N>x<N> float32 matmul",
     "bench: its matmul grows while one run stays under 0.25 s"),
]
BYTE_MASKS: List[Tuple[bytes, bytes, str]] = [
    (UUID.encode(), b"<UUID>", "random UUIDs: torch checkpoint save_id, fbgemm table uuid"),
]
# zip members (TorchScript, torch.save files) holding a random id: replaced before hashing
RANDOM_MEMBERS = [(r"(^|/)\.data/serialization_id$", "torch's random serialization_id")]
# Binary files with wall-clock times inside: recorded by path and size only.
UNCOMPARED = [(r"(^|/)events\.out\.tfevents\.", "TensorBoard event files: wall time per record")]


def path_masks(work: Path) -> List[Mask]:
    """The run's temporary folder and this checkout, however spelled; first, before the rest."""
    masks = []
    for folder, name, why in ((work, "<WORK>", "the temporary folder the commands run in"),
                              (ROOT, "<ROOT>", "the checkout this script is in")):
        for spelling in sorted({str(folder), str(folder.resolve())}, key=len, reverse=True):
            masks.append((re.escape(spelling), name, why))
    return masks


def apply_masks(text: str, masks: List[Mask]) -> str:
    for pattern, replacement, _ in masks:
        text = re.sub(pattern, replacement, text)
    return text


def mask_bytes(data: bytes, masks: List[Mask]) -> Tuple[bytes, bool]:
    """`data` with BYTE_MASKS and the folders' paths replaced, and whether anything was. A path
    that begins a pickled string (TorchScript's .debug_pkl: the source file of each scripted
    function) takes the string's length bytes with it, which change with the path's length."""
    before = data
    for pattern, replacement, _ in BYTE_MASKS:
        data = re.sub(pattern, replacement, data)
    for pattern, replacement, _ in masks:
        if replacement in ("<WORK>", "<ROOT>"):
            data = re.sub(rb"X[\x00-\xff]{4}" + pattern.encode(), b"X<LEN>" + replacement.encode(),
                          data, flags=re.DOTALL)
            data = re.sub(pattern.encode(), replacement.encode(), data)
    return data, data != before


# ---- inputs the script writes -----------------------------------------------------------------


def criteo_rows(n: int, seed: int, bad: int = 0) -> List[str]:
    """Criteo TSV lines (label, 13 integers, 26 8-hex categoricals), some fields empty, skewed
    categories; `bad` malformed lines mixed in."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        label = str(int(rng.random() < 0.3))
        ints = ["" if rng.random() < 0.15 else str(rng.randint(-2, 300)) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else
                f"{(int(rng.paretovariate(1.2)) * 2654435761 + j * 7919) % 2**32:08x}"
                for j in range(26)]
        lines.append("\t".join([label, *ints, *cats]) + "\n")
    fields = lines[0].rstrip("\n").split("\t")
    broken = ["\t".join(["2", *fields[1:]]) + "\n",  # a bad label
              "\t".join(fields[:-1]) + "\n"]  # a field short
    for k in range(bad):
        lines.insert(rng.randrange(len(lines)), broken[k % 2])
    return lines


def write_gz(path: Path, text: str) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
        f.write(text.encode())


def write_criteo_inputs(work: Path) -> None:
    folder = work / "criteo"
    folder.mkdir()
    (folder / "day_0").write_text("".join(criteo_rows(600, 0, bad=2)))
    write_gz(folder / "day_23.gz", "".join(criteo_rows(120, 1)))
    (folder / "train.txt").write_text("".join(criteo_rows(800, 2)))
    (folder / "day_24.tsv").write_text("".join(criteo_rows(40, 3)))  # predict --raw-criteo


def write_npy_days(work: Path) -> None:
    import numpy as np

    folder = work / "npy"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for day, n in ((0, 300), (1, 200), (23, 120)):
        np.save(folder / f"day_{day}_dense.npy", rng.integers(0, 50, (n, 13)).astype(np.float32))
        np.save(folder / f"day_{day}_sparse.npy", rng.integers(0, 40, (n, 26)).astype(np.int32))
        np.save(folder / f"day_{day}_labels.npy", rng.integers(0, 2, n).astype(np.int32))


def write_interaction_log(work: Path) -> None:
    """(user, item, rating, timestamp, category) rows: users in 4 clusters, each engaging with
    items of its cluster with ratings 1-5 (as tests/test_recommend.py plants them)."""
    rng = random.Random(0)
    users, items, clusters = 240, 120, 4
    per = items // clusters
    rows = []
    for u in range(users):
        base = (u % clusters) * per
        picks = rng.sample(range(per), 12)
        for n, k in enumerate(picks):
            rating = 5 if k < 3 else 1 if k < 6 else rng.choice((2, 3, 4))
            rows.append(f"u{u},i{base + k},{rating},{len(rows) + n},c{k % 3}\n")
    (work / "log.csv").write_text("".join(rows))
    (work / "users.txt").write_text("u0\nu1\nu7\nu42\n")
    (work / "blocklist.txt").write_text("i1\ni2\nnot_an_item\n")


def write_predict_csv(work: Path) -> None:
    """Preprocessed rows of the demo model's features: label, 13 dense, 8 categorical (the third
    and fifth multi-hot: 3 and 2 ids separated by spaces)."""
    rng = random.Random(5)
    cards, hot = [1000, 500, 250, 100, 50, 20, 10, 5], [1, 1, 3, 1, 2, 1, 1, 1]
    lines = []
    for _ in range(64):
        dense = [f"{rng.uniform(-1, 3):.4f}" for _ in range(13)]
        cats = [" ".join(str(rng.randrange(c)) for _ in range(h)) for c, h in zip(cards, hot)]
        lines.append(",".join([str(rng.randint(0, 1)), *dense, *cats]) + "\n")
    (work / "rows.csv").write_text("".join(lines))


def make_old_rule_copy(work: Path) -> None:
    """data/npy as an earlier version wrote it: day 23's first half test (120 rows: halves of
    60 both ways, so swapping the two folders is the old layout) and no rule recorded."""
    import yaml

    src, dst = work / "data/npy", work / "data/npy_old_rule"
    shutil.copytree(src, dst)
    (dst / "validation").rename(dst / "swap")
    (dst / "test").rename(dst / "validation")
    (dst / "swap").rename(dst / "test")
    spec_path = dst / "feature_spec.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    spec.get("metadata", {}).pop("day_23", None)
    if not spec.get("metadata"):
        spec.pop("metadata", None)
    spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    report_path = dst / "preprocess_report.json"
    report = json.loads(report_path.read_text())
    report.pop("day_23", None)
    report["split"] = "days"
    report_path.write_text(json.dumps(report, indent=2) + "\n")


def make_plot_runs(work: Path) -> None:
    """Copies of two runs' metrics.jsonl for `plot`, their wall-clock fields replaced by values
    made from the step (the curves against time are then the same every run); the second cut
    short in its last line, as a killed run leaves it."""
    for name, source, cut in (("a", "runs/demo", False), ("b", "runs/mt_synth", True)):
        lines = []
        for line in (work / source / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "time" in record:
                record["time"] = 1.7e9 + record["step"] + 0.5 * ("val_auc" in record)
            if "elapsed_s" in record:
                record["elapsed_s"] = 0.01 * record["step"] + 0.005 * ("val_auc" in record)
            for key in ("samples_per_s", "eval_s"):
                if key in record:
                    record[key] = 1000.0
            lines.append(json.dumps(record))
        text = "\n".join(lines) + "\n"
        if cut:
            text = text + lines[-1][: len(lines[-1]) // 2]
        (work / "plot_runs" / name).mkdir(parents=True)
        (work / "plot_runs" / name / "metrics.jsonl").write_text(text)


# ---- the steps --------------------------------------------------------------------------------

OUTPUT_FOLDERS = ("served", "pred", "graphs", "plots")
CLI = ["-m", "dlrm_hybrid"]
TORCHRUN2 = ["-m", "dlrm_hybrid.torchrun", "--standalone", "--nproc_per_node=2", "-m",
             "dlrm_hybrid"]


def sets(*overrides: str) -> List[str]:
    return [a for o in overrides for a in ("--set", o)]


QUIET = ("train.progress_bar=false", "checkpoint.resume=none")
DEMO = "configs/demo.yaml"
TINY_DEMO = (*QUIET, "data.val_samples=4096", "optim.decay_start_step=10", "optim.decay_steps=10",
             "optim.warmup_steps=5")
MT_TASKS = ("model.tasks=[{name: watched}, {name: liked, head: [16]}, "
            "{name: disliked, head: [16]}]")


@dataclass
class Step:
    name: str
    args: List[str]  # after `python`
    needs: List[str] = field(default_factory=list)  # steps whose outputs it reads
    prepare: Optional[Callable[[Path], None]] = None  # writes its inputs first
    expect: int = 0  # its exit code when all is well
    masks: List[Mask] = field(default_factory=list)  # its own, after MASKS


def steps() -> List[Step]:
    s = []

    def add(name, args, needs=(), prepare=None, expect=0, torchrun=False, masks=()):
        s.append(Step(name, (TORCHRUN2 if torchrun else CLI) + list(args), list(needs),
                      prepare, expect, list(masks)))

    # plan: no process group, no GPU
    add("plan_demo", ["plan", "--config", DEMO])
    add("plan_compare", ["plan", "--config", "configs/mlperf_dcnv2.yaml", "--world-size", "8",
                         "--gpu-memory", "80GiB", "--compare"])
    add("plan_out_plot", ["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "16",
                          "--gpus-per-node", "8", "--out", "plan.json", "--plot", "plan.png"])
    add("plan_explain", ["plan", "--config", "configs/criteo_1tb_fl15.yaml", "--world-size", "64",
                         "--gpus-per-node", "8", "--explain", "t_cat_5"])
    add("plan_dhen_nvidia", ["plan", "--config", DEMO, *sets("model.interaction=dhen",
                             "model.dhen.width=64", "parallel.dense=hsdp"), "--world-size", "16",
                             "--gpus-per-node", "8", "--strategy", "nvidia", "--device", "a100"])
    add("plan_mlperf_qr_one_gpu", ["plan", "--config", "configs/mlperf_dcnv2_qr.yaml",
                                   "--world-size", "1", "--gpu-memory", "80GiB"])
    add("plan_two_tower", ["plan", "--config", "configs/two_tower_demo.yaml", "--world-size", "2"])
    add("plan_error_unknown_table", ["plan", "--config", DEMO, "--explain", "no_such_table"],
        expect=2)
    # synth: the planted data to files
    add("synth_demo", ["synth", "--config", DEMO, "--output", "data/synth",
                       *sets("data.train_samples=4096", "data.val_samples=2048")])
    add("synth_multitask", ["synth", "--config", "configs/multitask_demo.yaml", "--output",
                            "data/synth_mt", *sets("data.train_samples=4096",
                                                   "data.val_samples=2048")])
    add("synth_two_tower", ["synth", "--config", "configs/two_tower_demo.yaml", "--output",
                            "data/synth_tt", *sets("data.users=200", "data.items=100",
                                                   "data.interactions_per_user=10")])
    # preprocess
    add("preprocess_criteo_days", ["preprocess", "criteo", "--input", "criteo/day_0",
                                   "criteo/day_23.gz", "--output", "data/criteo", "--workers", "2",
                                   "--memory-limit", "1G"], prepare=write_criteo_inputs)
    add("preprocess_criteo_hash", ["preprocess", "criteo", "--input", "criteo/train.txt",
                                   "--output", "data/criteo_hash", "--frequency-threshold", "2",
                                   "--max-table-size", "50", "--workers", "1", "--memory-limit",
                                   "1G"], needs=["preprocess_criteo_days"])
    add("preprocess_criteo_vocabulary", ["preprocess", "criteo", "--input", "criteo/day_24.tsv",
                                         "--output", "data/criteo_day24", "--vocabulary",
                                         "data/criteo", "--split", "hash", "--workers", "1",
                                         "--memory-limit", "1G"],
        needs=["preprocess_criteo_days"])
    add("preprocess_npy", ["preprocess", "npy", "--input", "npy", "--output", "data/npy"],
        prepare=write_npy_days)
    add("preprocess_multihot", ["preprocess", "multihot", "--input", "data/npy", "--output",
                                "data/multihot", "--rows", "input"], needs=["preprocess_npy"])
    add("preprocess_day23", ["preprocess", "day23", "--dataset", "data/npy_old_rule"],
        needs=["preprocess_npy"], prepare=make_old_rule_copy)
    add("preprocess_day23_again", ["preprocess", "day23", "--dataset", "data/npy_old_rule"],
        needs=["preprocess_day23"])
    log = ["--input", "log.csv", "--columns", "user,item,rating,timestamp,item:category"]
    add("preprocess_interactions", ["preprocess", "interactions", *log, "--positive", "rating>=1",
                                    "--output", "data/ret"], prepare=write_interaction_log)
    add("preprocess_interactions_labels", ["preprocess", "interactions", *log, "--labels",
                                           "watched,liked:rating>=4,disliked:rating<=2",
                                           "--ranking-negatives", "2", "--holdout", "data/ret",
                                           "--output", "data/rank"],
        needs=["preprocess_interactions"])
    # train
    add("train_demo", ["train", "--config", DEMO, *sets(*TINY_DEMO, "train.max_steps=20",
                       "train.log_every=5", "train.eval_every=10", "checkpoint.every=10",
                       "train.run_dir=runs/demo")])
    add("train_torchrun_2_ranks", ["train", "--config", DEMO, *sets(
        *TINY_DEMO, "train.max_steps=10", "train.log_every=5", "train.run_dir=runs/demo_2ranks",
        "train.rank_logs=true")], torchrun=True)
    add("train_synth_files", ["train", "--config", DEMO, *sets(
        *TINY_DEMO, "data.path=data/synth", "train.max_steps=8", "train.log_every=4",
        "data.shuffle=true", "train.run_dir=runs/synth")], needs=["synth_demo"])
    add("train_multitask_synth", ["train", "--config", "configs/multitask_demo.yaml", *sets(
        *TINY_DEMO, "data.path=data/synth_mt", "train.max_steps=10", "train.log_every=5",
        "train.eval_every=5", "train.run_dir=runs/mt_synth")], needs=["synth_multitask"])
    add("train_dhen", ["train", "--config", DEMO, *sets(
        *TINY_DEMO, "model.interaction=dhen",
        "model.dhen.modules=[dot,self_attention,linear,dcn,conv]",
        "train.max_steps=4", "train.log_every=2", "train.run_dir=runs/dhen")])
    add("train_criteo", ["train", "--config", DEMO, *sets(
        *QUIET, "data.path=data/criteo", "data.global_batch_size=64", "train.max_steps=6",
        "train.log_every=3", "optim.warmup_steps=2", "optim.decay_start_step=3",
        "optim.decay_steps=3", "train.run_dir=runs/criteo")], needs=["preprocess_criteo_days"])
    add("train_two_tower", ["train", "--config", "configs/two_tower_demo.yaml", *sets(
        *QUIET, "data.path=data/ret", "data.global_batch_size=128", "model.temperature=0.1",
        "train.max_steps=30", "train.log_every=10", "train.eval_every=15",
        "train.run_dir=runs/tt")], needs=["preprocess_interactions"])
    add("train_ranker", ["train", "--config", "configs/multitask_demo.yaml", *sets(
        *QUIET, "data.path=data/rank", MT_TASKS,
        "value_model={watched: 1, liked: 2, disliked: -3}", "data.label_missing=0",
        "data.global_batch_size=256", "train.max_steps=20", "train.log_every=10",
        "train.eval_every=0", "optim.decay_start_step=10", "optim.decay_steps=10",
        "train.run_dir=runs/rank")], needs=["preprocess_interactions_labels"])
    add("train_error_bad_key", ["train", "--config", DEMO, *sets("model.interaction=bogus")],
        expect=2)
    # eval
    add("eval_demo_test", ["eval", "--checkpoint", "runs/demo/checkpoints/step_20"],
        needs=["train_demo"])
    add("eval_demo_val_step10", ["eval", "--checkpoint", "runs/demo/checkpoints/step_10",
                                 "--split", "val"], needs=["train_demo"])
    add("eval_two_tower", ["eval", "--checkpoint", "runs/tt/checkpoints/step_30", "--split",
                           "test"], needs=["train_two_tower"])
    add("eval_ranker", ["eval", "--checkpoint", "runs/rank/checkpoints/step_20"],
        needs=["train_ranker"])
    # export
    add("export_fp32", ["export", "--checkpoint", "runs/demo/checkpoints/step_20", "--out",
                        "served/demo.pt"], needs=["train_demo"])
    add("export_int8", ["export", "--checkpoint", "runs/demo/checkpoints/step_20", "--out",
                        "served/demo_int8.pt", "--quantize", "int8", "--quantize-table",
                        "t_cat_0=int4"], needs=["train_demo"])
    add("export_state_dict", ["export", "--checkpoint", "runs/demo/checkpoints/step_20",
                              "--out", "served/demo_state.pt", "--state-dict"],
        needs=["train_demo"])
    add("export_criteo", ["export", "--checkpoint", "runs/criteo/checkpoints/step_6", "--out",
                          "served/criteo.pt"], needs=["train_criteo"])
    add("export_ranker", ["export", "--checkpoint", "runs/rank/checkpoints/step_20", "--out",
                          "served/rank.pt"], needs=["train_ranker"])
    add("export_retrieval_flat", ["export", "--checkpoint", "runs/tt/checkpoints/step_30",
                                  "--out", "served/tt", "--retrieval"], needs=["train_two_tower"])
    add("export_retrieval_ivf", ["export", "--checkpoint", "runs/tt/checkpoints/step_30",
                                 "--out", "served/tt_ivf", "--retrieval", "--index", "ivf",
                                 "--nlist", "4", "--nprobe", "2"], needs=["train_two_tower"])
    add("export_error_out_is_input", ["export", "--checkpoint", "runs/demo/checkpoints/step_20",
                                      "--out", "runs/demo/checkpoints/step_20/meta.pt"],
        needs=["train_demo"], expect=2)
    # predict
    add("predict_split_binary", ["predict", "--model", "served/demo.pt", "--data", "data/synth",
                                 "--split", "val", "--out", "pred/synth_val.txt"],
        needs=["export_fp32", "synth_demo"])
    add("predict_int8_csv", ["predict", "--model", "served/demo_int8.pt", "--data", "rows.csv",
                             "--out", "pred/rows.txt", "--batch-size", "16"],
        needs=["export_int8"], prepare=write_predict_csv)
    add("predict_raw_criteo", ["predict", "--model", "served/criteo.pt", "--data",
                               "criteo/day_24.tsv", "--raw-criteo", "data/criteo", "--out",
                               "pred/day_24.txt"], needs=["export_criteo"])
    add("predict_multitask", ["predict", "--model", "served/rank.pt", "--data", "data/rank",
                              "--split", "test", "--out", "pred/rank.csv", "--value",
                              "watched=1,liked=0.5", "--top-k-label", "2", "--label-out",
                              "pred/top2.txt"], needs=["export_ranker"])
    # retrieve
    add("retrieve_user", ["retrieve", "--model", "served/tt", "--user", "u3", "--k", "10"],
        needs=["export_retrieval_flat"])
    add("retrieve_history_json", ["retrieve", "--model", "served/tt_ivf", "--user", "u3",
                                  "--history", "i5,i17", "--k", "8", "--json"],
        needs=["export_retrieval_ivf"])
    add("retrieve_users_out", ["retrieve", "--model", "served/tt", "--users", "users.txt", "--k",
                               "5", "--out", "pred/retrieved.jsonl"],
        needs=["export_retrieval_flat"])
    # pixie
    add("pixie_build", ["pixie", "build", "--data", "data/ret", "--out", "graphs/g"],
        needs=["preprocess_interactions"])
    add("pixie_build_pruned", ["pixie", "build", "--data", "data/ret", "--out", "graphs/pruned",
                               "--max-item-degree", "20", "--min-user-degree", "3",
                               "--max-user-entropy", "1.5", "--seed", "3"],
        needs=["preprocess_interactions"])
    add("pixie_query_user", ["pixie", "query", "--graph", "graphs/g", "--user", "u3", "--k", "10",
                             "--steps", "20000"], needs=["pixie_build"])
    add("pixie_query_items_json", ["pixie", "query", "--graph", "graphs/pruned", "--items",
                                   "i5:2,i17", "--k", "10", "--early-stop", "20,5", "--walkers",
                                   "256", "--json"], needs=["pixie_build_pruned"])
    # recommend
    funnel = ["--retrieval", "served/tt", "--pixie", "graphs/g", "--ranker", "served/rank.pt",
              "--per-source", "20", "--rank-top", "30"]
    recommend_needs = ["export_retrieval_flat", "pixie_build", "export_ranker"]
    add("recommend_user", ["recommend", *funnel, "--user", "u3", "--k", "10"],
        needs=recommend_needs)
    add("recommend_user_json", ["recommend", *funnel, "--user", "u7", "--k", "8", "--value",
                                "liked=1,disliked=-1", "--blocklist", "blocklist.txt", "--json"],
        needs=recommend_needs)
    add("recommend_users_out", ["recommend", *funnel, "--users", "users.txt", "--k", "5",
                                "--sources", "two_tower,pixie", "--diversity", "off", "--out",
                                "pred/recommended.jsonl"], needs=recommend_needs)
    # bench: timings only, so mostly masked; what is left is what it measured and how
    add("bench_short", ["bench", "--config", DEMO, *sets("data.global_batch_size=256"),
                        "--steps", "3", "--warmup", "1", "--peers", "reference"],
        masks=BENCH_MASKS)
    # plot
    add("plot_one", ["plot", "plot_runs/a"], needs=["train_demo", "train_multitask_synth"],
        prepare=make_plot_runs)
    add("plot_two", ["plot", "plot_runs/a", "plot_runs/b", "--out", "plots/compare.png"],
        needs=["plot_one"])
    return s


# ---- running and recording --------------------------------------------------------------------


def snapshot(work: Path) -> Dict[str, str]:
    """relative path -> sha256 of every file under `work`."""
    found = {}
    for path in sorted(work.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[path.relative_to(work).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


TEXT_SUFFIXES = {".txt", ".json", ".jsonl", ".yaml", ".yml", ".csv", ".tsv", ".log", ".md"}


def as_text(rel: str, data: bytes) -> Optional[str]:
    if Path(rel).suffix not in TEXT_SUFFIXES or b"\0" in data or len(data) > TEXT_LIMIT:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def digest_line(data: bytes, masks: List[Mask]) -> str:
    """Size and sha256 of `data` after the byte masks (which may change its length: a path)."""
    masked, changed = mask_bytes(data, masks)
    return f"{len(masked)} bytes  sha256{' masked' if changed else ''} " \
           f"{hashlib.sha256(masked).hexdigest()}"


def describe_zip(path: Path, masks: List[Mask]) -> List[str]:
    """One line per member of a zip archive (TorchScript and torch.save files are zips): its
    masked name, size and sha256; random ids and text members masked. (The archive's own bytes
    hold the random serialization_id and the members' CRCs, so it is compared by members.)"""
    lines = []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            data = archive.read(info)
            name = apply_masks(info.filename, masks)
            if any(re.search(pattern, info.filename) for pattern, _ in RANDOM_MEMBERS):
                lines.append(f"    {name}  (a random id: not compared)")
                continue
            text = as_text(info.filename, data)
            if text is not None:
                masked = apply_masks(text, masks).encode()
                lines.append(f"    {name}  {len(masked)} bytes  sha256 masked text "
                             f"{hashlib.sha256(masked).hexdigest()}")
            else:
                lines.append(f"    {name}  {digest_line(data, masks)}")
    return lines


def describe_files(work: Path, before: Dict[str, str], after: Dict[str, str],
                   masks: List[Mask]) -> str:
    """What a step wrote, changed or removed under `work`: a listing, then each text file."""
    listing, contents, shown_as = [], [], {}
    for rel in sorted(p for p in after if before.get(p) != after[p]):
        data = (work / rel).read_bytes()
        shown = apply_masks(rel, masks)
        state = "changed" if rel in before else "new"
        if any(re.search(pattern, rel) for pattern, _ in UNCOMPARED):
            listing.append(f"{state} {shown}  (binary with wall-clock times: not compared)")
            continue
        text = as_text(rel, data)
        if text is None and zipfile.is_zipfile(work / rel):
            members = describe_zip(work / rel, masks)
            listing += [f"{state} {shown}  zip of {len(members)} members:", *members]
            continue
        if text is None:
            listing.append(f"{state} {shown}  {digest_line(data, masks)}")
            continue
        masked = apply_masks(text, masks)
        digest = hashlib.sha256(masked.encode()).hexdigest()
        listing.append(f"{state} {shown}  {len(data.splitlines())} lines  sha256 masked {digest}")
        if digest in shown_as:
            contents.append(f"=== {shown} === the same text as {shown_as[digest]}\n")
            continue
        shown_as[digest] = shown
        lines = masked.splitlines(keepends=True)
        body = "".join(lines[:SHOWN_LINES])
        if len(lines) > SHOWN_LINES:
            body += f"... {len(lines) - SHOWN_LINES} more lines (in the sha256 above)\n"
        if body and not body.endswith("\n"):
            body += "\n<no newline at the end>\n"
        contents.append(f"=== {shown} ===\n{body}")
    for rel in sorted(set(before) - set(after)):
        listing.append(f"removed {apply_masks(rel, masks)}")
    return "\n".join(listing) + "\n\n" + "\n".join(contents)


def environment() -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", TZ="UTC", MPLBACKEND="Agg")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the same CPU path on every host
    return env


def run_step(step: Step, work: Path, out: Path, number: int,
             masks: List[Mask]) -> Tuple[bool, float]:
    if step.prepare:
        step.prepare(work)
    masks = masks + step.masks
    before = snapshot(work)
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *step.args], cwd=work, env=environment(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as e:
        code = "timeout"
        stdout = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
    took = time.monotonic() - started
    after = snapshot(work)
    record = (f"$ python {' '.join(step.args)}\n"
              f"exit code: {code}\n"
              f"--- stdout ---\n{apply_masks(stdout, masks)}"
              f"--- stderr ---\n{apply_masks(stderr, masks)}"
              f"--- files written, changed or removed ---\n"
              f"{describe_files(work, before, after, masks)}")
    (out / f"{number:02d}_{step.name}.txt").write_text(record)
    return code == step.expect, took


def with_needs(chosen: List[str], every: List[Step]) -> List[Step]:
    by_name = {s.name: s for s in every}
    unknown = [n for n in chosen if n not in by_name]
    if unknown:
        sys.exit(f"--only: no step {', '.join(unknown)}; steps: {', '.join(by_name)}")
    wanted, todo = set(), list(chosen)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            todo += by_name[name].needs
    return [s for s in every if s.name in wanted]


def record(out: Path, only: Optional[List[str]], keep: bool) -> int:
    every = steps()
    chosen = with_needs(only, every) if only else every
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(out.glob("[0-9][0-9]_*.txt"))
    if stale:
        sys.exit(f"{out}: holds records already ({stale[0].name}...); give an empty folder")
    (out / "00_index.txt").write_text(index())
    work = Path(tempfile.mkdtemp(prefix="cli_outputs_"))
    masks = path_masks(work) + MASKS
    shutil.copytree(ROOT / "configs", work / "configs")
    for folder in OUTPUT_FOLDERS:  # commands write files into folders that exist
        (work / folder).mkdir()
    numbers = {s.name: i + 1 for i, s in enumerate(every)}  # the same file name with --only
    failed, started = [], time.monotonic()
    try:
        for step in chosen:
            ok, took = run_step(step, work, out, numbers[step.name], masks)
            print(f"{numbers[step.name]:02d} {step.name:34s} {took:6.1f} s"
                  f"{'' if ok else '  UNEXPECTED EXIT CODE'}", file=sys.stderr, flush=True)
            if not ok:
                failed.append(step.name)
    finally:
        if keep:
            print(f"work folder kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{len(chosen)} steps in {time.monotonic() - started:.0f} s; records in {out}"
          + (f"; unexpected exit codes: {', '.join(failed)}" if failed else ""), file=sys.stderr)
    return 1 if failed else 0


def index() -> str:
    """The steps and the masks, as 00_index.txt records them."""
    lines = ["steps (python ARGS, run in a temporary folder; <nn>_<name>.txt each):"]
    lines += [f"{i:02d} {s.name}: python {' '.join(s.args)}" for i, s in enumerate(steps(), 1)]
    lines.append("masks, text (every step; bench's own after them):")
    lines += ["  the temporary folder the commands run in: its path -> <WORK>",
              "  the checkout this script is in: its path -> <ROOT>"]
    for pattern, replacement, why in MASKS + BENCH_MASKS:
        shown = replacement if isinstance(replacement, str) else "numbers -> <T>"
        lines.append(f"  {why}: {pattern} -> {shown}")
    lines.append("masks, binary files and zip members (before hashing):")
    lines += [f"  {why}: {pattern.decode()} -> {replacement.decode()}"
              for pattern, replacement, why in BYTE_MASKS]
    lines.append("  the two folders' paths, as in text")
    lines += [f"  {why}: the member {pattern}" for pattern, why in RANDOM_MEMBERS]
    lines += [f"  {why}: {pattern} (listed, not compared)" for pattern, why in UNCOMPARED]
    return "\n".join(lines) + "\n"


def diff(a: Path, b: Path) -> int:
    names = sorted({p.name for d in (a, b) for p in d.glob("*.txt")})
    differing = 0
    for name in names:
        left, right = a / name, b / name
        if not left.exists() or not right.exists():
            print(f"only in {a if left.exists() else b}: {name}")
            differing += 1
            continue
        x = left.read_text().splitlines(keepends=True)
        y = right.read_text().splitlines(keepends=True)
        if x != y:
            differing += 1
            sys.stdout.writelines(difflib.unified_diff(x, y, str(left), str(right)))
    print(f"{differing} of {len(names)} records differ" if differing else
          f"identical: {len(names)} records")
    return 1 if differing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", nargs="?", help="folder to write the records into (new or empty)")
    parser.add_argument("--diff", nargs=2, metavar=("DIR_A", "DIR_B"), help="compare two records")
    parser.add_argument("--only", help="comma-separated step names (their inputs' steps run too)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--list", action="store_true", help="print the steps and the masks")
    args = parser.parse_args()
    if args.list:
        print(index(), end="")
        return
    if args.diff:
        sys.exit(diff(Path(args.diff[0]), Path(args.diff[1])))
    if not args.outdir:
        parser.error("give OUTDIR, or --diff DIR_A DIR_B")
    sys.exit(record(Path(args.outdir), args.only.split(",") if args.only else None, args.keep))


if __name__ == "__main__":
    main()
