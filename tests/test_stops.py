"""Stops that come at once and resume exactly: Ctrl-C or SIGTERM before, during and after a multi-batch evaluation,
during a checkpoint write and between sampling rounds ends with the checkpoint of the last finished step (no extra
step), and --resume=latest then ends where the uninterrupted run did, logs included. The printed commands that
follow a stop run as printed, from a shell without the venv."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import train
from dapo_utils.checkpoints import find_checkpoints
from dapo_utils.options import python_command, run_command
from test_newcomer import ROOT, paste, printed_commands
from test_observability import comparable, outputs, read

# 6 of the 8 test problems a random subset (torch.randperm on the training stream), in 3 batches of 2.
SETTINGS = dict(max_steps=4, eval_steps=2, save_steps=2, eval_samples=6, eval_batch_size=2)
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)  # a real signal: deferred_interrupts' handler sets stop_requested


def during_evaluation(trainer, step, monkeypatch):
    """Ctrl-C as step `step`'s evaluation answers its second batch of problems."""
    calls, respond = [], trainer.respond

    def respond_then_stop(*args, **kwargs):
        if trainer.update_steps == step:
            calls.append(1)
            if len(calls) == 2:
                ctrl_c()
        return respond(*args, **kwargs)

    monkeypatch.setattr(trainer, "respond", respond_then_stop)


def before_evaluation(trainer, step, monkeypatch):
    """Ctrl-C during step `step`'s optimizer step: the step ends, its evaluation stops before its first batch."""
    optimizer_step = trainer.optimizer.step
    monkeypatch.setattr(
        trainer.optimizer, "step", lambda: (trainer.update_steps == step - 1 and ctrl_c(), optimizer_step())
    )


def during_the_write(trainer, step, monkeypatch):
    """Ctrl-C as step `step`'s checkpoint is written (after its evaluation): that checkpoint is the stop's."""
    save = train.save_run_checkpoint
    monkeypatch.setattr(train, "save_run_checkpoint", lambda t: (t.update_steps == step and ctrl_c(), save(t))[1])


def while_sampling(trainer, step, monkeypatch):
    """Ctrl-C during the first sampling round after step `step`: the rollout of step + 1 is kept, no step begun."""
    sample_round = trainer.sample_round
    monkeypatch.setattr(
        trainer, "sample_round", lambda b: (trainer.update_steps == step and ctrl_c(), sample_round(b))[1]
    )


STOPS = [  # (where, the hook, the step the stop's checkpoint holds, the steps metrics.jsonl then holds)
    ("during step 0's evaluation", during_evaluation, 0, 0),
    ("before step 2's evaluation", before_evaluation, 2, 1),  # step 2 is logged with its evaluation, on resume
    ("during step 2's evaluation", during_evaluation, 2, 1),
    ("during step 2's checkpoint write", during_the_write, 2, 2),
    ("between step 2 and step 3's sampling", while_sampling, 2, 2),
]


def test_a_stop_anywhere_ends_at_the_last_finished_step_and_resumes_to_the_uninterrupted_run(
    make_trainer, tmp_path, monkeypatch, capsys
):
    reference = make_trainer(output_dir=str(tmp_path / "reference"), **SETTINGS)
    reference.train()
    evaluations = read(os.path.join(reference.args.output_dir, "evaluations.jsonl"))
    assert len(evaluations.splitlines()) == 3  # steps 0, 2, 4, each over 6 problems in 3 batches
    for number, (where, hook, step, logged) in enumerate(STOPS):
        out = str(tmp_path / f"stopped_{number}")
        trainer = make_trainer(output_dir=out, **SETTINGS)
        with monkeypatch.context() as patch:
            hook(trainer, step, patch)
            with pytest.raises(KeyboardInterrupt):
                trainer.train()
        assert trainer.update_steps == step and max(find_checkpoints(out)) == step, where  # no extra step
        printed = capsys.readouterr().out
        assert f"stopped; continue with: {run_command()} --resume={out}/checkpoint_{step}" in printed, where
        records = os.path.join(out, "metrics.jsonl")
        steps = [json.loads(line)["step"] for line in read(records).splitlines()] if os.path.exists(records) else []
        assert steps == list(range(1, logged + 1)), where
        resumed = train.main(["--resume=latest", f"--output_dir={out}"])
        assert resumed.update_steps == 4, where
        for name, value in reference.model.state_dict().items():
            assert torch.equal(value, resumed.model.state_dict()[name]), (where, name)
        assert outputs(out) == outputs(reference.args.output_dir), where  # losses, accuracies, samples
        assert read(os.path.join(out, "evaluations.jsonl")) == evaluations, where
        assert comparable(resumed.history) == comparable(reference.history), where


def test_the_stop_line_of_a_demo_and_the_summary_of_a_torchrun_fsdp_demo_run_as_printed(tmp_path, monkeypatch):
    """`.venv/bin/python train.py --demo` stopped by SIGTERM prints a command that, pasted into a shell without the
    venv, resumes the demo as a demo (its summary at the end); a 2-process --fsdp demo under torch's launcher prints a
    resume line with the launcher, the same process count and --demo, which runs as pasted too."""
    monkeypatch.chdir(ROOT)  # where the commands are printed and pasted
    demo = tmp_path / "demo"
    command = [sys.executable, "train.py", "--demo", f"--output_dir={demo}", "--max_steps=40", "--save_steps=100"]
    with open(tmp_path / "demo.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while not (demo / "metrics.jsonl").exists() or len(read(demo / "metrics.jsonl").splitlines()) < 3:
            assert process.poll() is None, read(tmp_path / "demo.log")[-3000:]
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=300) == 130
    stopped = re.search(r"stopped; continue with: (.+)", read(tmp_path / "demo.log"))
    assert stopped and stopped.group(1).startswith(f"{python_command()} --demo --resume="), stopped
    result = paste(stopped.group(1))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "demo summary after 40 steps" in result.stdout and "next steps" in result.stdout

    two = tmp_path / "two"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    small = ["--max_steps=2", "--save_steps=2", "--eval_steps=2", "--eval_samples=8", "--eval_batch_size=8"]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    ran = subprocess.run(
        [*launcher, "--demo", "--fsdp", f"--output_dir={two}", *small],
        cwd=ROOT, env=env | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    resume = printed_commands(ran.stdout)[-1]
    assert resume == f"{run_command(2)} --demo --resume=latest --output_dir={two} --max_steps=4"
    result = paste(resume)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "demo summary after 4 steps" in result.stdout
