"""The feature interactions compared: (a) the `dot` kernel alone against torchrec's
InteractionArch, (b) every interaction trained at one budget on planted teachers of order 2
and 3.

    .venv/bin/python benchmarks/interactions.py [--quick] [--steps 1500] [--batch-size 512]
        [--kernel-batch 2048] [--features 26] [--dim 64]

(a) Forward + backward of ours (dlrm_hybrid.model.interactions) and torchrec's `dot`, in fp32
and under bf16 autocast: ms per call.

(b) The demo model (configs/demo.yaml: 8 tables, dim 16, bottom MLP 64-16, top MLP 64-32-1) with
each interaction in turn: dot, cat, dcn (stacked, parallel, stacked with 4 experts; rank 64),
fm, and dhen (the default [dot, self_attention] x 2 layers, and all five modules x 2 layers).
Every run has the same budget: the same steps x batch, learning rates and schedule (warmup,
then decay over the second half), tables, seeds and batches; one process, exact AUC over
65,536 validation samples. The data are the planted teacher of data.teacher_order 2 (pairwise
dots of latent vectors) and 3 (pairwise plus three-way products; data/synthetic.py), each with
its oracle AUC (the true probabilities' AUC, the ceiling). Prints per run the val AUC, its
gap to the oracle, log loss, ms per training step, dense parameters (all but the tables),
seconds; the last line, for scripts:

    interactions: teacher2_oracle=.. teacher3_oracle=.. dot=A2/A3 cat=A2/A3 ... dhen=A2/A3 ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DCN = ["model.interaction=dcn", "model.dcn.rank=64"]
DHEN = ["model.interaction=dhen"]
MODELS = {  # name -> overrides of the demo config
    "dot": ["model.interaction=dot"],
    "cat": ["model.interaction=cat"],
    "dcn": DCN + ["model.dcn.structure=stacked"],
    "dcn_parallel": DCN + ["model.dcn.structure=parallel"],
    "dcn_experts4": DCN + ["model.dcn.structure=stacked", "model.dcn.experts=4"],
    "fm": ["model.interaction=fm"],
    "dhen": DHEN,  # model.dhen's defaults: [dot, self_attention], 2 layers
    "dhen_all5": DHEN + ["model.dhen.modules=[dot,self_attention,linear,dcn,conv]"],
}


def ms_per_call(module, dense, sparse, dtype, reps: int) -> float:
    import torch

    def once():
        context = (torch.autocast(dense.device.type, dtype=dtype) if dtype
                   else contextlib.nullcontext())
        with context:
            out = module(dense, sparse)
        out.float().sum().backward()

    for _ in range(3):
        once()
    start = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - start) / reps * 1e3


def kernel_table(batch: int, features: int, dim: int, reps: int) -> None:
    """(a): our `dot` against torchrec's InteractionArch."""
    import torch
    from torchrec.models.dlrm import InteractionArch

    from dlrm_hybrid.model.interactions import DotInteraction

    dense = torch.randn(batch, dim, requires_grad=True)
    sparse = torch.randn(batch, features, dim, requires_grad=True)
    print(f"(a) dot interaction, batch {batch}, {features + 1} vectors of {dim}, "
          f"{torch.get_num_threads()} threads: ms per forward + backward")
    print(f"{'precision':>9} {'torchrec':>9} {'ours':>9} {'speedup':>8}")
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        ref = ms_per_call(InteractionArch(features), dense, sparse, dtype, reps)
        ours = ms_per_call(DotInteraction(features), dense, sparse, dtype, reps)
        print(f"{name:>9} {ref:>9.2f} {ours:>9.2f} {ref / ours:>7.2f}x", flush=True)


def budget(steps: int, batch: int, val: int, order: int, run_dir: str) -> list:
    """The settings every run of (b) shares."""
    return [f"data.teacher_order={order}", f"data.global_batch_size={batch}",
            f"data.val_samples={val}", f"train.max_steps={steps}", f"train.log_every={steps}",
            "train.eval_every=0", "train.progress_bar=false", "train.tensorboard=false",
            "optim.warmup_steps=20", f"optim.decay_start_step={steps // 2}",
            f"optim.decay_steps={steps - steps // 2}", "checkpoint.resume=none",
            f"train.run_dir={run_dir}"]


def dense_parameters(cfg) -> int:
    """Parameters outside the embedding tables (built on the meta device: no memory)."""
    from dlrm_hybrid.data.synthetic import SyntheticClicks
    from dlrm_hybrid.model.dlrm import build_model

    model = build_model(cfg.model, SyntheticClicks(cfg.data).spec)
    return sum(p.numel() for name, p in model.named_parameters()
               if not name.startswith("embedding_bags."))


def train_quietly(cfg, env):
    from dlrm_hybrid.train.loop import train

    with open(os.devnull, "w") as quiet:  # the run's own plan and progress lines
        saved, sys.stdout = sys.stdout, quiet
        try:
            return train(cfg, env)
        finally:
            sys.stdout = saved


def training_table(steps: int, batch: int, val: int) -> str:
    """(b): every interaction on both teachers; returns the summary line."""
    from dlrm_hybrid.config_loading import load_config
    from dlrm_hybrid.parallel.process_group import init_distributed

    env = init_distributed("gloo")
    print(f"(b) {steps} steps x {batch} samples per run, demo tables, teacher_scale 1.5, "
          f"adagrad, warmup 20, decay over steps {steps // 2}..{steps}; {val:,} val samples")
    print("| teacher | interaction | val AUC | AUC - oracle | val logloss | ms/step "
          "| dense params | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    auc, oracle = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for order in (2, 3):
            for name, overrides in MODELS.items():
                run_dir = f"{scratch}/{order}_{name}"
                cfg = load_config(str(ROOT / "configs/demo.yaml"),
                                  overrides + budget(steps, batch, val, order, run_dir))
                start = time.perf_counter()
                result = train_quietly(cfg, env)
                seconds = time.perf_counter() - start
                m = result.metrics
                auc[name, order], oracle[order] = m["val_auc"], m["oracle_auc"]
                print(f"| {order} | {name} | {m['val_auc']:.4f} | "
                      f"{m['val_auc'] - m['oracle_auc']:+.4f} | {m['val_logloss']:.4f} | "
                      f"{batch / result.samples_per_s * 1e3:.2f} | {dense_parameters(cfg):,} | "
                      f"{seconds:.0f} |", flush=True)
            print(f"| {order} | oracle | {oracle[order]:.4f} | | | | | |", flush=True)
    models = " ".join(f"{name}={auc[name, 2]:.4f}/{auc[name, 3]:.4f}" for name in MODELS)
    return (f"interactions: teacher2_oracle={oracle[2]:.4f} teacher3_oracle={oracle[3]:.4f} "
            f"{models}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short check that it runs: 60 steps, 8,192 val samples")
    parser.add_argument("--steps", type=int, default=1500, help="training steps per run")
    parser.add_argument("--batch-size", type=int, default=512, help="global batch of (b)")
    parser.add_argument("--kernel-batch", type=int, default=2048, help="batch of (a)")
    parser.add_argument("--features", type=int, default=26, help="tables of (a)")
    parser.add_argument("--dim", type=int, default=64, help="vector width of (a)")
    args = parser.parse_args()
    steps, val, reps = (60, 8192, 5) if args.quick else (args.steps, 65536, 30)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29578")
    sys.path.insert(0, str(ROOT))
    import logging

    from dlrm_hybrid.train.precision import cpu_description

    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    print(f"interactions on {os.cpu_count()} cores ({cpu_description()})")
    kernel_table(args.kernel_batch, args.features, args.dim, reps)
    print(training_table(steps, args.batch_size, val))


if __name__ == "__main__":
    main()
