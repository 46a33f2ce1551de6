"""What a checkpoint carries of the loop, compared field by field after a real save and resume: the groups sampled
but not yet trained are the next steps' data, and a resume that lost or altered them would train on others."""

import dataclasses
import os

import torch

from dapo_utils.checkpoints import resume


def same_group(a, b):
    """Every field of two Samples equal: tensors to the bit, the rest by value."""
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if not (torch.equal(x, y) if torch.is_tensor(x) else x == y):
            return False
    return True


def test_the_buffered_groups_survive_a_checkpoint_whole(make_trainer, tmp_path):
    # 6 groups sampled at once (filter off: all kept), 4 make the rollout of 2 steps, 2 wait in the buffer
    settings = dict(max_steps=1, save_steps=1, eval_steps=100, steps_per_generation=2, generation_batch_size=6)
    trainer = make_trainer(filter_metric="none", **settings)
    trainer.train()
    buffered = trainer.state.buffer
    assert len(buffered) == 2 and all(group.advantages is not None for group in buffered)
    resumed = make_trainer(filter_metric="none", **settings)
    resume(resumed, os.path.join(trainer.args.output_dir, "checkpoint_1"))
    assert [group.index for group in resumed.state.buffer] == [group.index for group in buffered]
    assert all(same_group(a, b) for a, b in zip(resumed.state.buffer, buffered))
