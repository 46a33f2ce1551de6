"""python train.py --ablation [--demo] [--seeds=42,1,2] [--variants] [--jobs=N] [--field=value ...]: the DAPO
paper's Table 1 on this setting, naive GRPO to DAPO rung by rung (presets.ladder), with --variants the GRPO family
beside it (presets.VARIANTS), every run once per seed, with the same --field=value overrides (docs/ablation.md).

Each run is a `python train.py --preset=RUNG --seed=S --output_dir=OUT/RUNG/seed_S ...` of its own, a subprocess of
this interpreter (memory and threads start clean; on a CPU, with one thread a run, a core each runs at once). In
output_dir (default ./output/ablation), beside the runs' folders:

    world/              --demo: the demo's world (data, tokenizer, warmed-up model), built once for every run
    SETTINGS            the --field=value settings of every run: a later command with others is refused
    RUNG/seed_S.log     the run's output
    RUNG/seed_S/RESULT  what the tables read of a finished run (run_result): a run that has it is not run again,
                        so that the same command continues an interrupted ladder (a run with checkpoints resumes)
    ablation.json       {rung: {seed: RESULT}} and the settings, seeds, date, commit and machine
    ablation.md         a row per rung: mean +- standard deviation over the seeds, the difference to the rung below
    ablation.png        held-out accuracy, reward, entropy and response length against step: a colour per rung,
                        the seeds' range as a band (curves.plot_overlay)
"""

import concurrent.futures
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import date
from statistics import fmean, stdev

from dapo_utils import tiny_world
from dapo_utils.checkpoints import find_checkpoints
from dapo_utils.curves import plot_overlay, read_accuracies, read_metrics
from dapo_utils.presets import VARIANTS, ladder
from dapo_utils.run_dir import earlier_run, hold_output_dir
from dapo_utils.writes import writing

LADDER_DIR = os.path.join(".", "output", "ablation")
RESULT = "ablation_run.json"  # in a finished run's folder
SETTINGS = "ablation_settings.json"  # in output_dir: the settings every run of the ladder shares
# The demo's settings, but a length budget that responses can reach: an answer takes 13 tokens (15 when it has two
# digits), so that the soft punishment (L_cache 16 // 5 = 3) starts past a one-digit answer and a response that
# rambles is cut at 16 (overlong filtering); at the demo's 20 neither ever acts.
DEMO_LADDER = dict(max_generate_length=16)


def planned_runs(max_generate_length, variants):
    """[(preset, label, paper's section, AIME 2024 of Table 1 or None, the preset it is measured against)]."""
    rungs = [(name, label, where, aime) for name, label, where, aime, _ in ladder(max_generate_length)]
    runs = [(*rung, rungs[i - 1][0] if i else None) for i, rung in enumerate(rungs)]
    return runs + [(name, label, where, None, "grpo") for name, (label, where, _) in VARIANTS.items()] * variants


def parse_seeds(text):
    try:
        seeds = [int(seed) for seed in text.split(",")]
    except ValueError:
        sys.exit(f"error: --seeds={text!r}: give whole numbers separated by commas, e.g. --seeds=42,1,2")
    return list(dict.fromkeys(seeds))


def as_flags(settings):
    """{field: value} as train.py's --field=value arguments (booleans true/false, lists comma-separated)."""

    def text(value):
        if isinstance(value, bool):
            return str(value).lower()
        return ",".join(map(str, value)) if isinstance(value, list) else value

    return [f"--{key}={text(value)}" for key, value in settings.items()]


def cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def check_same_settings(out, settings):
    """The runs of one ladder share their settings: the first command records them in out/SETTINGS, and a later one
    with other settings is refused in one line (its runs would sit beside the others' in one table)."""
    path = os.path.join(out, SETTINGS)
    if not os.path.exists(path):
        with writing("the ladder's settings", path), open(path, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=1, ensure_ascii=False)
        return
    with open(path, encoding="utf-8") as f:
        recorded = json.load(f)
    changed = sorted(key for key in recorded.keys() | settings.keys() if recorded.get(key) != settings.get(key))
    if changed:
        sys.exit(
            f"error: {out!r} holds a ladder of other settings ({', '.join(changed)}; see {path}): give the same ones "
            "to continue it, or another --output_dir"
        )


def run_ablation(cli, given, build_args, script):
    """Run the ladder (cli: parse_cli's modes; given: the --field=value overrides; build_args: train.py's, to check
    every run's settings before any starts; script: train.py). Returns {preset: {seed: result}} of finished runs."""
    seeds, out = parse_seeds(cli.seeds), given.get("output_dir", LADDER_DIR)
    settings = {**(dict(tiny_world.DEMO_ARGS, **DEMO_LADDER) if cli.demo else {}), **given}
    settings.pop("output_dir", None)
    base = build_args("seed", settings)
    runs = planned_runs(base.max_generate_length, cli.variants)
    try:
        for preset, *_ in runs:
            build_args(preset, settings)  # each rung's settings valid before any run starts
    except ValueError as error:
        sys.exit(f"error: {error}")
    jobs = cli.jobs or (max(1, cores() // (base.num_threads or cores())) if base.device == "cpu" else 1)
    with hold_output_dir(out, cli.take_over_lock, resuming=True):  # one ladder in the folder
        if cli.demo:
            settings["model_path"], settings["data_path"] = demo_world(out, base.system_prompt)
        check_same_settings(out, settings)
        started, load = time.perf_counter(), os.getloadavg()[0]  # the commit the runs start from
        machine = dict(date=date.today().isoformat(), commit=git_commit(), device=device_name(base.device))
        todo = [(run, seed) for run in runs for seed in seeds if not finished(out, run[0], seed)]
        done = len(runs) * len(seeds) - len(todo)
        print(f"ablation: {len(runs)} presets x {len(seeds)} seeds in {out}, {done} done before; {jobs} at a time")
        failed = run_all(todo, out, settings, script, jobs, dict(date=machine["date"], commit=machine["commit"]))
        results = {run[0]: read_results(out, run[0], seeds) for run in runs}
        machine |= dict(load_average=[load, os.getloadavg()[0]], wall_seconds=time.perf_counter() - started)
        table = write_reports(out, runs, seeds, results, settings, machine)
    print(table)
    print(f"wrote {out}/ablation.json, ablation.md and ablation.png")
    if failed:
        logs = ", ".join(run_log(out, preset, seed) for preset, seed in failed)
        sys.exit(f"error: {len(failed)} run(s) failed (their output: {logs}); the same command runs them again")
    return results


def demo_world(out, system_prompt):
    """The demo's world in out/world, built once (into a temporary folder, then renamed: a ladder interrupted while
    building it builds it again). Returns (model_dir, data_dir)."""
    world = os.path.join(out, "world")
    if not os.path.isdir(world):
        building = world + ".building"
        tiny_world.build_tiny_world(building, system_prompt, warm_up_steps=tiny_world.DEMO_WARM_UP_STEPS)
        os.replace(building, world)
    return os.path.join(world, "tiny-qwen2"), os.path.join(world, "gsm8k_tiny")


def run_folder(out, preset, seed):
    return os.path.join(out, preset, f"seed_{seed}")


def run_log(out, preset, seed):
    return run_folder(out, preset, seed) + ".log"


def finished(out, preset, seed):
    return os.path.isfile(os.path.join(run_folder(out, preset, seed), RESULT))


def run_command(out, preset, seed, settings, script):
    """The run's command line: a fresh run, or one that continues an interrupted attempt (from its newest checkpoint;
    without one, from the start, over its logs)."""
    folder = run_folder(out, preset, seed)
    command = [sys.executable, script, f"--preset={preset}", f"--seed={seed}", f"--output_dir={folder}"]
    if find_checkpoints(folder):
        return command + as_flags(settings) + ["--resume=latest"]
    again = ["--overwrite_output_dir=true", "--take_over_lock"] if earlier_run(folder) else []
    return command + as_flags(settings) + again


def run_all(todo, out, settings, script, jobs, stamp):
    """Run each (run, seed) of todo, jobs at a time; a finished one gets its RESULT, with stamp (the date and commit
    it ran at). Returns the failed (preset, seed)."""

    def run_one(preset, seed):
        os.makedirs(os.path.join(out, preset), exist_ok=True)
        start = time.perf_counter()
        with open(run_log(out, preset, seed), "a", encoding="utf-8") as log:
            code = run_process(run_command(out, preset, seed, settings, script), log)
        return code, time.perf_counter() - start

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run_one, run[0], seed): (run[0], seed) for run, seed in todo}
        for count, future in enumerate(concurrent.futures.as_completed(futures), 1):
            (preset, seed), (code, seconds) = futures[future], future.result()
            if code == 0:
                result = run_result(run_folder(out, preset, seed)) | {"wall_seconds": seconds} | stamp
                with writing("the run's result", os.path.join(run_folder(out, preset, seed), RESULT)):
                    with open(os.path.join(run_folder(out, preset, seed), RESULT), "w", encoding="utf-8") as f:
                        json.dump(result, f, indent=1)
                outcome = f"held-out {result['start_accuracy']:.2f} -> {result['final_accuracy']:.2f}"
            else:
                failed.append((preset, seed))
                outcome = f"failed (exit code {code}): {run_log(out, preset, seed)}"
            print(f"[{count}/{len(todo)}] {preset} seed {seed}: {outcome}, {seconds:.0f} s", flush=True)
    return failed


def run_process(command, log):
    """Run one command to its end, its output to the open file log; returns its exit code."""
    return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode


def run_result(folder):
    """What the tables say of one finished run, from its logs: held-out strict accuracy (first, last, best), mean
    response length and share truncated (sampled responses, whole run), entropy at the end (the mean over the last
    tenth of the steps), clip fraction (tokens clipped below or above, mean over steps), skipped groups, training
    seconds (the steps' time/step: sampling to optimizer step, no evaluation), tokens per second and MFU over them."""
    accuracy = read_accuracies(folder)[0]  # {step: strict}
    records = read_metrics(os.path.join(folder, "metrics.jsonl"))

    def mean(key, of=records):
        values = [r[key] for r in of if key in r]
        return fmean(values) if values else float("nan")

    seconds = sum(r["time/step"] for r in records)
    tokens = sum(r.get("sampled_tokens", 0) + r.get("num_tokens", 0) for r in records)
    return dict(
        steps=records[-1]["step"],
        start_accuracy=accuracy[min(accuracy)],
        final_accuracy=accuracy[max(accuracy)],
        best_accuracy=max(accuracy.values()),
        mean_response_length=mean("completions/mean_length"),
        truncated=mean("completions/clipped_ratio"),
        final_entropy=mean("entropy", records[-max(1, len(records) // 10) :]),
        clip_fraction=fmean(r.get("clip_ratio/low_mean", 0) + r.get("clip_ratio/high_mean", 0) for r in records),
        skipped_groups=records[-1]["skipped_groups"],
        train_seconds=seconds,
        tokens_per_second=tokens / seconds,
        mfu=sum(r["perf/mfu"] * r["time/step"] for r in records) / seconds,
    )


def read_results(out, preset, seeds):
    results = {}
    for seed in seeds:
        if finished(out, preset, seed):
            with open(os.path.join(run_folder(out, preset, seed), RESULT), encoding="utf-8") as f:
                results[seed] = json.load(f)
    return results


# (key of run_result, column title, format) of ablation.md's table
COLUMNS = [
    ("final_accuracy", "held-out accuracy", "{:.3f}"),
    ("best_accuracy", "best", "{:.3f}"),
    ("mean_response_length", "length", "{:.1f}"),
    ("truncated", "truncated", "{:.3f}"),
    ("final_entropy", "entropy (end)", "{:.3f}"),
    ("clip_fraction", "clipped", "{:.4f}"),
    ("skipped_groups", "skipped groups", "{:.0f}"),
    ("train_seconds", "train s", "{:.0f}"),
    ("tokens_per_second", "tok/s", "{:.0f}"),
    ("mfu", "MFU", "{:.2%}"),
]


def spread(values, style):
    """'mean ± std' over seeds ('mean' for one seed); '-' for none (a metric a run does not log is NaN)."""
    values = [value for value in values if not math.isnan(value)]
    if not values:
        return "-"
    text = style.format(fmean(values))
    return text + f" ± {style.format(stdev(values))}" if len(values) > 1 else text


def table(runs, results):
    """ablation.md's table: a row per preset, mean +- std over its seeds; the difference of the mean held-out
    accuracy to the rung below (a variant: to naive GRPO)."""
    head = ["preset", "technique", "paper §", "AIME 2024 (paper)", "Δ accuracy"] + [title for _, title, _ in COLUMNS]
    rows = [head, ["---"] * len(head)]
    means = {p: fmean(r["final_accuracy"] for r in results[p].values()) for p, *_ in runs if results[p]}
    for preset, label, where, aime, below in runs:
        delta = f"{means[preset] - means[below]:+.3f} vs {below}" if below in means and preset in means else "-"
        cells = [spread([r[key] for r in results[preset].values()], style) for key, _, style in COLUMNS]
        rows.append([f"`{preset}`", label, where, "-" if aime is None else str(aime), delta, *cells])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def write_reports(out, runs, seeds, results, settings, machine):
    """ablation.json, ablation.md and ablation.png in out. Returns the table."""
    markdown = table(runs, results)
    command = " ".join(["python train.py --preset=PRESET --seed=SEED", *as_flags(settings)])
    counts = ", ".join(f"{preset} {len(results[preset])}" for preset, *_ in runs)
    made = sorted({f"{r['date']}, commit {r['commit']}" for by_seed in results.values() for r in by_seed.values()})
    note = f"runs of {'; '.join(made)}; {machine['device']}; seeds {','.join(map(str, seeds))}"
    lines = [
        f"# Ablation: {', '.join(p for p, *_ in runs)}",
        "",
        f"{note[0].upper()}{note[1:]}. This command: {machine['date']}, commit {machine['commit']}, load average "
        f"{machine['load_average'][0]:.1f} at the start, {machine['load_average'][1]:.1f} at the end.",
        f"Finished runs per preset: {counts}; {machine['wall_seconds'] / 60:.0f} min wall for the runs of this command.",
        f"Each run: `{command}`.",
        "",
        markdown,
        "",
        "Mean ± standard deviation over the seeds. held-out accuracy: strict, at the last evaluation; length and "
        "truncated: sampled responses, whole run; entropy: the last tenth of the steps; clipped: share of trained "
        "tokens the clip held; train s: the steps' time (sampling to optimizer step, no evaluation); tok/s: sampled "
        "and trained response tokens per train second; MFU: model FLOPs per train second over the device's peak.",
        "",
        "![ablation.png](ablation.png)",
    ]
    report = dict(machine=machine, seeds=seeds, settings=settings, runs=results)
    with writing("the ablation's report", out):
        with open(os.path.join(out, "ablation.json"), "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1, ensure_ascii=False)
        with open(os.path.join(out, "ablation.md"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    groups = {
        f"{preset} ({label})": [run_folder(out, preset, s) for s in results[preset]] for preset, label, *_ in runs
    }
    groups = {label: folders for label, folders in groups.items() if folders}
    plot_overlay(groups, os.path.join(out, "ablation.png"), note=note)
    return markdown


def git_commit():
    """The checkout's commit (short), '+ changes' when it has uncommitted ones; 'unknown' outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return (commit.stdout.strip() or "unknown") + (" + changes" if dirty.strip() else "")


def device_name(device):
    """'NVIDIA H100 80GB HBM3' or the CPU's model name and core count."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device)
    model = platform.processor() or "CPU"
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    return f"{model}, {len(os.sched_getaffinity(0))} cores"
