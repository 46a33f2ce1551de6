"""The tiny world learns: `python train.py --demo`'s run, checked by numbers."""

import os

from tiny_world import demo_summary
from train import main


def test_demo_learns_in_300_steps(tmp_path):
    # The setting: synthetic Chinese +/- problems, ~120-token BPE, 2-layer hidden-64 Qwen2,
    # lr 1e-3, num_generations 8, max_generate_length 32, seed 42, 300 update steps.
    trainer = main(["--demo", f"--output_dir={tmp_path / 'demo'}", "--eval_steps=100"])
    args = trainer.args
    assert (args.lr, args.num_generations, args.max_generate_length, args.max_steps, args.seed) == (
        1e-3,
        8,
        32,
        300,
        42,
    )
    rewards = [record["reward"] for record in trainer.history]
    assert trainer.update_steps == 300 and len(rewards) == 300
    first, last = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    assert last - first >= 0.15, (first, last)
    with open(os.path.join(args.output_dir, "training_losses.txt")) as f:
        assert len(f.read().splitlines()) == 600  # one line per micro-step, 2 per update
    assert f"{first:.3f}  ->  last 50 steps {last:.3f}" in demo_summary(trainer.history, args.output_dir)
