"""output_dir/curves.png from a run's logs (python train.py --plot DIR draws it for any output folder)."""

import contextlib
import json
import os
from collections import defaultdict


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    records = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):  # a run that died mid-write leaves half a line
            records.append(json.loads(line))
    return records


def read_seed_log(path):
    """{step: value} from a seed-format text log ("step,value" lines); values of one step are summed."""
    values = defaultdict(float)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    step, value = line.strip().split(",")
                    values[int(step)] += float(value)
    return dict(values)


def plot_curves(output_dir):
    """Draw output_dir/curves.png from the logs there; the seed's two text files are enough.

    Panels: loss and accuracy (the text files), and from metrics.jsonl when present: mean reward,
    total and per function; response length; fraction of groups skipped by dynamic sampling.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # A micro-step line "k,loss" belongs to optimizer step k + 1; its lines add up to that step's loss.
    losses = {step + 1: value for step, value in read_seed_log(os.path.join(output_dir, "training_losses.txt")).items()}
    accuracy = read_seed_log(os.path.join(output_dir, "accuracy_losses.txt"))
    records = read_jsonl(os.path.join(output_dir, "metrics.jsonl"))
    panels = [("loss", {"loss": losses}), ("accuracy", {"accuracy": accuracy})]
    if records:
        series = lambda key: {r["step"]: r[key] for r in records if key in r}  # noqa: E731
        reward_keys = sorted(
            {key for r in records for key in r if key.startswith("rewards/") and key.endswith("/mean")}
        )
        panels += [
            ("mean reward", {"total": series("reward"), **{key.split("/")[1]: series(key) for key in reward_keys}}),
            (
                "response length (tokens)",
                {"mean": series("completions/mean_length"), "max": series("completions/max_length")},
            ),
            ("groups skipped (fraction)", {"skipped": series("frac_groups_skipped")}),
        ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, lines) in zip(axes[:, 0], panels):
        for label, points in lines.items():
            if points:
                steps = sorted(points)
                ax.plot(steps, [points[s] for s in steps], marker="." if len(steps) < 30 else None, label=label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("update step")
    fig.tight_layout()
    path = os.path.join(output_dir, "curves.png")
    fig.savefig(path + ".tmp.png", dpi=100)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return path
