"""curves.png: what a run's logs in output_dir say, read at a glance.

    plot_curves(output_dir) -> path of output_dir/curves.png
    plot_overlay({label: [output_dir, ...]}, path) -> path: several runs on the same panels (--plot A B, ablation.png)
    plot_command(output_dirs) -> what `python train.py --plot DIR [DIR ...]` prints (a folder without logs: one line,
                                 exit)

Inputs (any may be missing; the seed's two text files alone are enough):
    training_losses.txt  "k,loss" per micro-step; it belongs to optimizer step k + 1, and the lines
                         of one step add up to that step's loss
    accuracy_losses.txt  "step,accuracy" per evaluation (step 0 = before training): strict accuracy
    evaluations.jsonl    one record per evaluation: "step", "eval/accuracy_lenient", ... (evaluation.py)
    metrics.jsonl        one record per optimizer step: "step", "reward", "rewards/<name>/mean",
                         "completions/mean_length", "completions/max_length", "frac_groups_skipped"

A run appends to these logs, so one folder may hold several runs. A step counter that goes back
down starts a new run; for a step that appears in several runs the last run's value is drawn.

Per-step series are noisy, so each is drawn faint with its moving average (`smooth`) over it; the
held-out accuracy, measured only every eval_steps, is drawn with a marker at each evaluation, lenient dashed over
strict. Series whose lines coincide are drawn once, their labels joined ("a = b (within 0.01)"): none hides another.
"""

import contextlib
import json
import os
import sys
import textwrap

from dapo_utils.notices import warn
from dapo_utils.writes import WriteFailed, writing

ACCURACY_COLOR = "tab:red"
LENIENT_COLOR = "tab:purple"
PLOTTED_LOGS = ("accuracy_losses.txt", "training_losses.txt", "metrics.jsonl")  # what plot_curves draws from


def subfolders(folder, holds):
    """The folders directly inside folder for which holds(path) is true, sorted: where a mode that finds nothing in
    folder itself points to (--plot, --resume=latest in ./output when the demo ran in ./output/demo)."""
    paths = [os.path.join(folder, name) for name in sorted(os.listdir(folder))] if os.path.isdir(folder) else []
    return [path for path in paths if os.path.isdir(path) and holds(path)]


def has_logs(folder):
    return any(os.path.isfile(os.path.join(folder, name)) for name in PLOTTED_LOGS)


def read_step_log(path):
    """{step: value} from "step,value" lines.

    Lines of one step in one run add up (the micro-steps of an optimizer step). A step lower than
    the line before starts a new run (logs are appended), and a later run's value for a step
    replaces an earlier run's instead of adding to it.
    """
    values, run_of = {}, {}
    run, previous = 0, None
    if not os.path.exists(path):
        return values
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            step_text, value_text = line.strip().split(",")
            step, value = int(step_text), float(value_text)
            if previous is not None and step < previous:
                run += 1
            previous = step
            if run_of.get(step) == run:
                values[step] += value
            else:
                values[step], run_of[step] = value, run
    return values


def read_jsonl(path):
    """The records of a .jsonl log, in order; a line half-written by a crash is skipped."""
    records = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in filter(str.strip, f):
                with contextlib.suppress(json.JSONDecodeError):
                    records.append(json.loads(line))
    return records


def unevaluated_steps(output_dir, last_evaluated):
    """'' when the run's last step (metrics.jsonl) was evaluated, else what says it was not."""
    steps = [record["step"] for record in read_jsonl(os.path.join(output_dir, "metrics.jsonl"))]
    if not steps or max(steps) <= last_evaluated:
        return ""
    return f"  (the last evaluated step, of {max(steps)} trained: it evaluates every --eval_steps steps)"


def read_metrics(path):
    """metrics.jsonl records, the last one for each step (a later run's replaces an earlier run's), without the keys
    that had no value at their step (null: a step that did not sample or evaluate, no lagged group)."""
    records = {record["step"]: without_nulls(record) for record in read_jsonl(path)}
    return [records[step] for step in sorted(records)]


def without_nulls(record):
    return {key: value for key, value in record.items() if value is not None}


def read_accuracies(output_dir):
    """({step: strict accuracy}, {step: lenient accuracy}), both at full precision from evaluations.jsonl, so that
    gains computed from them agree; strict from the seed's accuracy_losses.txt (2 decimals) where no evaluation
    record has it (the seed's logs alone)."""
    evaluations = read_metrics(os.path.join(output_dir, "evaluations.jsonl"))
    strict = {r["step"]: r["eval/accuracy"] for r in evaluations if "eval/accuracy" in r}
    lenient = {r["step"]: r["eval/accuracy_lenient"] for r in evaluations if "eval/accuracy_lenient" in r}
    return strict or read_step_log(os.path.join(output_dir, "accuracy_losses.txt")), lenient


def smooth(values, window=None):
    """Centred moving average: point i is the mean of values[i - h : i + h + 1], h = window // 2,
    with the window cut short at both ends. window=None picks about a tenth of the series (odd)."""
    values = list(values)
    n = len(values)
    if window is None:
        window = 2 * (n // 20) + 1
    half = max(0, window // 2)
    prefix = [0.0]
    for v in values:
        prefix.append(prefix[-1] + v)
    smoothed = []
    for i in range(n):
        lo, hi = max(0, i - half), min(n, i + half + 1)
        smoothed.append((prefix[hi] - prefix[lo]) / (hi - lo))
    return smoothed


def redraw_curves(output_dir):
    """plot_curves during training: a failure (no matplotlib, a bad log line, ...) is a warning, not a crash; a
    failed write (a full disk, WriteFailed) ends the run in one line, as it would at the next log line."""
    try:
        plot_curves(output_dir)
    except WriteFailed:
        raise
    except Exception as error:  # noqa: BLE001
        warn(f"could not draw curves.png: {error!r}")


def plot_command(output_dirs, command="python train.py"):
    """`python train.py --plot DIR [DIR ...]`: one folder: draw DIR/curves.png; several: overlay.png in their common
    parent folder, a run per folder (plot_overlay). Returns the line that says so. A folder without the logs the
    plots draw from exits in one line instead, naming its subfolders that have them in a command (command: how this
    shell runs train.py, options.python_command)."""
    output_dirs = [output_dirs] if isinstance(output_dirs, str) else list(output_dirs)
    for output_dir in output_dirs:
        if not has_logs(output_dir):
            found, problem = subfolders(output_dir, has_logs), f"error: {output_dir!r} holds no training logs to plot"
            if not found:
                sys.exit(f"{problem} ({', '.join(PLOTTED_LOGS)}): give the output_dir of a run")
            sys.exit(f"{problem}; {in_words(found)} them: {command} --plot={found[0]}")
    if len(output_dirs) == 1:
        return f"wrote {plot_curves(output_dirs[0])}"
    parent = os.path.commonpath([os.path.abspath(d) for d in output_dirs])
    path = os.path.join(os.path.relpath(parent), "overlay.png")
    return f"wrote {plot_overlay({d: [d] for d in output_dirs}, path)}"


def in_words(folders):
    """'output/demo has', 'output/a, output/b have'."""
    return f"{', '.join(folders)} {'has' if len(folders) == 1 else 'have'}"


def plot_curves(output_dir):
    """Draw output_dir/curves.png from the logs there and return its path.

    Panels: held-out accuracy, strict and lenient (evaluation points), mean reward (total and per function), loss, and
    from metrics.jsonl also response length and the fraction of groups skipped by dynamic sampling.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = {step + 1: value for step, value in read_step_log(os.path.join(output_dir, "training_losses.txt")).items()}
    accuracy, lenient = read_accuracies(output_dir)
    records = read_metrics(os.path.join(output_dir, "metrics.jsonl"))

    def series(key):
        return {r["step"]: r[key] for r in records if key in r}

    panels = [("held-out accuracy (test split)", None), ("loss", {"loss": losses})]
    if records:
        reward_keys = sorted(
            {key for r in records for key in r if key.startswith("rewards/") and key.endswith("/mean")}
        )
        panels.insert(
            1,
            (
                "mean reward per response",
                {"total": series("reward"), **{key.split("/")[1]: series(key) for key in reward_keys}},
            ),
        )
        panels += [
            (
                "response length (tokens)",
                {"mean": series("completions/mean_length"), "max": series("completions/max_length")},
            ),
            ("groups skipped by dynamic sampling (fraction)", {"skipped": series("frac_groups_skipped")}),
        ]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.3 * len(panels) + 0.4), sharex=True, squeeze=False)
    for ax, (title, lines) in zip(axes[:, 0], panels):
        if lines is None:  # lenient dashed over strict: equal evaluations stay visible, and the legend says so
            same = bool(lenient) and lenient == accuracy
            draw_accuracy(ax, accuracy, "strict (answer tags)", ACCURACY_COLOR)
            label = "lenient (final answer)" + (": equal to strict at every evaluation" if same else "")
            draw_accuracy(ax, lenient, label, LENIENT_COLOR, second=True)
        else:
            for index, (label, points) in enumerate(coinciding(lines).items()):
                if points:
                    draw_series(ax, points, label, f"C{index}")
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if handles:  # outside the axes, right: never over the data; a long label on several lines
            labels = [textwrap.fill(label, 48, subsequent_indent="  ") for label in labels]
            ax.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[-1, 0].set_xlabel("update step")
    return save_figure(fig, os.path.join(output_dir, "curves.png"))


def save_figure(fig, path):
    """Write fig to path whole (a temporary file, then renamed), close it, and return path."""
    import matplotlib.pyplot as plt

    fig.tight_layout(rect=(0, 0.02 if fig.texts else 0, 1, 1))  # room for a note under the panels
    try:
        with writing("the curves", path):
            fig.savefig(path + ".tmp.png", dpi=100)
            os.replace(path + ".tmp.png", path)
    finally:
        plt.close(fig)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + ".tmp.png")
    return path


# plot_overlay's panels: (title, metrics.jsonl key; None: the strict accuracy of accuracy_losses.txt)
OVERLAY_PANELS = (
    ("held-out accuracy (strict)", None),
    ("mean reward per response", "reward"),
    ("entropy (trained tokens)", "entropy"),
    ("response length (tokens, mean)", "completions/mean_length"),
)


def run_series(output_dir, key):
    """{step: value} of one run: its strict accuracy at each evaluation (key None), or a metrics.jsonl key's moving
    average (smooth)."""
    if key is None:
        return read_accuracies(output_dir)[0]
    points = {r["step"]: r[key] for r in read_metrics(os.path.join(output_dir, "metrics.jsonl")) if key in r}
    steps = sorted(points)
    return dict(zip(steps, smooth(points[step] for step in steps)))


def plot_overlay(groups, path, note=None):
    """Several runs on OVERLAY_PANELS, a colour per label: groups {label: [output_dir, ...]} (the seeds of one
    setting), drawn as the mean over its runs at the steps they share, and with several runs their range (lowest to
    highest) as a band; note: a line under the panels (where and when the runs were made). Returns path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(OVERLAY_PANELS), 1, figsize=(10, 2.4 * len(OVERLAY_PANELS) + 0.4), sharex=True)
    for ax, (title, key) in zip(axes, OVERLAY_PANELS):
        for index, (label, folders) in enumerate(groups.items()):
            runs = [run_series(folder, key) for folder in folders]
            steps = sorted(set.intersection(*(set(run) for run in runs)))
            if not steps:
                continue
            values = list(zip(*([run[step] for step in steps] for run in runs)))  # [step][run]
            seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
            marker = dict(marker="o", markersize=3) if key is None else {}
            ax.plot(steps, [sum(v) / len(v) for v in values], color=f"C{index}", label=label + seeds, **marker)
            if len(runs) > 1:
                ax.fill_between(
                    steps, [min(v) for v in values], [max(v) for v in values], color=f"C{index}", alpha=0.15
                )
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:  # one legend, outside the axes, right
        axes[0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axes[-1].set_xlabel("update step")
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="gray", va="bottom")
    return save_figure(fig, path)


def draw_series(ax, points, label, color):
    """A per-step series: the raw values faint, their moving average solid and labelled."""
    steps = sorted(points)
    values = [points[s] for s in steps]
    if len(steps) < 10:  # too short to smooth: the points themselves
        ax.plot(steps, values, color=color, marker=".", label=label)
        return
    ax.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
    ax.plot(steps, list(solid_line(points).values()), color=color, linewidth=1.8, label=f"{label} (moving avg)")


def solid_line(points):
    """{step: value} of the line draw_series draws solid: the moving average (the points of a short series)."""
    steps = sorted(points)
    values = [points[s] for s in steps]
    return dict(zip(steps, values if len(steps) < 10 else smooth(values)))


def coinciding(lines, tolerance=0.01):
    """{label: points} with series whose solid lines coincide (at every step within tolerance times the panel's span
    of values: closer than a line is wide) drawn once, under one label that says so ("digit_reward = mark_reward
    (within 0.016)"): drawn apart, one would hide the others."""
    solid = {label: solid_line(points) for label, points in lines.items()}
    values = [value for line in solid.values() for value in line.values()]
    close = tolerance * (max(values) - min(values)) if values else 0.0
    groups = []  # [[labels], solid line, the largest gap in the group], in the order of lines
    for label, line in solid.items():
        for group in groups:
            gap = largest_gap(line, group[1])
            if gap is not None and gap <= close:
                group[0].append(label)
                group[2] = max(group[2], gap)
                break
        else:
            groups.append([[label], line, 0.0])
    said = lambda gap: " (equal)" if gap == 0 else f" (within {gap:.2g})"  # noqa: E731
    return {" = ".join(names) + (said(gap) if len(names) > 1 else ""): lines[names[0]] for names, _, gap in groups}


def largest_gap(a, b):
    """max |a - b| over two series of the same steps; None when their steps differ (or they are empty)."""
    return max(abs(a[step] - b[step]) for step in a) if a and a.keys() == b.keys() else None


def draw_accuracy(ax, accuracy, label, color, second=False):
    """The evaluations as markers joined by a line, the first and last value written next to them. second: the
    second series, dashed with hollow markers and its values under the points, so that where the two are equal
    both show and neither's labels cover the other's."""
    if not accuracy:
        if not second:
            ax.text(0.5, 0.5, "no evaluation yet", transform=ax.transAxes, ha="center", va="center", color="gray")
        return
    steps = sorted(accuracy)
    values = [accuracy[s] for s in steps]
    style = dict(linestyle="--", marker="s", markerfacecolor="none", markersize=8) if second else dict(marker="o")
    ax.plot(steps, values, color=color, linewidth=1.8, label=label, **({"markersize": 5} | style))
    ax.set_ylim(-0.02, 1.02)
    dy = -12 if second else 6
    ax.annotate(f"{values[0]:.2f}", (steps[0], values[0]), textcoords="offset points", xytext=(4, dy), fontsize=8)
    if len(steps) > 1:
        end = (steps[-1], values[-1])
        ax.annotate(f"{values[-1]:.2f}", end, textcoords="offset points", xytext=(-10, dy), fontsize=8, ha="right")
