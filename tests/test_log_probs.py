"""Log-probs from the hidden states (kernels.log_probs_from_hidden) equal the logits path they replace.

The logits path: the model's [N, T, V] logits, a float32 log-softmax, the label's log-prob and the entropy,
through autograd. Both see the same layout (padded or packed) and the same temperature; the blocks are made
small (POSITIONS_PER_BLOCK 5) so that every pass crosses rows and ends on a partial block.
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_batch, token_ids
from dapo_utils import kernels
from dapo_utils.packing import pack_sequences, padded_sequences, unpack

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def logits_path(trainer):
    """trainer.get_action_log_probs, as it was before the log-probs came from the hidden states."""

    def get_action_log_probs(model, input_ids, attention_mask, num_actions, with_entropy=False):
        layout = pack_sequences if trainer.args.padding_free else padded_sequences
        input_ids, inputs, labels, where = layout(input_ids, attention_mask, num_actions)
        with trainer.autocast():
            logits = model(input_ids, **inputs).logits  # [N, T, V]
        if trainer.args.score_with_temperature:
            logits = logits / trainer.args.temperature
        all_log_probs = logits.float().log_softmax(dim=-1)  # [N, T, V]
        log_probs = all_log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(all_log_probs.exp() * all_log_probs).sum(dim=-1).detach()
        if where is not None:
            log_probs, entropy = unpack(log_probs, where), unpack(entropy, where)
        return (log_probs, entropy) if with_entropy else log_probs

    trainer.get_action_log_probs = get_action_log_probs
    return trainer


def varied(prompts, responses, answers):
    """Rewards 0, 1, 2, 3 within every group of 4: every group is kept, advantages are non-zero."""
    return [float(i % 4) for i in range(len(responses))]


def scripted(trainer):
    """Generation replaced by responses of 3 to 10 tokens, every other one ending with EOS, others cut short."""
    tok, eos = trainer.tokenizer, trainer.tokenizer.eos_token_id
    texts = ["<think>\n12\n</think>\n<answer>\n5\n</answer>", "7", "<answer>\n3\n</answer>", "the sum is 40"]

    def sample(input_ids, attention_mask):
        rows = [token_ids(tok, texts[i % 4])[: 3 + i % 8] + [eos] * (i % 2) for i in range(len(input_ids))]
        width = max(map(len, rows))
        rows = [r + [tok.pad_token_id] * (width - len(r)) for r in rows]
        return torch.cat([input_ids, torch.tensor(rows)], dim=1), None  # no vLLM log-probs

    trainer.sample = sample


def loss_grads(trainer, inputs):
    model = trainer.model
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_same_grads(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    scale = max(float(g.abs().max()) for g in b.values())
    assert scale > 1e-3  # the loss really depends on the log-probs
    for name in b:
        assert (a[name] - b[name]).abs().max() <= 1e-5 * max(1.0, scale), name
    norm = lambda grads: torch.stack([g.norm() for g in grads.values()]).norm()  # noqa: E731
    assert abs(norm(a) - norm(b)) <= 1e-5 * norm(b)


@pytest.mark.parametrize("tied, padding_free", [(True, False), (True, True), (False, False), (False, True)])
def test_log_probs_entropy_loss_and_every_gradient_equal_the_logits_path(world, make_trainer, monkeypatch, tied,
                                                                         padding_free):  # fmt: skip
    monkeypatch.setattr(kernels, "POSITIONS_PER_BLOCK", 5)
    model_dir, _ = world
    settings = dict(reward_funcs=[varied], batch_size=2, num_iterations=2, beta=0.04, padding_free=padding_free)
    settings |= dict(score_with_temperature=not tied, temperature=0.7)  # logits / 0.7 in half the cases
    torch.manual_seed(1)  # untied: the same random output layer in both trainers
    models = [AutoModelForCausalLM.from_pretrained(model_dir, tie_word_embeddings=tied) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    ours, theirs = make_trainer(model=models[0], **settings), logits_path(make_trainer(model=models[1], **settings))
    assert (ours.model.lm_head.weight is ours.model.model.embed_tokens.weight) == tied
    batches = []
    for trainer in (ours, theirs):
        scripted(trainer)
        torch.manual_seed(0)
        kept, _ = trainer.generate_experiences(make_batch(trainer, 2, varied=True))
        batches.append(trainer.make_micro_batches(kept)[0])  # pi_old and pi_ref by each path
    a, b = batches
    assert (a.old_action_log_probs - b.old_action_log_probs).abs().max() < 1e-5
    assert (a.ref_action_log_probs - b.ref_action_log_probs).abs().max() < 1e-5
    noise = 0.3 * torch.randn(b.old_action_log_probs.shape, generator=torch.Generator().manual_seed(2))
    a.old_action_log_probs = b.old_action_log_probs = b.old_action_log_probs + noise  # ratios off 1, some clipped
    T = a.action_mask.size(1)
    (lp_a, ent_a), (lp_b, ent_b) = (t.get_action_log_probs(t.model, *t.model_inputs(a), True) for t in (ours, theirs))
    assert lp_a.shape == (8, T) and lp_a.requires_grad and not ent_a.requires_grad
    assert (lp_a - lp_b).abs().max() < 1e-5 and (ent_a - ent_b).abs().max() < 1e-5
    assert ent_b[a.action_mask.bool()].min() > 1.0  # a random model: entropies near log(120)
    (loss_a, grads_a), (loss_b, grads_b) = loss_grads(ours, a), loss_grads(theirs, b)
    assert abs(loss_a - loss_b) < 1e-5 and abs(loss_a) > 1e-3
    assert_same_grads(grads_a, grads_b)
    assert ("lm_head.weight" in grads_a) != tied  # untied: its own gradient, compared too


def test_each_response_token_gets_the_log_prob_the_token_before_it_predicts(make_trainer):
    """Independent of the layouts (padded_sequences, pack_sequences): each sequence alone, unpadded, through a plain
    forward pass; the log-prob of response token j is log softmax(logits at the position before it)[token j]. Two
    rows of other prompt and response lengths, left- and right-padded by hand, in both layouts."""
    prompts, responses = [[5, 17, 9], [40, 8, 33, 21, 2]], [[7, 60, 13, 88], [101, 4]]
    P, T = max(map(len, prompts)), max(map(len, responses))
    for padding_free in (False, True):
        trainer = make_trainer(padding_free=padding_free)
        pad, model = trainer.tokenizer.pad_token_id, trainer.model
        rows = [(P - len(p), p + r, T - len(r)) for p, r in zip(prompts, responses)]  # (left pad, tokens, right)
        ids = torch.tensor([[pad] * left + tokens + [pad] * right for left, tokens, right in rows])
        mask = torch.tensor([[0] * left + [1] * len(tokens) + [0] * right for left, tokens, right in rows])
        got = trainer.get_action_log_probs(model, ids, mask, T).detach()
        for row, (prompt, response) in enumerate(zip(prompts, responses)):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + response])).logits[0].float()  # [P_i + T_i, V]
            log_probs = logits.log_softmax(-1)
            expected = [log_probs[len(prompt) + j - 1, token] for j, token in enumerate(response)]
            assert torch.allclose(got[row, : len(response)], torch.stack(expected), atol=1e-5), (padding_free, row)


def test_three_steps_give_the_same_weights_as_the_logits_path(make_trainer, monkeypatch):
    monkeypatch.setattr(kernels, "POSITIONS_PER_BLOCK", 16)
    settings = dict(reward_funcs=[varied], max_steps=3, batch_size=2, gradient_accumulation_steps=2, eval_steps=1000)
    weights = []
    for make in (make_trainer, lambda **s: logits_path(make_trainer(**s))):
        torch.manual_seed(0)
        trainer = make(**settings)
        scripted(trainer)
        initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        assert trainer.update_steps == 3
        weights.append(trainer.model.state_dict())
    moved = max(float((weights[0][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-3  # Adam at lr 1e-3 moved the weights
    assert max(float((weights[0][k] - weights[1][k]).abs().max()) for k in initial) < 1e-5


def test_bf16_autocast_computes_the_logits_in_bf16_and_the_log_softmax_in_float32(world, monkeypatch):
    """CPU autocast stands in for CUDA's: the output layer's matmuls in bf16 (as autocast runs the output layer),
    log-probs, entropy and every gradient in float32, within bf16's rounding of the logits path."""
    monkeypatch.setattr(kernels, "POSITIONS_PER_BLOCK", 5)
    model = AutoModelForCausalLM.from_pretrained(world[0])
    g = torch.Generator().manual_seed(0)
    ids, labels, weights = torch.randint(0, 120, (3, 20), generator=g), None, torch.randn(3, 19, generator=g)
    labels = ids[:, 1:]

    def run(ours, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if ours:
                with kernels.output_layer_scores(model, labels, temperature=0.7):
                    log_probs = model(ids, logits_to_keep=19).logits[..., 0]
            else:
                logits = model(ids, logits_to_keep=19).logits
                log_probs = (logits / 0.7).float().log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        (log_probs * weights).sum().backward()
        return log_probs.detach(), model.lm_head.weight.grad.clone(), model.model.norm.weight.grad.clone()

    ours, bf16, fp32 = run(True, True), run(False, True), run(False, False)
    assert ours[0].dtype == ours[1].dtype == ours[2].dtype == torch.float32
    assert (ours[0] - bf16[0]).abs().max() < 0.02  # bf16 logits: 8 bits of mantissa
    assert (ours[0] - fp32[0]).abs().max() > 1e-4  # not float32's: the bf16 matmul really ran
    for got, expected in zip(ours[1:], bf16[1:]):
        assert (got - expected).norm() < 0.02 * expected.norm()


def test_a_peft_lora_model_gets_the_same_log_probs_and_gradients(world, make_trainer, monkeypatch):
    from peft import LoraConfig, get_peft_model

    monkeypatch.setattr(kernels, "POSITIONS_PER_BLOCK", 5)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    models = [get_peft_model(AutoModelForCausalLM.from_pretrained(world[0]), lora) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    trainers = [make_trainer(model=models[0]), logits_path(make_trainer(model=models[1]))]
    g = torch.Generator().manual_seed(0)
    ids, weights = torch.randint(0, 120, (4, 24), generator=g), torch.randn(4, 10, generator=g)
    mask = torch.ones_like(ids)
    mask[:2, :5] = 0  # left padding
    results = []
    for trainer in trainers:
        log_probs = trainer.get_action_log_probs(trainer.model, ids, mask, 10)
        (log_probs * weights).sum().backward()
        grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.requires_grad}
        results.append((log_probs.detach(), grads))
    (lp_a, grads_a), (lp_b, grads_b) = results
    assert (lp_a - lp_b).abs().max() < 1e-5
    assert len(grads_a) == 8 and all(g is not None for g in grads_a.values())  # 2 layers x (q, v) x (A, B)
    assert_same_grads(grads_a, grads_b)


def test_a_head_that_is_not_a_linear_layer_is_refused_in_one_line(world):
    model = AutoModelForCausalLM.from_pretrained(world[0])
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match="need a bias-free nn.Linear output layer"):
        with kernels.output_layer_scores(model, torch.zeros(1, 3, dtype=torch.long)):
            pass


def dense_loss(hidden, weight, labels, g):
    """sum(g * log softmax(hidden @ weight^T)[label]) through autograd: the reference."""
    log_probs = (hidden @ weight.T).log_softmax(dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (g * log_probs).sum()


def test_the_output_weights_gradient_is_summed_into_its_grad_in_place_only_where_autograd_would_add_it(monkeypatch):
    """A micro-step after a step's first finds W.grad holding the earlier ones' sum: backward adds its blocks to that
    tensor (no second [V, H]: the memory test below) and the result is what autograd's own add gives, tied embedding
    included. torch.autograd.grad, backward(inputs=) without W and a tensor hook on W see this pass's gradient alone."""
    monkeypatch.setattr(kernels, "POSITIONS_PER_BLOCK", 4)  # 14 positions: 3 blocks of 4 and a partial one of 2
    gen = torch.Generator().manual_seed(0)
    V, H, K = 50, 8, 14
    weight = torch.randn(V, H, generator=gen).requires_grad_()
    ids, labels = torch.randint(0, V, (K,), generator=gen), torch.randint(0, V, (K,), generator=gen)
    g, earlier = torch.randn(K, generator=gen), torch.randn(V, H, generator=gen)

    def ours(tied):
        untied = torch.randn(K, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        hidden = weight[ids] * 1.5 if tied else untied  # tied: W's gradient from both ends
        return (g * kernels.log_probs_from_hidden(hidden, weight, labels)[0]).sum(), hidden

    for tied in (False, True):
        reference = torch.autograd.grad(dense_loss(ours(tied)[1], weight, labels, g), weight)[0]
        assert reference.abs().max() > 1e-2
        weight.grad = earlier.clone()
        ours(tied)[0].backward()
        assert (weight.grad - (earlier + reference)).abs().max() < 1e-5

        weight.grad = earlier.clone()
        assert (torch.autograd.grad(ours(tied)[0], weight)[0] - reference).abs().max() < 1e-5
        assert torch.equal(weight.grad, earlier)  # autograd.grad hands the gradient back, .grad untouched

        loss, hidden = ours(tied)
        loss.backward(inputs=[hidden])
        assert torch.equal(weight.grad, earlier)  # W not among the inputs: its .grad is not this backward's

        seen = []
        hook = weight.register_hook(lambda grad: seen.append(grad.clone()))
        ours(tied)[0].backward()
        hook.remove()
        assert (sum(seen) - reference).abs().max() < 1e-5  # the hook sees this pass's gradient, not the sum so far
        assert (weight.grad - (earlier + reference)).abs().max() < 1e-5  # autograd's own add


PEAK_OF_ONE_PASS = """
import torch
from dapo_utils.kernels import log_probs_from_hidden
V, H = 151936, 256  # Qwen2.5's ids; W [V, H] float32 is 148 MiB, a block's logits [512, V] 297 MiB
weight = (0.02 * torch.randn(V, H)).requires_grad_()  # small logits: no denormals in exp
def rss(kind):
    lines = open("/proc/self/status").read().splitlines()
    return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(kind))
def peak(K, grad):  # forward + backward of K positions: peak RSS over the RSS before, MiB
    hidden, labels = torch.randn(K, H, requires_grad=True), torch.randint(0, V, (K,))
    weight.grad = torch.zeros_like(weight) if grad else None
    base = rss("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    log_probs_from_hidden(hidden, weight, labels)[0].sum().backward()
    return (rss("VmHWM:") - base) / 2**20
peak(64, False), peak(64, True)  # lazy set-up of both paths (thread pools, BLAS buffers), not measured
print(peak(1024, False), peak(1024, True), peak(1536, True))
"""


def test_the_log_prob_stage_holds_one_block_of_logits_whatever_the_positions():
    """Forward + backward of 1,024 positions (2 blocks) and 1,536 (3 blocks) on Qwen2.5's 151,936 ids: one [512, V]
    block of logits (297 MiB) at a time, plus W's gradient (148 MiB) only where W has no .grad yet; with a .grad
    (a micro-step after a step's first) it is summed there, no second [V, H] beside it. Guards against: a block
    kept alive by a view of it while the next is made (+297 MiB), a [V, H] product per block beside the sum
    (+148 MiB from the third block on), a returned [V, H] sum autograd adds to .grad (+148 MiB), the [K, V] logits
    (297 MiB per 512 positions). In a fresh process, where glibc returns freed blocks to the kernel (RSS = live)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="2")
    out = subprocess.run([sys.executable, "-c", PEAK_OF_ONE_PASS], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    first, two_blocks, three_blocks = map(float, out.stdout.split())
    assert 0.9 * 297 <= two_blocks < 297 + 148 / 2, two_blocks  # one block, measured, not zero
    assert three_blocks - two_blocks < 148 / 2, (two_blocks, three_blocks)
    assert 0.9 * (148 + 297) <= first < 148 + 297 + 148 / 2, first  # the new .grad and one block
