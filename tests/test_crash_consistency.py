"""Crash-consistent checkpoints (issue 46, item 1): a kill -9 at any instant of save_checkpoint, a rewrite of an
existing checkpoint_N included, leaves a checkpoint that --resume=auto and --resume=latest resume to the
uninterrupted run's weights; files and folders are fsynced before the rename and before an older trainer state
goes; the leftovers of a cut-short write are completed by the lock's next holder."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import train
from checkpoint_killer import COUNTED, recorded
from dapo_utils.checkpoints import TRAINER_STATE, checkpoint_path, complete_interrupted_saves, save_checkpoint
from test_faults import run_args, weights
from train import main

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")

KILLER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_killer.py")
RUN = ("--max_steps=3", "--save_steps=1", "--eval_steps=100")


def recorded_operations(monkeypatch):
    """[name, path] of each fsync, rename, remove and rmtree from here on, in order."""
    operations = []
    for module, name in COUNTED:
        monkeypatch.setattr(module, name, recorded(name, getattr(module, name), operations.append))
    return operations


def test_files_and_folders_are_fsynced_before_the_rename_and_before_an_older_trainer_state_goes(
    make_trainer, monkeypatch
):
    trainer = make_trainer()
    out = trainer.args.output_dir
    trainer.state.update_steps = 1
    save_checkpoint(trainer)
    operations = recorded_operations(monkeypatch)
    trainer.state.update_steps = 2
    new = save_checkpoint(trainer)
    tmp, older_state = new + ".tmp", os.path.join(checkpoint_path(out, 1), TRAINER_STATE)
    files = sorted(os.listdir(new))
    assert TRAINER_STATE in files and "model.safetensors" in files and "checksums.json" in files
    renamed = operations.index(["rename", tmp])
    synced = [path for name, path in operations[:renamed] if name == "fsync"]
    assert sorted(os.path.relpath(path, tmp) for path in synced[:-1]) == files and synced[-1] == tmp
    assert operations[renamed + 1 :] == [["fsync", out], ["rmtree", new + ".old"], ["remove", older_state]]

    operations.clear()  # a rewrite of checkpoint_2: the old one goes aside, and only once the new one is durable
    save_checkpoint(trainer)
    names = [name for name, _ in operations]
    assert operations[names.index("rename") :] == [
        ["rename", new],
        ["rename", tmp],
        ["fsync", out],
        ["rmtree", new + ".old"],
        ["remove", older_state],
    ]
    assert names[: names.index("rename")] == ["rmtree", *["fsync"] * (len(files) + 1)]
    assert not os.path.exists(tmp) and not os.path.exists(new + ".old")


def test_the_leftovers_of_a_cut_short_write_are_completed_or_removed(make_trainer, capsys):
    trainer = make_trainer()
    out = trainer.args.output_dir
    trainer.state.update_steps = 2
    step_2 = save_checkpoint(trainer)
    model = weights(step_2)
    # Killed after the old checkpoint_2 went aside: the complete .tmp goes in place, the .old goes.
    shutil.copytree(step_2, step_2 + ".tmp")
    os.rename(step_2, step_2 + ".old")
    complete_interrupted_saves(out)
    assert sorted(os.listdir(out)) == ["checkpoint_2"]
    assert f"completing the write of {step_2}, which was cut short" in capsys.readouterr().out
    # Killed while writing: an incomplete .tmp (no checksums.json yet) is removed, the .old goes back in place.
    shutil.copytree(step_2, step_2 + ".tmp")
    os.remove(os.path.join(step_2 + ".tmp", "checksums.json"))
    os.rename(step_2, step_2 + ".old")
    complete_interrupted_saves(out)
    assert sorted(os.listdir(out)) == ["checkpoint_2"]
    # A .tmp whose file does not have its sha256 (a torn write) is not complete either.
    shutil.copytree(step_2, step_2 + ".tmp")
    with open(os.path.join(step_2 + ".tmp", "config.json"), "a", encoding="utf-8") as f:
        f.write(" ")
    complete_interrupted_saves(out)
    assert sorted(os.listdir(out)) == ["checkpoint_2"]
    reread = weights(step_2)
    assert all(torch.equal(reread[name], model[name]) for name in model)


def stopped_in_step_2(world, out, monkeypatch):
    """A run of RUN stopped by SIGTERM in its step 2: checkpoint_2 the newest, with the trainer state."""
    train_step = train.DapoTrainer.train_step

    def sigterm_in_step_2(self, *args, **kwargs):
        if self.update_steps == 1 and not self.stop_requested:
            os.kill(os.getpid(), signal.SIGTERM)
        return train_step(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(train.DapoTrainer, "train_step", sigterm_in_step_2)
        with pytest.raises(SystemExit) as stopped:
            main(run_args(world, out, *RUN))
    assert stopped.value.code == 130 and sorted(os.listdir(out / "checkpoint_2")).count(TRAINER_STATE) == 1


def test_a_kill_at_each_file_operation_of_a_checkpoint_write_resumes_to_the_uninterrupted_weights(
    world, tmp_path, monkeypatch
):
    """A real process per kill (tests/checkpoint_killer.py): resumed from checkpoint_2, it is killed with SIGKILL
    before each file operation of its checkpoint_3 (a step's) and, stopped at once, of its rewrite of checkpoint_2.
    Each time --resume=auto and --resume=latest (on a copy) take over the dead lock and end with the weights of
    the uninterrupted run."""
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    main(run_args(world, whole, *RUN))
    stopped_in_step_2(world, stopped, monkeypatch)
    jobs = [
        {"folder": str(tmp_path / "step"), "step": 3, "argv": ["--resume=auto"], "rewrite": False},
        {"folder": str(tmp_path / "rewrite"), "step": 2, "argv": ["--resume=auto"], "rewrite": True},
    ]
    for job in jobs:
        shutil.copytree(stopped, job["folder"])
    done = subprocess.run([sys.executable, KILLER, json.dumps(jobs)], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    step, rewrite = json.loads(done.stdout)
    expected = weights(whole)
    for job, result in zip(jobs, (step, rewrite)):
        final = checkpoint_path(job["folder"] + ".count", job["step"])  # where the operations were counted
        # Every window the rewrite has: the old checkpoint aside, the new one in, the old one removed.
        moves = [operation for operation in result["operations"] if operation[0] in ("rename", "rmtree")]
        aside = [["rename", final]] if job["rewrite"] else []
        assert moves == [["rmtree", final + ".tmp"], *aside, ["rename", final + ".tmp"], ["rmtree", final + ".old"]]
        assert result["signals"] == [signal.SIGKILL] * len(result["operations"])
        for k in range(1, len(result["operations"]) + 1):
            killed = f"{job['folder']}.{k}"
            shutil.copytree(killed, killed + ".latest")
            for resume, folder in (("auto", killed), ("latest", killed + ".latest")):
                main([f"--resume={resume}", f"--output_dir={folder}"])
                final_weights = weights(folder)
                assert all(torch.equal(final_weights[name], expected[name]) for name in expected), (k, resume)
                left = [name for name in os.listdir(folder) if name.endswith((".tmp", ".old", ".lock"))]
                assert left == [], (k, resume)
