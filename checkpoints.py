"""Checkpoints that resume a run exactly: save, find, load, and cut the logs back to the checkpoint's step."""

import contextlib
import dataclasses
import json
import os
import shutil

import torch
from transformers import AutoModelForCausalLM

from curves import read_jsonl

TRAINER_STATE = "trainer_state.pt"  # in the newest checkpoint: optimizer, scheduler, loop state, RNG
ARGS_FILE = "dapo_args.json"  # in each checkpoint: the DapoArguments used
LOG_FILES = ("training_losses.txt", "accuracy_losses.txt", "metrics.jsonl", "samples.jsonl")  # in output_dir


def checkpoint_path(output_dir, step):
    return os.path.join(output_dir, f"checkpoint_{step}")


def save_checkpoint(trainer):
    """output_dir/checkpoint_N: model, tokenizer, optimizer, scheduler, loop position, RNG, arguments.

    Written at a step end to checkpoint_N.tmp and renamed into place, so a crash never leaves a
    complete-looking half checkpoint.
    """
    final = checkpoint_path(trainer.args.output_dir, trainer.state.update_steps)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    trainer.model.save_pretrained(tmp)
    trainer.tokenizer.save_pretrained(tmp)
    cuda_rng = torch.cuda.get_rng_state_all() if trainer.args.device.startswith("cuda") else []
    trainer_state = {"optimizer": trainer.optimizer.state_dict(), "scheduler": trainer.scheduler.state_dict()}
    trainer_state.update(loop=trainer.state.state_dict(), rng=torch.get_rng_state(), cuda_rng=cuda_rng)
    torch.save(trainer_state, os.path.join(tmp, TRAINER_STATE))
    with open(os.path.join(tmp, ARGS_FILE), "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(trainer.args), f, indent=2)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    # Only the newest checkpoint keeps the trainer state (a 1.5B model's Adam states are 12 GB).
    out, limit = trainer.args.output_dir, trainer.args.save_total_limit
    older = sorted(step for step in find_checkpoints(out) if step != trainer.state.update_steps)
    for step in older:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(checkpoint_path(out, step), TRAINER_STATE))
    for step in older[: max(0, len(older) + 1 - limit)] if limit else []:
        shutil.rmtree(checkpoint_path(out, step))
    return final


def resume(trainer, checkpoint):
    """Continue from a checkpoint: weights, optimizer, scheduler, loop position and RNG; the logs
    in output_dir are cut back to its step so that no line is written twice."""
    saved = torch.load(os.path.join(checkpoint, TRAINER_STATE), map_location=trainer.args.device, weights_only=True)
    trainer.model.load_state_dict(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict())
    trainer.optimizer.load_state_dict(saved["optimizer"])
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.state.load_state_dict(saved["loop"])
    torch.set_rng_state(saved["rng"].cpu())
    if saved["cuda_rng"]:
        torch.cuda.set_rng_state_all([s.cpu() for s in saved["cuda_rng"]])
    trainer.resumed = True
    step, out = trainer.state.update_steps, trainer.args.output_dir
    # training_losses lines carry the steps finished *before* their micro-step; the others, their step.
    cut_log(os.path.join(out, LOG_FILES[0]), lambda line: int(line.split(",")[0]) < step)
    cut_log(os.path.join(out, LOG_FILES[1]), lambda line: int(line.split(",")[0]) <= step)
    for name in LOG_FILES[2:]:
        cut_log(os.path.join(out, name), lambda line: json.loads(line)["step"] <= step)
    trainer.history = read_jsonl(os.path.join(out, "metrics.jsonl"))


def cut_log(path, keep):
    """Rewrite a log keeping the lines for which keep(line) holds (atomically: tmp file + rename)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and keep(line)]
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


def find_checkpoints(output_dir):
    """The step numbers of output_dir/checkpoint_N folders."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return [int(name[11:]) for name in names if name.startswith("checkpoint_") and name[11:].isdigit()]


def find_checkpoint(resume, output_dir):
    """--resume=output/checkpoint_N, or --resume=latest: the newest one in output_dir."""
    if resume == "latest":
        if not find_checkpoints(output_dir):
            raise FileNotFoundError(f"no checkpoint to resume in {output_dir!r}")
        resume = os.path.join(output_dir, f"checkpoint_{max(find_checkpoints(output_dir))}")
    if not os.path.isfile(os.path.join(resume, TRAINER_STATE)):
        raise FileNotFoundError(
            f"{resume!r} is not a checkpoint folder to resume from (no {TRAINER_STATE} in it; only the newest checkpoint keeps one)"
        )
    return resume
