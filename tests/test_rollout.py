"""How a rollout is sampled and shaped (issue 22): the seed's groups in the seed's order with one sampling call
per rollout; one prompt pass per group; packed training passes; micro-batches balanced by tokens."""

import functools
import os
import sys

import torch

from conftest import as_micro_batch, make_batch, scripted_sampler, token_ids
from dapo_utils.distributed import World
from dapo_utils.decoding import Sampling, decode, generate
from dapo_utils.packing import balanced_micro_batches, pack_sequences
from train import loss_normaliser

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from seed_paths import use_seed_paths  # noqa: E402

GEN = torch.Generator().manual_seed(0)


def varied(prompts, responses, answers):
    """Rewards 0, 1, 2, 3 within every group of 4: every group is kept, advantages are non-zero."""
    return [float(i % 4) for i in range(len(responses))]


# ---------- 1. one sampling call per rollout ----------
def run_recording_rollouts(trainer, one_call_per_batch):
    """Train to the end of the data on scripted responses; returns (prompts per sampling call, the rollouts'
    groups as their first row's real tokens, in buffer order)."""
    eos = trainer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    tail = token_ids(trainer.tokenizer, "<answer>\n")

    def sample(input_ids, attention_mask):  # the same response for every copy of a prompt: the prompt decides
        return torch.cat([input_ids, torch.tensor(tail + [eos]).expand(len(input_ids), -1)], dim=1), None

    calls, rollouts, generate_samples, make_micro_batches = [], [], trainer.generate_samples, trainer.make_micro_batches
    trainer.sample = sample
    trainer.generate_samples = lambda inputs: calls.append(len(inputs["prompt"])) or generate_samples(inputs)

    def recording(groups):
        rollouts.append([group.prompt_response_ids[0][group.attention_mask[0].bool()].tolist() for group in groups])
        return make_micro_batches(groups)

    trainer.make_micro_batches = recording
    trainer.train_step = lambda model, inputs, normaliser=None: {"loss": 0.0}  # what is trained is not the point
    if one_call_per_batch:
        trainer.world.rounds_to_sample = lambda *args: 1
    trainer.train()
    return calls, rollouts


def test_one_call_per_rollout_fills_the_buffer_like_one_call_per_batch(make_trainer):
    def some_groups_equal(prompts, responses, answers):  # a third of the prompts give equal rewards: skipped
        return [float(i % 2) * (len(p) % 3 != 0) for i, p in enumerate(prompts)]

    settings = dict(batch_size=2, gradient_accumulation_steps=2, epoch=2, lr=0.0, eval_steps=10**6)
    results = {}
    for one_call_per_batch in (True, False):
        trainer = make_trainer(reward_funcs=[some_groups_equal], **settings)
        trainer.evaluate_and_log = lambda: None
        results[one_call_per_batch] = run_recording_rollouts(trainer, one_call_per_batch), trainer.state
    (calls_1, rollouts_1), state_1 = results[True]
    (calls_n, rollouts_n), state_n = results[False]
    assert rollouts_n == rollouts_1  # the same groups fill each rollout, in the same order
    assert len(rollouts_1) >= 8 and all(len(r) == 4 for r in rollouts_1)
    assert state_n.skipped_groups == state_1.skipped_groups > 0
    assert (state_n.epoch, state_n.update_steps) == (state_1.epoch, state_1.update_steps) == (2, len(rollouts_1))
    assert set(calls_1) == {2} and sum(calls_n) == sum(calls_1) == 2 * 32  # every prompt, once per epoch
    assert calls_n[0] == 4 and len(calls_n) < len(calls_1)  # a rollout's 4 prompts in one call, then what is missing


def test_a_group_sampled_with_others_keeps_its_own_width(make_trainer):
    """A sampling call pads every group to the call's longest prompt and response; each kept group is cut back to
    its own, so its tensors are those of the group sampled alone (the seed's call per prompt), and a micro-batch
    of short groups is not as wide as the rollout's longest response."""
    trainer = make_trainer(reward_funcs=[varied], max_generate_length=12)
    eos, g = trainer.tokenizer.convert_tokens_to_ids("<|im_end|>"), torch.Generator().manual_seed(5)
    rows = [torch.randint(20, 100, (n - 1,), generator=g).tolist() + [eos] for n in (1, 3, 2, 3, 9, 5, 12, 7)]
    batch = make_batch(trainer, 2, varied=True)  # two prompt lengths
    scripted_sampler(trainer, rows)
    together, _ = trainer.generate_experiences(batch)
    assert [group.action_mask.size(1) for group in together] == [3, 12]  # the call was 12 wide for both
    for i in range(2):
        scripted_sampler(trainer, rows[4 * i : 4 * i + 4])
        (alone,), _ = trainer.generate_experiences({key: value[i : i + 1] for key, value in batch.items()})
        for key in ("prompt_response_ids", "attention_mask", "action_mask", "advantages"):
            assert torch.equal(getattr(together[i], key), getattr(alone, key)), key


# ---------- 3. packed (padding-free) training passes ----------
LENGTHS = [1, 12, 3, 7, 12, 2, 5, 9]  # response tokens of the 8 rows (EOS included; 12 = cut at the budget)


def scripted_micro_batch(trainer):
    """One micro-batch of two groups (prompts of two lengths) whose responses end at LENGTHS."""
    tok, eos = trainer.tokenizer, trainer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(20, 100, (n,), generator=g).tolist()[: n - 1] + [eos] * (n < 12) for n in LENGTHS]
    scripted_sampler(trainer, [r + [tok.pad_token_id] * (12 - len(r)) for r in rows])
    kept, _ = trainer.generate_experiences(make_batch(trainer, 2, varied=True))
    return as_micro_batch(trainer, kept)


def test_padding_free_equals_the_padded_pass(make_trainer):
    padded = make_trainer(batch_size=2, reward_funcs=[varied], loss_agg_mode="token-mean")
    packed = make_trainer(batch_size=2, reward_funcs=[varied], loss_agg_mode="token-mean", padding_free=True)
    packed.model = model = padded.model
    inputs = scripted_micro_batch(padded)
    mask = inputs.action_mask.bool()  # [8, 12]
    assert mask.sum(1).tolist() == LENGTHS and inputs.attention_mask.size(1) > inputs.attention_mask.sum(1).min()
    ids, forward, labels, where = pack_sequences(*padded.model_inputs(inputs))
    assert ids.shape == (1, inputs.attention_mask.sum()) and torch.equal(where, mask) and labels.numel() == sum(LENGTHS)
    inputs.old_action_log_probs = None
    results = []
    for trainer in (padded, packed):
        with torch.no_grad():
            log_probs, entropy = trainer.get_action_log_probs(model, *trainer.model_inputs(inputs), with_entropy=True)
        if inputs.old_action_log_probs is None:  # pi_old: the padded pass's, moved a little, so that clipping acts
            inputs.old_action_log_probs = log_probs + 0.3 * torch.randn(log_probs.shape, generator=GEN)
        model.zero_grad()
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        results.append((log_probs[mask], entropy[mask], loss, [p.grad.clone() for p in model.parameters()]))
    (lp_a, ent_a, loss_a, grads_a), (lp_b, ent_b, loss_b, grads_b) = results
    assert (lp_a - lp_b).abs().max() < 1e-5 and (ent_a - ent_b).abs().max() < 1e-5
    assert abs(loss_a - loss_b) < 1e-5 and loss_a != 0
    assert max((a - b).abs().max() for a, b in zip(grads_a, grads_b)) < 1e-5
    assert max(a.abs().max() for a in grads_a) > 1e-3  # gradients that say something


def test_padding_free_sequences_do_not_attend_to_each_other(make_trainer):
    trainer = make_trainer(batch_size=2, reward_funcs=[varied], padding_free=True)
    inputs = scripted_micro_batch(trainer)
    ids, mask = inputs.prompt_response_ids, inputs.attention_mask
    changed = ids.clone()
    changed[0, -12] = (changed[0, -12] + 1) % 100  # row 0's first response token: every later token sees it
    T, where = inputs.action_mask.size(1), inputs.action_mask.bool()
    with torch.no_grad():
        before, after = (trainer.get_action_log_probs(trainer.model, x, mask, T) for x in (ids, changed))
        packed = [pack_sequences(x, mask, T) for x in (ids, changed)]  # the same row with a 2-D mask of ones
        leaky = [trainer.model(x, attention_mask=torch.ones_like(x), **kw).logits for x, kw, _, _ in packed]
    assert (before[0] - after[0])[where[0]].abs().max() > 1e-3  # row 0 itself moved
    assert torch.equal(before[1:][where[1:]], after[1:][where[1:]])  # no other row moved at all
    first_of_row_1 = int(where[0].sum())  # with a mask, transformers would let row 1 see row 0
    assert (leaky[0][0, first_of_row_1:] - leaky[1][0, first_of_row_1:]).abs().max() > 1e-3


# ---------- 2. one prompt pass per group ----------
def forward_shapes(model):
    """Record the [rows, tokens] of every forward pass of model."""
    shapes, forward = [], model.forward

    @functools.wraps(forward)  # generate reads the signature (position_ids)
    def recording(input_ids=None, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return forward(input_ids=input_ids, **kwargs)

    model.forward = recording
    return shapes


def test_decode_makes_one_prompt_pass_per_group(make_trainer):
    """8 rows of 2 prompts (G 4): the prompt pass runs once per prompt, then every decode step runs the 8 rows one
    token at a time; the same sequences as the seed's generate, which runs a prompt pass per row."""
    G, T = 4, 6
    trainer = make_trainer(num_generations=G, max_generate_length=T, top_k=1)  # top_k 1: the same draws both ways
    prompt_ids, prompt_mask = trainer.encode_prompts(make_batch(trainer, 2, varied=True)["prompt"])  # [2, P]
    ids, mask = prompt_ids.repeat_interleave(G, dim=0), prompt_mask.repeat_interleave(G, dim=0)  # [8, P]
    settings = Sampling(T, trainer.eos_token_ids, trainer.tokenizer.pad_token_id, 0.9, 1, 1.0)
    shapes = forward_shapes(trainer.model)
    shared = decode(trainer.model, ids, mask, settings)
    P = ids.size(1)
    assert shapes == [(2, P)] + [(8, 1)] * (shared.size(1) - P - 1)  # the 2 prompts once, then each drawn token
    shapes.clear()
    assert torch.equal(shared, generate(trainer.model, ids, mask, settings)) and shared.size(1) > P
    assert shapes[0] == (8, P)  # generate alone: a prompt pass per row


# ---------- 4. micro-batches balanced by tokens ----------
def test_balanced_micro_batches_by_hand():
    tokens = [100, 90, 10, 20, 60, 50, 30, 40]  # consecutive pairs would hold 190, 30, 110, 70 tokens
    for steps in (1, 2):  # 100, 90 open two micro-batches; 20 joins 90, 10 joins 100; 60, 50, then 40 and 30
        assert balanced_micro_batches(tokens, 2, steps) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # 110, 110, 90, 90
    assert balanced_micro_batches(tokens, 1, 2) == [[g] for g in range(8)]  # batch_size 1: nothing moves
    # 3 steps over micro-batches of 3, 3, 2 groups: the steps keep groups 0-2, 3-5 and 6-7; sizes stay
    assert balanced_micro_batches(tokens, 3, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # one step, micro-batches of 3, 3 and 2: 100 | 90 | 60; 50 fills the 2 (110); 40 -> 90's, 30 -> 100's (130
    # each); 20 -> the first of the tie, full at 150; 10 -> 140. In order: 210, 80, 110 would be consecutive.
    assert balanced_micro_batches(tokens, 3, 1) == [[0, 3, 6], [1, 2, 7], [4, 5]]


def test_make_micro_batches_balances_real_tokens_with_the_same_normaliser(make_trainer):
    """padding_free: groups balanced by real tokens (verl). Padded passes keep the seed's consecutive groups: each
    costs its widest group, and balancing pairs the longest with the shortest (measured: 26% more computed
    tokens, benchmarks/bench.py --lengths 20:300:group)."""
    settings = dict(batch_size=2, gradient_accumulation_steps=2, max_generate_length=90, loss_agg_mode="token-mean")
    settings["padding_free"] = True
    trainer = make_trainer(reward_funcs=[varied], **settings)
    eos = trainer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    experiences = []
    for n in (90, 60, 1, 30):  # response tokens of each group's 4 rows
        scripted_sampler(trainer, [[30] * (n - 1) + [eos]] * 4)
        experiences.append(trainer.generate_experiences(make_batch(trainer, 1, offset=len(experiences)))[0])
    groups = [group for kept in experiences for group in kept]
    real = [int(group.attention_mask.sum()) for group in groups]
    assert real[0] > real[1] > real[3] > real[2]  # prompts differ by less than the responses
    micro_batches = trainer.make_micro_batches(groups)
    response_tokens = [int(m.action_mask.sum()) for m in micro_batches]
    assert response_tokens == [4 * (90 + 1), 4 * (60 + 30)]  # groups [0, 2] and [1, 3]; in order: 600 and 124
    assert [int(m.attention_mask.sum()) for m in micro_batches] == [real[0] + real[2], real[1] + real[3]]
    assert sum(loss_normaliser(m.action_mask, "token-mean", 4) for m in micro_batches) == 4 * 181  # the step's
    in_order = [4 * (90 + 60), 4 * (1 + 30)]  # consecutive groups [0, 1] and [2, 3], as the seed has them
    trainer.args.padding_free = False
    padded = trainer.make_micro_batches(groups)
    assert [int(m.action_mask.sum()) for m in padded] == in_order
    assert [m.action_mask.size(1) for m in padded] == [90, 30]  # balanced, both would be 90 wide
    trainer.args.padding_free = True
    use_seed_paths(trainer, "arrival_order")  # the benchmark's seed path
    assert [int(m.action_mask.sum()) for m in trainer.make_micro_batches(groups)] == in_order


def test_rounds_to_sample_and_generation_batch_size():
    world = World()  # one process
    assert [world.rounds_to_sample(held, 4, 2) for held in (0, 1, 2, 3, 4, 9)] == [2, 2, 1, 1, 1, 1]
    assert world.rounds_to_sample(0, 4, 2, generation_batch_size=12) == 6  # verl's 3x over-sampling
    assert world.rounds_to_sample(0, 4, 2, generation_batch_size=3) == 2  # never fewer than needed


def test_max_generation_rows_splits_a_call_into_whole_groups(make_trainer):
    trainer = make_trainer(max_generation_rows=5, reward_funcs=[varied])  # G = 4: one group per generate call
    eos, pad = trainer.tokenizer.convert_tokens_to_ids("<|im_end|>"), trainer.tokenizer.pad_token_id
    calls = []

    def sample(input_ids, attention_mask):  # call 1 ends every row by EOS within 3 tokens; call 2 runs 6, no EOS
        calls.append(len(input_ids))
        rows = [[eos, pad, pad], [30, eos, pad], [30, 30, eos], [30, 30, eos]] if len(calls) == 1 else [[30] * 6] * 4
        return torch.cat([input_ids, torch.tensor(rows)], dim=1), None

    trainer.sample = sample
    samples = trainer.generate_samples(make_batch(trainer, 2))
    assert calls == [4, 4]
    assert [s.response_length.tolist() for s in samples] == [[1, 2, 3, 3], [6, 6, 6, 6]]  # each call's own budget
    assert [s.response_ids.shape for s in samples] == [(4, 3), (4, 6)]  # each group as wide as itself
