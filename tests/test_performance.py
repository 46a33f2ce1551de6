"""train.py's fast paths give the seed's results (benchmarks/seed_paths.py holds the seed's paths).

- padding to the longest:   same log-probs, loss and gradients as padding to max_prompt/generate_length
- log-probs from the hidden states: same log-probs, entropy, loss and gradients as the seed's full
                            float32 log-softmax (float32 and bf16 matmuls), at a fifth of its peak memory or
                            less with Qwen2.5's 151,936-id vocabulary
- reuse_freed_memory:       a CPU trainer's decode steps reuse freed memory instead of faulting it in
- one generate call per batch: one Samples per prompt with the same shapes and semantics as one
                            generate call per prompt
(decoding.decode against the seed's generate: tests/test_decoding.py)
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import make_batch
from dapo_utils import kernels
from train import Samples

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from seed_paths import use_seed_paths  # noqa: E402


def make_seed_trainer(make_trainer, *paths, **settings):
    return use_seed_paths(make_trainer(**settings), *paths)


# ---------- helpers ----------
def varied(prompts, responses, answers):
    """Rewards 0, 1, 2, 3 within every group of 4: every group is kept, advantages are non-zero."""
    return [float(i % 4) for i in range(len(responses))]


def replay(trainer, responses):
    """Replace generation by fixed response ids [N, T] (the same tokens whatever the prompt padding)."""

    def sample(input_ids, attention_mask):
        return torch.cat([input_ids, responses.to(input_ids.device)], dim=1), None

    trainer.sample = sample


def record_samples(trainer):
    """Let generation run, and keep what each generate call returned after the prompt."""
    seen, original = [], trainer.sample

    def sample(input_ids, attention_mask):
        out = original(input_ids, attention_mask)
        seen.append(out[0][:, input_ids.size(1) :].clone())
        return out

    trainer.sample = sample
    return seen


def scripted_responses(tokenizer, rows, width, seed=0):
    """rows x width ids: row i has i % width random ordinary tokens and then EOS (<|im_end|>),
    except row 1 which runs the full width without EOS (cut at the budget); pad after EOS."""
    g = torch.Generator().manual_seed(seed)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    out = torch.full((rows, width), pad, dtype=torch.long)
    for i in range(rows):
        n = width if i == 1 else i % width
        out[i, :n] = torch.randint(3, len(tokenizer), (n,), generator=g)
        if n < width:
            out[i, n] = eos
    return out


def micro_batch(trainer, batch):
    """generate_experiences then make_micro_batches: every kept group of the batch in one micro-batch."""
    torch.manual_seed(0)
    kept, _ = trainer.generate_experiences(batch)
    return trainer.make_micro_batches(kept)[0]


def loss_and_grads(trainer, inputs):
    model = trainer.model
    model.train()
    model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def assert_same_grads(a, b):
    scale = max(float(g.abs().max()) for g in a)
    assert scale > 0  # the loss really depends on the log-probs
    worst = max(float((x - y).abs().max()) for x, y in zip(a, b))
    assert worst <= 1e-5 * max(1.0, scale), (worst, scale)


def perturbed_old_log_probs(inputs, T, seed=1):
    """An offset that moves pi_old a little off pi, so that the ratio (and the loss) depend on the log-probs."""
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(inputs.action_mask.size(0), T, generator=g)


# ---------- 1. padding to the longest = padding to the maximum ----------
@pytest.mark.parametrize("source", ["scripted", "sampled"])
def test_pad_to_longest_gives_the_same_log_probs_loss_and_grads(make_trainer, source):
    # Two prompts of different lengths (left padding in both settings); max_generate_length 12,
    # responses of at most 8 tokens, so pad_to_longest really narrows both ends.
    common = dict(reward_funcs=[varied], batch_size=2, max_prompt_length=160, max_generate_length=12, num_iterations=2)
    longest, full = make_trainer(**common), make_seed_trainer(make_trainer, "pad_to_max", **common)
    batch = make_batch(longest, 2)
    if source == "scripted":
        responses = scripted_responses(longest.tokenizer, 8, 8)
        replay(longest, responses)
    else:  # the model's own samples, replayed to the other trainer
        longest.args.max_generate_length = 8
        seen = record_samples(longest)
    a = micro_batch(longest, batch)
    if source == "sampled":
        responses = seen[0]
    replay(full, responses)
    b = micro_batch(full, batch)

    T = a.action_mask.size(1)
    assert T == responses.size(1) <= 8 and b.action_mask.size(1) == 12
    assert a.prompt_response_ids.size(1) - T < 160 and b.prompt_response_ids.size(1) == 160 + 12
    assert torch.equal(b.action_mask[:, :T], a.action_mask) and not b.action_mask[:, T:].any()
    assert torch.equal(a.advantages, b.advantages)
    # The real tokens each row attends to are the same.
    for row in range(8):
        assert torch.equal(
            a.prompt_response_ids[row][a.attention_mask[row].bool()],
            b.prompt_response_ids[row][b.attention_mask[row].bool()],
        )

    mask = a.action_mask.bool()
    with torch.no_grad():
        lp_a = longest.get_action_log_probs(longest.model, a.prompt_response_ids, a.attention_mask, T)
        lp_b = full.get_action_log_probs(full.model, b.prompt_response_ids, b.attention_mask, 12)
    assert (lp_a[mask] - lp_b[:, :T][mask]).abs().max() < 1e-5
    # pi_old as generate_experiences computed it under each padding, the same on real tokens ...
    assert (a.old_action_log_probs[mask] - b.old_action_log_probs[:, :T][mask]).abs().max() < 1e-5
    # ... then moved off pi by the same amount, so that the loss depends on the log-probs.
    noise = perturbed_old_log_probs(a, T)
    a.old_action_log_probs = a.old_action_log_probs + noise
    b.old_action_log_probs = b.old_action_log_probs + F.pad(noise, (0, 12 - T))

    for mode in ("seed", "token-mean", "seq-mean-token-mean"):
        longest.args.loss_agg_mode = full.args.loss_agg_mode = mode
        loss_a, grads_a = loss_and_grads(longest, a)
        loss_b, grads_b = loss_and_grads(full, b)
        assert abs(loss_a - loss_b) < 1e-5, mode
        assert abs(loss_a) > 1e-3  # not the trivial ratio-1 loss
        assert_same_grads(grads_a, grads_b)


def test_log_probs_from_hidden_states_equal_the_seeds_full_log_softmax(make_trainer):
    trainer = make_trainer(
        reward_funcs=[varied], batch_size=2, max_prompt_length=160, max_generate_length=12, num_iterations=2
    )
    responses = scripted_responses(trainer.tokenizer, 8, 8, seed=3)
    replay(trainer, responses)
    inputs = micro_batch(trainer, make_batch(trainer, 2, offset=2))
    T = inputs.action_mask.size(1)
    inputs.old_action_log_probs = inputs.old_action_log_probs + perturbed_old_log_probs(inputs, T)
    ids, attention = inputs.prompt_response_ids, inputs.attention_mask
    results = {}
    for efficient in (True, False):
        if not efficient:
            use_seed_paths(trainer, "full_log_softmax")
        with torch.no_grad():
            log_probs, entropy = trainer.get_action_log_probs(trainer.model, ids, attention, T, with_entropy=True)
        results[efficient] = (log_probs, entropy, *loss_and_grads(trainer, inputs))
    (lp1, ent1, loss1, grads1), (lp0, ent0, loss0, grads0) = results[True], results[False]
    assert lp1.shape == lp0.shape == (8, T)
    assert (lp1 - lp0).abs().max() < 1e-5  # every position, padding included
    assert (ent1 - ent0).abs().max() < 1e-5
    assert abs(loss1 - loss0) < 1e-5 and abs(loss1) > 1e-3
    assert_same_grads(grads1, grads0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_log_probs_from_hidden_equal_the_reference_formula(dtype):
    """log p[label] = x[label] - logsumexp(x), H = -sum p log p with x = h W^T / tau, and autograd's gradients of
    log p to h and W; float32 results. 3 x 70 positions: 6 blocks of POSITIONS_PER_BLOCK (32) and a partial one."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 70, 16, generator=g)
    weight = (torch.randn(1000, 16, generator=g) / 2).to(dtype)  # bf16: a bf16 model, matmuls in bf16
    labels = torch.randint(0, 1000, (3, 70), generator=g)
    weights = torch.randn(3, 70, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "POSITIONS_PER_BLOCK", 32)
        log_probs, entropy = kernels.log_probs_from_hidden(h, w, labels, temperature=0.7)
        (log_probs * weights).sum().backward()
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    full = F.log_softmax((h0.to(dtype) @ w0.T).float() / 0.7, dim=-1)  # the logits in float32, then / T (as vLLM)
    reference = full.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (reference * weights).sum().backward()
    assert log_probs.dtype == entropy.dtype == torch.float32 and not entropy.requires_grad
    assert h.grad.dtype == torch.float32 and w.grad.dtype == dtype
    assert (log_probs - reference).abs().max() < 1e-5
    assert (entropy - -(full.exp() * full).sum(-1)).abs().max() < 1e-4
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 gradients round to 8 bits
    for got, expected in ((h.grad, h0.grad), (w.grad, w0.grad)):
        assert (got.float() - expected.float()).abs().max() < tolerance * max(1.0, float(expected.abs().max()))


# ---------- 2. memory of the log-probs with a real vocabulary ----------
MEMORY_PROBE = r"""
import json, os, sys
sys.path.insert(0, {root!r})
import torch
import transformers
from train import DapoArguments, DapoTrainer
sys.path.insert(0, os.path.join({root!r}, "benchmarks"))
from seed_paths import use_seed_paths

torch.set_num_threads(1)
efficient, model_dir, output_dir = sys.argv[1] == "1", sys.argv[2], sys.argv[3]

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False

config = transformers.Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(config)
tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
args = DapoArguments(device="cpu", output_dir=output_dir)
trainer = DapoTrainer(model=model, reward_funcs=[lambda prompts, responses, answers: [0.0] * len(responses)], args=args, tokenizer=tokenizer)
if not efficient:
    use_seed_paths(trainer, "full_log_softmax")
N, P, T = 2, 256, 128
ids = torch.randint(0, config.vocab_size, (N, P + T))
mask = torch.ones_like(ids)
mask[:, : P // 4] = 0  # some left padding
with torch.no_grad():
    trainer.get_action_log_probs(model, ids[:, -8:], mask[:, -8:], 4)  # warm up: lazy initialisation
    base = rss()
    exact = reset_peak()
    log_probs = trainer.get_action_log_probs(model, ids, mask, T)
print(json.dumps(dict(extra=peak() - base, exact=exact, shape=list(log_probs.shape), checksum=float(log_probs.double().sum()))))
"""


def test_log_probs_peak_memory_with_a_real_vocabulary(world, tmp_path):
    """Peak RSS of get_action_log_probs (2 rows of 256 + 128 tokens, vocab 151,936) in fresh processes.

    torch's CPU allocations are invisible to tracemalloc, hence the kernel's peak RSS (VmHWM, reset
    right before the call). The seed materialises [2, 384, V] float32 logits, a contiguous copy of
    their [:, :-1] slice inside log_softmax and the [2, 383, V] log-softmax: 3 x 0.43 GiB. The
    efficient path computes the logits of the 256 response positions as one block (0.15 GiB) and their
    float32 passes 32 positions at a time. Issue 22 asks for at least 5x below the seed. (2 rows rather
    than a real micro-batch's 4 keep the test fast; both paths scale linearly in rows.)
    """
    model_dir, _ = world
    script = MEMORY_PROBE.format(root=ROOT)
    procs = {
        efficient: subprocess.Popen(
            [
                sys.executable,
                "-c",
                script,
                "1" if efficient else "0",
                model_dir,
                str(tmp_path / f"out{int(efficient)}"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for efficient in (True, False)
    }
    results = {}
    for efficient, proc in procs.items():
        out, err = proc.communicate(timeout=600)  # a hang fails; generous for a CPU 5x slower than ours
        assert proc.returncode == 0, err[-3000:]
        results[efficient] = json.loads(out.strip().splitlines()[-1])
    ours, seed = results[True], results[False]
    MB = 2**20
    print(
        f"\nget_action_log_probs peak RSS over baseline: efficient {ours['extra'] / MB:.0f} MiB, seed {seed['extra'] / MB:.0f} MiB "
        f"({seed['extra'] / max(ours['extra'], 1):.1f}x; VmHWM reset: {ours['exact'] and seed['exact']})"
    )
    assert ours["shape"] == seed["shape"] == [2, 128]
    assert abs(ours["checksum"] - seed["checksum"]) < 1e-3 * max(1.0, abs(seed["checksum"]))  # same log-probs
    # The seed's [2, 384, 151936] logits and [2, 383, 151936] log-softmax are 0.87 GiB by themselves.
    assert seed["extra"] > 0.8 * 2**30
    assert seed["extra"] > 5 * ours["extra"]


FAULTS_PROBE = r"""
import json, resource, sys
sys.path.insert(0, {root!r})
import torch
import transformers
from train import DapoArguments, DapoTrainer

torch.set_num_threads(1)
config = transformers.Qwen2Config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
torch.manual_seed(0)
model = transformers.Qwen2ForCausalLM(config).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
prompts = torch.randint(0, 100, (8, 16))

def faults_of_a_generate_call():  # the fewest of 3 equal calls after one that grows the heap they will reuse
    faults = []
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=32,
                       min_new_tokens=32, do_sample=True, top_k=50)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(faults[1:])

default = faults_of_a_generate_call()
args = DapoArguments(device="cpu", output_dir=sys.argv[2])
DapoTrainer(model=model, reward_funcs=[lambda prompts, responses, answers: [0.0] * len(responses)], args=args,
            tokenizer=tokenizer)
print(json.dumps(dict(default=default, trainer=faults_of_a_generate_call())))
"""


def test_a_cpu_trainer_reuses_freed_memory_without_page_faults(world, tmp_path):
    """kernels.reuse_freed_memory, which a CPU DapoTrainer calls: each decode step's [8, 151936] logits and their
    sampling temporaries (~5 MB each) are reused from the heap instead of being unmapped and faulted in again.
    Page faults of generating 32 tokens for 8 rows in a fresh process, before and after a trainer is built: the
    fewest of 3 calls after a warm-up call (measured: 14,123-27,945 and 7-8; a single call after the trainer's
    first can still grow the heap: 1,483 once in CI)."""
    model_dir, _ = world
    script = FAULTS_PROBE.format(root=ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", script, model_dir, str(tmp_path / "out")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    faults = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"\npage faults of one 8 x 32-token generate call: glibc's default {faults['default']}, after "
        f"DapoTrainer {faults['trainer']}"
    )
    assert faults["default"] > 10_000  # 32 steps x ~1,200 pages of logits each, at least
    assert faults["trainer"] < faults["default"] / 20


# ---------- 3. one generate call per batch = one per prompt ----------
def check_samples(trainer, samples, batch, G, pad_to_max=False):
    """One Samples per prompt, with consistent shapes, left-padded prompts and prefix action masks."""
    tok = trainer.tokenizer
    assert len(samples) == len(batch["prompt"]) and all(isinstance(s, Samples) for s in samples)
    eos = torch.tensor(trainer.eos_token_ids)
    for s, prompt, answer in zip(samples, batch["prompt"], batch["answer"]):
        T = s.num_actions
        P = s.prompt_response_ids.size(1) - T
        assert s.prompt == prompt and int(s.answer) == int(answer)
        assert s.prompt_response_ids.shape == s.attention_mask.shape == (G, P + T)
        assert s.response_ids.shape == s.action_mask.shape == (G, T)
        assert torch.equal(s.response_ids, s.prompt_response_ids[:, P:])
        assert torch.equal(s.attention_mask[:, P:], s.action_mask)
        assert torch.equal(s.response_length, s.action_mask.sum(dim=1))
        ids, mask = trainer.encode_prompts([prompt])
        prompt_ids = ids[0][mask[0].bool()]
        for row in range(G):
            real = s.attention_mask[row, :P]
            n = int(real.sum())
            assert real.tolist() == [0] * (P - n) + [1] * n  # left padding
            assert s.prompt_response_ids[row, P - n : P].tolist() == prompt_ids.tolist()  # this prompt's tokens
            length = int(s.response_length[row])
            assert s.action_mask[row].tolist() == [1] * length + [0] * (T - length)  # a prefix
            eos_at = torch.isin(s.response_ids[row, :length], eos).nonzero().flatten().tolist()
            if length < T:  # ended by its first EOS, which counts
                assert eos_at == [length - 1]
            else:  # ran to the end of the batch's responses: no EOS before the last token
                assert eos_at in ([], [T - 1])
            assert (s.response_ids[row, length:] == tok.pad_token_id).all()
        if pad_to_max:
            assert (P, T) == (trainer.args.max_prompt_length, trainer.args.max_generate_length)


@pytest.mark.parametrize("pad_to_longest", [True, False])
def test_batch_generation_same_samples_as_one_call_per_prompt(make_trainer, pad_to_longest):
    G = 2
    settings = dict(num_generations=G, max_generate_length=6, max_prompt_length=160, batch_size=3)
    padding = () if pad_to_longest else ("pad_to_max",)
    by_batch = make_seed_trainer(make_trainer, *padding, **settings) if padding else make_trainer(**settings)
    by_prompt = make_seed_trainer(make_trainer, "per_prompt_generate", *padding, **settings)
    batch = make_batch(by_batch, 3, varied=True)
    encoded = [by_batch.encode_prompts([p]) for p in batch["prompt"]]
    prompt_tokens = [tuple(ids[0][mask[0].bool()].tolist()) for ids, mask in encoded]
    assert len({len(t) for t in prompt_tokens}) > 1  # prompts of different lengths: left padding matters

    # Real sampling: shapes and semantics.
    calls = {}
    for name, trainer in (("batch", by_batch), ("prompt", by_prompt)):
        seen = record_samples(trainer)
        torch.manual_seed(0)
        samples = trainer.generate_samples(batch)
        calls[name] = [r.size(0) for r in seen]
        check_samples(trainer, samples, batch, G, pad_to_max=not pad_to_longest)
    assert calls == {"batch": [3 * G], "prompt": [G, G, G]}

    # The same responses per prompt, whichever way they are generated: the same Samples.
    responses = scripted_responses(by_batch.tokenizer, 3 * G, 5, seed=7)  # every row ends with EOS but row 1

    def by_prompt_sampler(trainer):
        def sample(input_ids, attention_mask):
            rows = []
            for ids, mask in zip(input_ids, attention_mask):
                index = prompt_tokens.index(tuple(ids[mask.bool()].tolist()))  # which prompt this row belongs to
                rows.append(responses[index * G + len(rows) % G])
            return torch.cat([input_ids, torch.stack(rows)], dim=1), None

        trainer.sample = sample

    by_prompt_sampler(by_batch)
    by_prompt_sampler(by_prompt)
    batched, separate = by_batch.generate_samples(batch), by_prompt.generate_samples(batch)
    for x, y in zip(batched, separate):
        assert torch.equal(x.response_length, y.response_length)
        for row in range(G):
            assert torch.equal(
                x.prompt_response_ids[row][x.attention_mask[row].bool()],
                y.prompt_response_ids[row][y.attention_mask[row].bool()],
            )
            assert torch.equal(
                x.response_ids[row][x.action_mask[row].bool()], y.response_ids[row][y.action_mask[row].bool()]
            )
        for field in ("prompt_response_ids", "response_ids", "attention_mask", "action_mask"):  # each group as
            assert torch.equal(getattr(x, field), getattr(y, field)), field  # wide as alone: identical tensors
