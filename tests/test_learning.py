"""The tiny world learns a skill that carries: `python train.py --demo`'s run, checked by numbers."""

import os
import re

import torch

import train
from dapo_utils.curves import read_step_log
from dapo_utils.options import python_command
from dapo_utils.tiny_world import DEMO_NUM_TEST, demo_summary
from train import main


def test_demo_held_out_accuracy_climbs_in_160_steps(tmp_path, capsys):
    # The demo's setting: synthetic Chinese +/- problems, held-out phrasings, a noisy warm-up (mode
    # right, samples right ~1 time in 4), lr 3e-4, 8 prompts x G 8 per step, 20-token responses,
    # seed 42, one torch thread, 160 update steps, all 200 test problems evaluated every 20 steps by `evaluate`.
    trainer = main(["--demo", f"--output_dir={tmp_path / 'demo'}"])
    args = trainer.args
    settings = (args.lr, args.num_generations, args.batch_size, args.max_generate_length, args.max_steps, args.seed)
    assert settings == (3e-4, 8, 4, 20, 160, 42) and args.num_threads == 1 == torch.get_num_threads()
    assert args.eval_samples >= DEMO_NUM_TEST == len(trainer.eval_dataset) == 200  # every test problem
    assert trainer.update_steps == 160 and len(trainer.history) == 160
    accuracy = read_step_log(os.path.join(args.output_dir, "accuracy_losses.txt"))
    assert sorted(accuracy) == list(range(0, 161, 20))
    first, last = accuracy[0], accuracy[160]
    with capsys.disabled():  # shown in every run of the suite: how close this CPU came to the threshold
        print(
            f"\n  demo held-out accuracy {first:.2f} -> {last:.2f}: {last - first:+.2f}, margin {last - first - 0.30:+.2f}"
        )
    assert last - first >= 0.30, accuracy  # held-out accuracy climbs
    rewards = [record["rewards/correctness_reward/mean"] for record in trainer.history]
    assert sum(rewards[-32:]) / 32 - sum(rewards[:32]) / 32 >= 0.3  # and the training reward (2.0 per right answer)
    with open(os.path.join(args.output_dir, "training_losses.txt")) as f:
        assert len(f.read().splitlines()) == 320  # one line per micro-step, 2 per update
    printed = capsys.readouterr().out.splitlines()  # the summary: the climb, then the next steps on its folders
    assert any(line.startswith(f"  held-out accuracy  step 0 {first:.2f}  ->  step 160 {last:.2f}") for line in printed)
    assert re.fullmatch(r"  wall time: \d+ min \d\d s, the world's construction and warm-up included", printed[-8])
    command = python_command(train.__file__)  # the interpreter that ran: the commands run, venv activated or not
    assert printed[-7:] == demo_summary(trainer.history, args, 0, command=command).splitlines()[-7:]
    assert printed[-1] == f"  {command} --demo --resume=latest --output_dir={args.output_dir} --max_steps=320"
