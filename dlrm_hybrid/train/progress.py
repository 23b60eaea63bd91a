"""What rank 0 shows while it trains: tqdm's bar where someone watches a terminal, else one
line per `train.log_every` steps, as a batch job's log wants them (no carriage returns)."""

from __future__ import annotations

import sys

from tqdm import tqdm

# The figures of a training record shown, in this order, and how.
SHOWN = {"loss": "{:.5f}", "samples_per_s": "{:.0f}", "lr_dense": "{:.6g}",
         "lr_embedding": "{:.6g}", "skipped_steps": "{}", "elapsed_s": "{:.1f}"}


def shows_bar(setting: str) -> bool:
    """`train.progress_bar`: true | false | auto, a bar when stdout and stderr are both
    terminals (the bar is drawn on stderr; the printed lines go to stdout, which a batch job
    keeps in a file)."""
    if setting == "auto":
        return sys.stdout.isatty() and sys.stderr.isatty()
    return setting == "true"


def figures(record: dict, skip: tuple = ()) -> str:
    """`loss=0.47123 samples_per_s=81234 ...`: the record's shown figures, key=value."""
    return " ".join(f"{key}={form.format(record[key])}" for key, form in SHOWN.items()
                    if key in record and key not in skip)


class Progress:
    """The bar, its postfix the last training record's figures (it shows elapsed time itself);
    or, without a bar, a line per training record: `step 200/3000: loss=0.47123 ...`."""

    def __init__(self, first: int, total: int, setting: str, is_main: bool) -> None:
        self.total = total
        self.lines = is_main and not shows_bar(setting)
        self.bar = tqdm(total=total, initial=first, desc="train", unit="step",
                        disable=not is_main or self.lines)

    def step(self) -> None:
        self.bar.update()

    def show(self, record: dict) -> None:
        if self.lines:
            # One write with its newline: a Ctrl-C handler printing while this line is flushed
            # (print writes the text and the newline apart) would otherwise join the two lines.
            sys.stdout.write(f"step {record['step']}/{self.total}: {figures(record)}\n")
            sys.stdout.flush()
        else:
            self.bar.set_postfix_str(figures(record, skip=("elapsed_s",)), refresh=False)

    def close(self) -> None:
        self.bar.close()
