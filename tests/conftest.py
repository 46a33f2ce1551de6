"""Shared fixtures: one tiny world (data set, tokenizer, random Qwen2) per test session."""

import os
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dapo_utils.tiny_world import build_tiny_world  # noqa: E402
from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_reward  # noqa: E402
from train import SYSTEM_PROMPT, DapoArguments, DapoTrainer, GSM8KDataset, MicroBatch, pad_and_cat_groups  # noqa: E402

SEED_REWARDS = [correctness_reward, digit_reward, hard_format_reward, mark_reward]
# Small but real: every test that trains uses these unless it says otherwise.
FAST = dict(device="cpu", max_generate_length=12, eval_samples=4, eval_batch_size=4, num_generations=4, lr=1e-3)


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """(model_dir, data_dir) of a tiny world written once per session. Its 120-token vocabulary (the demo's has
    ~280) keeps phrases several tokens long: prompts of several lengths, random responses that hit a tag."""
    root = str(tmp_path_factory.mktemp("world"))
    return build_tiny_world(root, SYSTEM_PROMPT, num_train=32, num_test=8, seed=0, vocab_size=120)


@pytest.fixture(scope="session", autouse=True)
def demo_world_built_once(tmp_path_factory):
    """`--demo` builds its world (a warm-up of ~20-30 s on 2 cores) in each of the five tests that run it. The same
    arguments give the same world to the bit, so the session builds it once and copies the files: the demo's own
    code (main, demo_world and its folder checks) still runs in every test."""
    from dapo_utils import tiny_world

    build, built = tiny_world.build_tiny_world, {}

    def build_once(root, *args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in built:
            source = str(tmp_path_factory.mktemp("demo_world"))
            built[key] = source, build(source, *args, **kwargs)
        source, paths = built[key]
        shutil.copytree(source, root, dirs_exist_ok=True)
        return tuple(os.path.join(root, os.path.relpath(path, source)) for path in paths)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_world, "build_tiny_world", build_once)
        yield


@pytest.fixture(autouse=True)
def torch_threads_kept():
    """A test that runs main(["--demo"]) sets torch's thread count (the demo's num_threads=1): the next gets its own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_trainer(world, tmp_path):
    """DapoTrainer on the tiny world, loaded through the real loaders; keyword args override DapoArguments."""
    model_dir, data_dir = world

    def make(reward_funcs=None, model=None, **overrides):
        settings = {
            "model_path": model_dir,
            "data_path": data_dir,
            "output_dir": str(tmp_path / "output"),
            **FAST,
            **overrides,
        }
        args = DapoArguments(**settings)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        return DapoTrainer(
            model=model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir),
            reward_funcs=reward_funcs if reward_funcs is not None else list(SEED_REWARDS),
            args=args,
            train_dataset=GSM8KDataset(data_dir, tokenizer, split="train"),
            eval_dataset=GSM8KDataset(data_dir, tokenizer, split="test"),
            tokenizer=tokenizer,
        )

    return make


# ---------- helpers shared by the test files ----------
def make_batch(trainer, n=1, offset=0, varied=False):
    """A DataLoader-style batch of n training problems (varied: not all of one prompt length)."""
    rows = [trainer.train_dataset[offset + i] for i in range(n)]
    if varied:  # the last one swapped for a problem whose prompt has another length: left padding matters
        length = lambda row: int(trainer.encode_prompts([row["prompt"]])[1].sum())  # noqa: E731
        rows[-1] = next(r for r in map(trainer.train_dataset.__getitem__, range(len(trainer.train_dataset)))
                        if length(r) != length(rows[0]))  # fmt: skip
    return {"prompt": [r["prompt"] for r in rows], "answer": torch.tensor([r["answer"] for r in rows])}


def scripted_sampler(trainer, responses):
    """Replace generation by fixed response token ids (one list per row), right-padded with pad."""
    pad = trainer.tokenizer.pad_token_id

    def sample(input_ids, attention_mask):
        width = max(len(r) for r in responses)
        rows = [r + [pad] * (width - len(r)) for r in responses]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1), None

    trainer.sample = sample


def recording_generate_samples(rollouts):
    """DapoTrainer.generate_samples that also appends {"step", "index": the prompt's place in the epoch, "responses":
    its G response ids} to rollouts for every group it samples for training."""
    generate_samples = DapoTrainer.generate_samples

    def recording(self, inputs):
        samples = generate_samples(self, inputs)
        for index, group in zip(inputs["index"].tolist(), samples):
            responses = [ids[mask.bool()].tolist() for ids, mask in zip(group.response_ids, group.action_mask)]
            rollouts.append({"step": self.state.update_steps, "index": index, "responses": responses})
        return samples

    return recording


def token_ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stub_log_probs(trainer, log_probs):
    """Make the trainer's policy return fixed log-probs, so compute_loss's arithmetic is what is tested."""

    def fake(model, input_ids, attention_mask, num_actions, with_entropy=False):
        return (log_probs, torch.zeros_like(log_probs)) if with_entropy else log_probs

    trainer.get_action_log_probs = fake


def as_micro_batch(trainer, *kept_lists, old=None, ref=None):
    """One micro-batch holding every kept group of the given generate_experiences results (their kept groups),
    padded and concatenated as make_micro_batches does, with the given old / reference log-probs (None by default)."""
    groups = [group for kept in kept_lists for group in kept]
    inputs = pad_and_cat_groups(groups, trainer.tokenizer.pad_token_id)
    return MicroBatch(**inputs, old_action_log_probs=old, ref_action_log_probs=ref)
