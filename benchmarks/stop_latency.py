#!/usr/bin/env python
"""What a stop costs: SIGTERM at random moments of a run, the seconds from the signal to the process's exit (the
checkpoint written), and where the run was (read back from the stop's checkpoint).

    python train.py --demo                      # once: builds the demo's world in ./output/demo
    python benchmarks/stop_latency.py [--trials 8] [--model_path output/demo/tiny-qwen2 --data_path output/demo/gsm8k_tiny]

Each trial starts `python train.py` on the demo's world with the demo's settings, evaluating all 200 test problems
every 5 steps in batches of 20 (so that signals land in evaluations too), waits for its first step record and a
random delay, sends SIGTERM and times the exit. The phase comes from the checkpoint's loop state: an evaluation
that was stopped (evaluation_pending), a stop while sampling (the step's metrics so far kept), or a step's end.
The grace a scheduler must give is the largest latency: at most the rest of a step, one evaluation batch or one
sampling call, plus the checkpoint's write.
"""

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from dapo_utils.checkpoints import TRAINER_STATE, find_checkpoints  # noqa: E402
from dapo_utils.tiny_world import DEMO_ARGS  # noqa: E402


def trial(argv, out, delay):
    """(phase, latency in s, checkpoint step, steps logged when signalled) of one run stopped `delay` s after its
    first step record."""
    log = open(os.path.join(out, "run.log"), "w")
    process = subprocess.Popen([sys.executable, "train.py", *argv, f"--output_dir={out}"], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    records = os.path.join(out, "metrics.jsonl")
    while not (os.path.exists(records) and os.path.getsize(records)):
        if process.poll() is not None:
            sys.exit(f"the run ended before its first step: {open(log.name).read()[-2000:]}")
        time.sleep(0.05)
    time.sleep(delay)
    with open(records) as f:
        logged = len(f.read().splitlines())
    sent = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    status = process.wait()
    latency = time.perf_counter() - sent
    step = max(find_checkpoints(out))
    loop = torch.load(os.path.join(out, f"checkpoint_{step}", TRAINER_STATE), weights_only=True)["loop"]
    phase = "evaluation" if loop["evaluation_pending"] else "sampling" if loop["metrics"] else "step end"
    assert status == 130, f"exit status {status}: {open(log.name).read()[-2000:]}"
    return phase, latency, step, logged


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_path", default="output/demo/tiny-qwen2")
    parser.add_argument("--data_path", default="output/demo/gsm8k_tiny")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()
    settings = {key: value for key, value in DEMO_ARGS.items() if key != "output_dir"}  # each trial's own
    settings |= dict(model_path=os.path.abspath(cli.model_path), data_path=os.path.abspath(cli.data_path))
    settings |= dict(max_steps=200, eval_steps=5, eval_samples=200, eval_batch_size=20, save_steps=1000)
    argv = [f"--{key}={value}" for key, value in settings.items()]
    draw = random.Random(cli.seed)
    print("| trial | signal after the first step record | phase | steps logged then | checkpoint | exit after |")
    print("| --- | --- | --- | --- | --- | --- |")
    latencies = []
    for number in range(cli.trials):
        delay = draw.uniform(0, 3)
        with tempfile.TemporaryDirectory() as out:
            phase, latency, step, logged = trial(argv, out, delay)
        latencies.append(latency)
        print(f"| {number + 1} | {delay:.2f} s | {phase} | {logged} | checkpoint_{step} | {latency:.2f} s |")
    print(f"exit after SIGTERM: median {statistics.median(latencies):.2f} s, max {max(latencies):.2f} s")
    print(json.dumps({"median_s": statistics.median(latencies), "max_s": max(latencies)}))


if __name__ == "__main__":
    main()
