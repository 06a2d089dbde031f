"""``raylastic plot RUN_DIR``: the run's training and validation loss, with its failures, as a PNG.

Example::

    raylastic plot runs/gpt-elastic                 # -> runs/gpt-elastic/losses.png
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

SMOOTHING = 0.9
"""Weight of the running average in the smoothed training loss (as TensorBoard's slider)."""


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plot", help="plot a run's training and validation loss",
        description="Read RUN_DIR/result.json and write its training loss (per step, and smoothed), its "
        "validation rows (eval.every_steps) and its world size, with failures marked, as a PNG.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory holding result.json")
    parser.add_argument("--out", help="the PNG to write (default: RUN_DIR/losses.png)")
    parser.add_argument("--metric", default="eval_loss", help="the eval row's metric to plot (default: eval_loss)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    result_path = Path(args.run_dir) / "result.json"
    try:
        result = json.loads(result_path.read_text())
    except (OSError, ValueError) as error:
        print(f"error: cannot read {result_path}: {error}")
        return 2
    if not result.get("history"):
        print(f"error: {result_path} has no step history to plot")
        return 2
    out = Path(args.out or Path(args.run_dir) / "losses.png")
    plot_losses(result, out, metric=args.metric)
    print(f"wrote {out}")
    return 0


def plot_losses(result: dict[str, Any], out: Path, *, metric: str = "eval_loss") -> None:
    """Training loss and world size against the step, eval rows as points, failures as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in result["history"]]
    losses = [_number(row["loss"]) for row in result["history"]]  # a skipped step's NaN loss: null, a gap
    figure, (loss_axes, size_axes) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True,
                                                  gridspec_kw={"height_ratios": [4, 1]})
    loss_axes.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="training loss (per step)")
    loss_axes.plot(steps, _smoothed(losses), color="tab:blue", label="training loss (smoothed)")
    evaluated = [row for row in result.get("eval_history") or [] if metric in row]
    if evaluated:
        loss_axes.plot([row["step"] for row in evaluated], [_number(row[metric]) for row in evaluated], "o-",
                       color="tab:orange", label=f"validation ({metric})")
    failed_at = sorted({event["step"] for event in result.get("events", []) if event["type"] == "worker_failed"})
    for number, step in enumerate(failed_at):
        loss_axes.axvline(step, color="tab:red", linestyle="--", linewidth=1,
                          label="a worker failed" if number == 0 else None)
        size_axes.axvline(step, color="tab:red", linestyle="--", linewidth=1)
    loss_axes.set(ylabel="loss", title=result.get("name", "run"))
    loss_axes.legend()
    size_axes.step(steps, [row["world_size"] for row in result["history"]], where="post", color="tab:gray")
    size_axes.set(xlabel="step (rows of redone steps replace the discarded ones)", ylabel="workers")
    size_axes.yaxis.get_major_locator().set_params(integer=True)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def _smoothed(values: list[float | None]) -> list[float]:
    """The running average, which a missing or non-finite value (a skipped step's) leaves as it was."""
    smoothed, average = [], math.nan
    for value in map(_number, values):
        if math.isfinite(value):
            average = value if math.isnan(average) else SMOOTHING * average + (1 - SMOOTHING) * value
        smoothed.append(average)
    return smoothed


def _number(value: float | None) -> float:
    """result.json's number, or NaN where it holds null (a non-finite value)."""
    return math.nan if value is None else value
