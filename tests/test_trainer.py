"""DapoTrainer's semantics on the tiny world, one behaviour per test."""

import math
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from conftest import as_micro_batch, make_batch, scripted_sampler, token_ids
from train import DapoArguments, GSM8KDataset, Samples


def varied(prompts, responses, answers):
    """Rewards 0, 1, 2, 3 within every group of 4: every group is kept."""
    return [0.0, 1.0, 2.0, 3.0] * (len(responses) // 4)


# ---------- sampling ----------
def test_groups_left_padding_and_eos_in_action_mask(make_trainer):
    trainer = make_trainer(num_generations=2, max_generate_length=8)
    tok = trainer.tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id
    a, b = token_ids(tok, "<answer>\n"), token_ids(tok, "</answer>\n")
    # row 0 stops after 3 tokens (EOS included), row 1 after 1, rows 2-3 never stop within the 4 generated
    scripted_sampler(trainer, [a + b + [eos], [eos], a * 4, b * 4])
    batch = make_batch(trainer, n=2)
    samples = trainer.generate_samples(batch)
    assert len(samples) == 2 and all(isinstance(s, Samples) for s in samples)
    first, second = samples
    assert first.prompt == batch["prompt"][0] and int(first.answer) == int(batch["answer"][0])
    # Each group as wide as its own longest response, as if sampled alone: 3 and 4 of the call's 4 columns.
    assert first.response_ids.shape == (2, 3) and (first.num_actions, second.num_actions) == (3, 4)
    assert first.action_mask.tolist() == [[1, 1, 1], [1, 0, 0]]  # first EOS included, nothing after
    assert second.action_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]  # cut at the budget: all tokens count
    assert first.response_length.tolist() == [3, 1]
    assert (first.response_ids[1, 1:] == pad).all()  # after EOS: padding
    # Left padding: every prompt ends in the same column, so responses start together.
    lengths = [len(token_ids(tok, tok.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)))]
    for s in samples:
        prompt_width = s.prompt_response_ids.size(1) - s.num_actions
        prompt_mask = s.attention_mask[:, :prompt_width]
        assert (prompt_mask[:, -1] == 1).all()  # the last prompt column is real for every row
        n_real = int(prompt_mask[0].sum())
        assert prompt_mask[0].tolist() == [0] * (prompt_width - n_real) + [1] * n_real
    assert lengths  # the template renders
    assert torch.equal(first.attention_mask[:, -first.num_actions :], first.action_mask)


def test_attention_mask_when_pad_is_eos(make_trainer):
    # SmolLM / Llama: pad == eos == <|im_end|>. The seed's `ids != pad` would mask the chat template's
    # own <|im_end|> tokens inside the prompt.
    trainer = make_trainer(num_generations=2)
    tok = trainer.tokenizer
    tok.pad_token = tok.eos_token
    scripted_sampler(trainer, [[tok.eos_token_id], token_ids(tok, "<think>\n") + [tok.eos_token_id]])
    s = trainer.generate_samples(make_batch(trainer))[0]
    prompt_ids = s.prompt_response_ids[0, : -s.num_actions]
    im_end_in_prompt = (prompt_ids == tok.eos_token_id).sum().item()
    assert im_end_in_prompt == 2  # system and user turns end with <|im_end|>
    assert s.attention_mask[0, : -s.num_actions].sum().item() == len(prompt_ids)  # all attended
    assert s.action_mask.tolist() == [[1, 0], [1, 1]]


def test_long_prompt_keeps_its_end_and_warns(make_trainer):
    trainer = make_trainer(max_prompt_length=10)
    with pytest.warns(UserWarning, match="max_prompt_length=10"):
        input_ids, mask = trainer.encode_prompts(["很长的问题" * 20])
    assert input_ids.shape == (1, 10) and mask.sum() == 10
    tail = token_ids(trainer.tokenizer, "<|im_start|>assistant\n")
    assert input_ids[0, -len(tail) :].tolist() == tail  # the generation prompt survives
    assert trainer.state.truncated_prompts == 1


# ---------- rewards, advantages, dynamic sampling ----------
def test_reward_weights_none_rewards_and_advantages(make_trainer):
    def f1(prompts, responses, answers):
        return [1.0, None, 0.0, None]

    def f2(prompts, responses, answers):
        return [None, 2.0, None, None]

    trainer = make_trainer(reward_funcs=[f1, f2], reward_weights=[1.0, 0.5])
    kept, metrics = trainer.generate_experiences(make_batch(trainer))
    # totals: [1, 0.5*2, 0, 0] = [1, 1, 0, 0]; mean 0.5, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = torch.tensor([0.5, 0.5, -0.5, -0.5]) / (std + 1e-8)
    assert len(kept) == 1
    assert torch.allclose(kept[0].advantages, expected, atol=1e-6)
    assert not torch.isnan(kept[0].advantages).any()
    # the per-function log keeps None as NaN (a nan-aware mean skips it); the total counts it as 0
    f1, f2 = metrics["rewards/f1"], metrics["rewards/f2"]
    assert f1[0] == 1.0 and f1[2] == 0.0 and math.isnan(f1[1]) and math.isnan(f1[3])
    assert math.isnan(f2[0]) and f2[1] == 2.0 and math.isnan(f2[2]) and math.isnan(f2[3])
    assert metrics["reward"] == [1.0, 1.0, 0.0, 0.0]


def test_equal_rewards_skip_the_group_and_count_it(make_trainer):
    calls = []

    def alternating(prompts, responses, answers):  # equal rewards on every other call
        calls.append(1)
        return [1.0] * 4 if len(calls) % 2 else [0.0, 1.0, 2.0, 3.0]

    trainer = make_trainer(reward_funcs=[alternating])
    first, metrics = trainer.generate_experiences(make_batch(trainer))
    assert first == [] and trainer.state.skipped_groups == 1
    assert metrics["frac_groups_skipped"] == [1.0]
    second, metrics = trainer.generate_experiences(make_batch(trainer))
    assert len(second) == 1 and trainer.state.skipped_groups == 1
    assert metrics["frac_groups_skipped"] == [0.0]
    # num_iterations 1, beta 0: a micro-batch carries no old or reference log-probs
    (micro_batch,) = trainer.make_micro_batches(second)
    assert micro_batch.old_action_log_probs is None and micro_batch.ref_action_log_probs is None


def test_old_log_probs_only_when_batches_are_reused(make_trainer):
    # (num_iterations, beta) -> forward passes make_micro_batches makes for 2 micro-batches of 1 group
    for num_iterations, beta, expected_calls in ((1, 0.0, 0), (2, 0.0, 2), (1, 0.1, 2), (2, 0.1, 4)):
        trainer = make_trainer(reward_funcs=[varied], num_iterations=num_iterations, beta=beta)
        calls = []
        original = trainer.get_action_log_probs
        trainer.get_action_log_probs = lambda model, *a, **k: calls.append(model) or original(model, *a, **k)
        kept, _ = trainer.generate_experiences(make_batch(trainer, n=2))
        assert calls == [] and len(kept) == 2  # sampling computes no log-probs
        micro_batches = trainer.make_micro_batches(kept)
        assert len(micro_batches) == 2 and len(calls) == expected_calls
        assert sum(model is trainer.ref_model for model in calls) == (2 if beta else 0)
        for inputs in micro_batches:
            for key, wanted in (("old_action_log_probs", num_iterations > 1), ("ref_action_log_probs", beta > 0)):
                if not wanted:
                    assert getattr(inputs, key) is None, key
                    continue
                # computed on the assembled micro-batch, with the model it names
                model = trainer.model if key.startswith("old") else trainer.ref_model
                ids, mask = inputs.prompt_response_ids, inputs.attention_mask
                with torch.no_grad():
                    direct = original(model, ids, mask, inputs.action_mask.size(1))
                assert getattr(inputs, key).shape == inputs.action_mask.shape, key
                assert torch.equal(getattr(inputs, key), direct), key


def test_reward_model_given_as_a_path(make_trainer, world, tmp_path):
    model_dir, _ = world
    rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    rm.config.pad_token_id = 0
    rm.save_pretrained(tmp_path / "rm")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "rm")
    trainer = make_trainer(reward_funcs=[str(tmp_path / "rm")])
    responses = ["<answer>\n3\n</answer>\n", "3", "", "12"]
    scores = trainer.score_rewards(["小明有3个苹果"] * 4, responses, [3] * 4)
    tok = trainer.reward_tokenizers[0]
    enc = tok(["小明有3个苹果" + r for r in responses], return_tensors="pt", padding=True)
    with torch.no_grad():
        direct = trainer.reward_funcs[0](**enc).logits[:, 0]
    assert scores.shape == (4, 1) and torch.allclose(scores[:, 0], direct)
    assert trainer.reward_names == ["rm"]


# ---------- log-probs ----------
def test_get_action_log_probs_equals_manual_log_softmax(make_trainer):
    trainer = make_trainer()
    s = trainer.generate_samples(make_batch(trainer, n=2))[0]
    ids, mask, T = s.prompt_response_ids, s.attention_mask, s.num_actions
    with torch.no_grad():
        got = trainer.get_action_log_probs(trainer.model, ids, mask, T)
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = trainer.model(ids, attention_mask=mask, position_ids=position_ids).logits
        manual = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[:, -T:]
    assert got.shape == (4, T)
    assert torch.allclose(got, manual, atol=1e-5)


# ---------- optimisation ----------
def count_optimizer_steps(trainer):
    steps = []
    original = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: steps.append(1) or original(*a, **k)
    return steps


def test_optimizer_steps_follow_valid_groups(make_trainer):
    groups = []

    def half_valid(prompts, responses, answers):  # every other group of 4, in sampling order, has equal rewards
        rewards = []
        for _ in range(0, len(responses), 4):
            groups.append(1)
            rewards += [1.0] * 4 if len(groups) % 2 else [0.0, 0.0, 1.0, 1.0]
        return rewards

    trainer = make_trainer(reward_funcs=[half_valid], epoch=1, gradient_accumulation_steps=2, eval_steps=1000)
    steps = count_optimizer_steps(trainer)
    trainer.train()
    # 32 prompts -> 16 valid groups -> 16 micro-batches -> 8 optimizer steps of 2 micro-steps
    assert trainer.state.skipped_groups == 16
    assert len(steps) == 8 and trainer.update_steps == 8
    lines = open(os.path.join(trainer.args.output_dir, "training_losses.txt")).read().split()
    assert [int(line.split(",")[0]) for line in lines] == [s for s in range(8) for _ in range(2)]


def test_batch_size_and_iterations(make_trainer):
    trainer = make_trainer(
        reward_funcs=[varied], epoch=1, batch_size=2, gradient_accumulation_steps=2, num_iterations=2, eval_steps=1000
    )
    steps = count_optimizer_steps(trainer)
    seen = []
    original = trainer.compute_loss
    trainer.compute_loss = lambda model, inputs, *a, **k: (
        seen.append(inputs.prompt_response_ids.size(0)) or original(model, inputs, *a, **k)
    )
    trainer.train()
    # 32 prompts / 2 per micro-batch = 16 micro-batches = 8 sampled steps, each trained twice
    assert trainer.update_steps == 16 and len(steps) == 16
    assert set(seen) == {8} and len(seen) == 32  # 2 groups x 4 responses per micro-batch
    assert trainer.global_steps == 16


def test_bf16_checkpoint_trains_in_float32(world, make_trainer, tmp_path):
    model_dir, _ = world
    AutoModelForCausalLM.from_pretrained(model_dir).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert loaded.dtype == torch.bfloat16  # transformers 5 keeps the checkpoint's dtype

    # The seed's situation: Adam at lr 1e-6 on bf16 weights changes nothing.
    w = loaded.model.embed_tokens.weight.detach().clone().requires_grad_()
    opt = torch.optim.Adam([w], lr=1e-6)
    w.grad = torch.ones_like(w)
    opt.step()
    big = loaded.model.embed_tokens.weight.abs() > 1e-3  # where a step of 1e-6 is below bf16's resolution
    assert big.float().mean() > 0.9 and torch.equal(w[big], loaded.model.embed_tokens.weight[big])

    trainer = make_trainer(reward_funcs=[varied], model=str(tmp_path / "bf16"), lr=1e-6)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    before = trainer.model.model.embed_tokens.weight.detach().clone()
    for step in range(2):  # one optimizer step of gradient_accumulation_steps = 2 micro-batches
        inputs = as_micro_batch(trainer, trainer.generate_experiences(make_batch(trainer, offset=step))[0])
        trainer.train_step(trainer.model, inputs, normaliser=2)
    assert torch.equal(trainer.model.model.embed_tokens.weight, before)  # train_step does not step
    trainer.optimizer.step()
    changed = (trainer.model.model.embed_tokens.weight - before).abs().max().item()
    assert 0 < changed < 1e-5  # moved, by about lr


# ---------- evaluation ----------
def test_evaluate_small_eval_set_and_response_slicing(make_trainer):
    trainer = make_trainer(eval_samples=100, eval_batch_size=3)
    answers = iter([row["answer"] for row in trainer.eval_dataset])
    tok = trainer.tokenizer

    def sample(input_ids, attention_mask):  # answer every problem right, after prompts of unequal length
        rows = [token_ids(tok, f"<answer>\n{next(answers)}\n</answer>\n") + [tok.eos_token_id] for _ in input_ids]
        width = max(len(r) for r in rows)
        rows = [r + [tok.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1), None

    trainer.sample = sample
    assert len(trainer.eval_dataset) == 8
    assert trainer.evaluate(num_samples=100, batch_size=3) == 1.0


# ---------- end to end ----------
def test_train_writes_the_seed_files_and_checkpoints(make_trainer, world):
    trainer = make_trainer(epoch=1, eval_steps=3, save_steps=4, gradient_accumulation_steps=2)
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    trainer.save_model()
    out = trainer.args.output_dir
    losses = open(os.path.join(out, "training_losses.txt")).read().splitlines()
    assert len(losses) == 2 * trainer.update_steps > 0
    assert all(re.fullmatch(r"\d+,-?\d+\.\d{8}", line) for line in losses)
    accuracy = open(os.path.join(out, "accuracy_losses.txt")).read().splitlines()
    assert all(re.fullmatch(r"\d+,[01]\.\d\d", line) for line in accuracy)
    assert [int(line.split(",")[0]) for line in accuracy] == list(range(0, trainer.update_steps + 1, 3))
    checkpoints = sorted(int(d.split("_")[1]) for d in os.listdir(out) if d.startswith("checkpoint_"))
    assert checkpoints == list(range(4, trainer.update_steps + 1, 4))
    reloaded = AutoModelForCausalLM.from_pretrained(os.path.join(out, f"checkpoint_{checkpoints[0]}"))
    AutoTokenizer.from_pretrained(os.path.join(out, f"checkpoint_{checkpoints[0]}"))
    final = AutoModelForCausalLM.from_pretrained(out)
    for name, value in final.state_dict().items():
        assert torch.equal(value, trainer.model.state_dict()[name])
    assert any(not torch.equal(initial[k], v) for k, v in final.state_dict().items())
    assert reloaded.config.num_hidden_layers == 2


# ---------- arguments and inputs ----------
def test_arguments_are_validated():
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        DapoArguments(num_generations=1)
    with pytest.raises(ValueError, match="clip_eps_high must be in"):
        DapoArguments(clip_eps_high=1.0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        DapoArguments(gradient_accumulation_steps=0)
    args = DapoArguments()
    assert (args.lr, args.num_generations, args.clip_eps_low, args.clip_eps_high, args.beta) == (
        1e-6,
        4,
        0.2,
        0.28,
        0.0,
    )
    assert (args.max_prompt_length, args.max_generate_length, args.gradient_accumulation_steps, args.epoch) == (
        256,
        128,
        2,
        3,
    )
    assert (args.save_steps, args.num_iterations, args.batch_size, args.reward_weights) == (100, 1, 1, None)
    assert (args.temperature, args.top_p, args.top_k, args.output_dir) == (0.9, 1.0, 50, "./output")


def test_reward_weights_must_match(make_trainer):
    with pytest.raises(ValueError, match="reward_weights has 2 entries but there are 4"):
        make_trainer(reward_weights=[1.0, 2.0])


def test_dataset_errors_name_the_problem(world, tmp_path):
    _, data_dir = world
    with pytest.raises(FileNotFoundError, match="swulling/gsm8k_chinese"):
        GSM8KDataset(str(tmp_path / "nowhere"), None)
    with pytest.raises(ValueError, match="no split 'validation'"):
        GSM8KDataset(data_dir, None, split="validation")
    import datasets

    bad = tmp_path / "bad"
    (bad / "data").mkdir(parents=True)
    datasets.Dataset.from_list([{"question": "q", "answer_only": 1}]).to_parquet(
        str(bad / "data" / "train-00000-of-00001.parquet")
    )
    datasets.Dataset.from_list([{"question": "q", "answer_only": 1}]).to_parquet(
        str(bad / "data" / "test-00000-of-00001.parquet")
    )
    with pytest.raises(ValueError, match=r"lacks the column\(s\) \['question_zh-cn'\]"):
        GSM8KDataset(str(bad), None)


def test_dataset_items_and_test_split_carved_from_train(world, tmp_path):
    _, data_dir = world
    ds = GSM8KDataset(data_dir, None, split="train")
    item = ds[0]
    assert set(item) == {"prompt", "answer"} and isinstance(item["answer"], int) and "？" in item["prompt"]
    import datasets

    only_train = tmp_path / "only_train"
    (only_train / "data").mkdir(parents=True)
    rows = [{"question_zh-cn": f"问题{i}", "answer_only": i} for i in range(30)]
    datasets.Dataset.from_list(rows).to_parquet(str(only_train / "data" / "train-00000-of-00001.parquet"))
    train, test = (
        GSM8KDataset(str(only_train), None, "train", test_size=5),
        GSM8KDataset(str(only_train), None, "test", test_size=5),
    )
    assert (len(train), len(test)) == (25, 5)
    assert not {r["answer"] for r in train} & {r["answer"] for r in test}
