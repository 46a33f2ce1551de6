"""Paper-exact updates: several optimizer steps per rollout (so that clip-higher binds), log-probs of the
sampling distribution, exact zero advantages for equal groups, the KL masked before exp, checkpoints that
do not fill the disk, and cache-free scoring passes. Each test fails on the code before these changes."""

import os

import pytest
import torch

import train
from conftest import make_batch
from dapo_utils.presets import paper_preset
from train import dapo_per_token_loss, group_advantages, k3_kl, main

pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def varied(prompts, responses, answers):
    return [0.0, 1.0, 2.0, 3.0] * (len(responses) // 4)


# ---------- 1. clip-higher binds ----------
def test_ratio_above_one_plus_eps_high_with_positive_advantage_has_zero_gradient():
    old = torch.zeros(1, 3)
    # ratios exp(0.4) = 1.49 > 1.28 (clipped), exp(0.1) = 1.105 (inside), exp(-0.4) = 0.67 < 0.8 with A > 0 (unclipped)
    log_probs = torch.tensor([[0.4, 0.1, -0.4]], requires_grad=True)
    loss, ratio = dapo_per_token_loss(log_probs, old, torch.tensor([1.0]), 0.2, 0.28)
    loss.sum().backward()
    assert loss[0, 0].item() == pytest.approx(-1.28)  # -clip(r) * A, a constant
    assert log_probs.grad[0, 0].item() == 0.0
    assert log_probs.grad[0, 1].item() == pytest.approx(-ratio[0, 1].item())  # d(-r A)/d logp = -r A
    assert log_probs.grad[0, 2].item() == pytest.approx(-ratio[0, 2].item())  # min picks the unclipped r A
    # and with a negative advantage the low clip binds instead
    log_probs.grad = None
    loss, _ = dapo_per_token_loss(log_probs, old, torch.tensor([-1.0]), 0.2, 0.28)
    loss.sum().backward()
    assert log_probs.grad[0, 2].item() == 0.0 and log_probs.grad[0, 0].item() != 0.0


def test_steps_per_generation_splits_one_rollout_into_optimizer_steps(make_trainer, monkeypatch):
    trainer = make_trainer(
        reward_funcs=[varied], steps_per_generation=2, gradient_accumulation_steps=2, batch_size=1,
        max_steps=4, eval_steps=100, lr=1e-2,
    )  # fmt: skip
    sampled, old_passes, ratios = [], [], []
    generate, make = trainer.generate_experiences, trainer.make_micro_batches
    trainer.generate_experiences = lambda batch: (
        sampled.append((trainer.update_steps, len(batch["prompt"]))) or generate(batch)
    )

    def counting_make(groups):
        micro_batches = make(groups)
        old_passes.append([m.old_action_log_probs is not None for m in micro_batches])
        return micro_batches

    trainer.make_micro_batches = counting_make
    loss_fn = train.dapo_per_token_loss

    def spy(log_probs, old_log_probs, *rest):
        loss, ratio = loss_fn(log_probs, old_log_probs, *rest)
        ratios.append((trainer.update_steps, ratio.detach()))
        return loss, ratio

    monkeypatch.setattr(train, "dapo_per_token_loss", spy)
    trainer.train()
    # 4 groups per rollout (1 x 2 accumulation x 2 steps): its 4 prompts sampled in one call before step 0 and
    # before step 2 only, pi_old taken once per rollout on its 4 micro-batches
    assert sampled == [(0, 4), (2, 4)] and old_passes == [[True] * 4] * 2
    assert [step for step, _ in ratios] == [0, 0, 1, 1, 2, 2, 3, 3]  # 2 micro-steps per optimizer step
    first_steps = [r for step, r in ratios if step in (0, 2)]
    second_steps = [r for step, r in ratios if step in (1, 3)]
    assert all(torch.equal(r, torch.ones_like(r)) for r in first_steps)  # same tensors, same pass: ratio 1
    assert all((r - 1).abs().max() > 1e-3 for r in second_steps)  # the policy moved: the clip can bind


def test_token_mean_normalises_by_each_optimizer_steps_own_tokens(make_trainer):
    trainer = make_trainer(
        reward_funcs=[varied], steps_per_generation=2, gradient_accumulation_steps=1, loss_agg_mode="token-mean",
        max_steps=2, eval_steps=100,
    )  # fmt: skip
    seen = []
    original_step = trainer.train_step
    trainer.train_step = lambda model, inputs, normaliser=None: (
        seen.append((normaliser, int(inputs.action_mask.sum()))) or original_step(model, inputs, normaliser)
    )
    trainer.train()
    assert [n for n, _ in seen] == [tokens for _, tokens in seen]  # one micro-batch per step: its own count


def test_paper_preset_uses_several_steps_per_rollout_and_samples_the_policy():
    preset = paper_preset(128)
    assert preset["steps_per_generation"] == 4 and preset["score_with_temperature"] is True
    assert (preset["temperature"], preset["top_k"]) == (1.0, 0)


# ---------- 2. log-probs of the distribution that sampled ----------
def test_score_with_temperature_divides_the_logits(make_trainer):
    plain = make_trainer(temperature=0.5)
    scaled = make_trainer(temperature=0.5, score_with_temperature=True)
    scaled.model.load_state_dict(plain.model.state_dict())
    sample = plain.generate_samples(make_batch(plain))[0]
    ids, mask, T = sample.prompt_response_ids, sample.attention_mask, sample.num_actions
    with torch.no_grad():
        logits = plain.model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
        expected = torch.log_softmax(logits[:, :-1] / 0.5, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, -T:]
        assert torch.allclose(scaled.get_action_log_probs(scaled.model, ids, mask, T), expected, atol=1e-5)
        assert not torch.allclose(plain.get_action_log_probs(plain.model, ids, mask, T), expected, atol=1e-3)


# ---------- 3. equal rewards: exactly zero advantage ----------
def test_equal_rewards_give_exactly_zero_advantages():
    for G in (3, 5, 6, 7, 8, 16):
        for value in (0.3, 0.1, 2.7, -0.45):
            assert torch.equal(group_advantages(torch.full((1, G), value)), torch.zeros(1, G)), (G, value)
    # the seed's exact cases are bit-identical to the seed's formula
    rewards = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.5, 0.5, 0.5, 1.0], [2.0, 2.0, 2.0, 2.0]])
    seed = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-8)
    assert torch.equal(group_advantages(rewards), seed)


def test_a_group_of_equal_03_rewards_is_skipped_by_the_seeds_rule(make_trainer):
    trainer = make_trainer(reward_funcs=[lambda prompts, responses, answers: [0.3] * len(responses)])
    trainer.args.num_generations = 4
    kept, _ = trainer.generate_experiences(make_batch(trainer))
    assert kept == [] and trainer.state.skipped_groups == 1


# ---------- 4. KL masked before exp ----------
def test_k3_kl_is_finite_on_padding():
    log_probs = torch.tensor([[-1.0, -200.0]], requires_grad=True)  # position 1 is padding
    ref = torch.tensor([[-1.5, 0.0]])
    mask = torch.tensor([[1, 0]])
    kl = k3_kl(log_probs, ref, mask)
    (kl * mask).sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(log_probs.grad).all()
    assert kl[0, 0].item() == pytest.approx(torch.exp(torch.tensor(-0.5)).item() - 1 + 0.5)
    assert kl[0, 1].item() == 0.0


# ---------- 6. checkpoints that do not fill the disk ----------
def test_only_the_newest_checkpoint_keeps_the_trainer_state_and_save_total_limit(make_trainer, tmp_path):
    trainer = make_trainer(max_steps=4, save_steps=1, eval_steps=100, save_total_limit=2)
    trainer.train()
    out = trainer.args.output_dir
    assert sorted(d for d in os.listdir(out) if d.startswith("checkpoint_")) == ["checkpoint_3", "checkpoint_4"]
    assert not os.path.exists(os.path.join(out, "checkpoint_3", "trainer_state.pt"))
    assert os.path.exists(os.path.join(out, "checkpoint_3", "model.safetensors"))
    assert os.path.exists(os.path.join(out, "checkpoint_4", "trainer_state.pt"))
    with pytest.raises(SystemExit, match="only the newest checkpoint keeps one"):
        main([f"--resume={out}/checkpoint_3"])
    resumed = main(["--resume=latest", f"--output_dir={out}", "--max_steps=5"])
    assert resumed.update_steps == 5


# ---------- 7. cache-free scoring passes ----------
def test_scoring_passes_ask_for_no_kv_cache(make_trainer):
    trainer = make_trainer(reward_funcs=[varied], num_iterations=2, beta=0.1, max_steps=1, eval_steps=100)
    calls = []
    for model in (trainer.model, trainer.ref_model):
        forward = model.forward

        def spy(*args, _forward=forward, **kwargs):
            if torch.is_tensor(kwargs.get("logits_to_keep")):  # a scoring pass, not a generate step
                calls.append(kwargs.get("use_cache"))
            return _forward(*args, **kwargs)

        model.forward = spy
    trainer.train()
    assert calls == [False] * 6  # pi_old, pi_ref and the training pass on each of the 2 micro-batches
