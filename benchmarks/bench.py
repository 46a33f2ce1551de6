#!/usr/bin/env python
"""Speed and memory of train.py's optimisations, on a random model that runs anywhere.

    python benchmarks/bench.py                         # --shape small on CPU (a few minutes on 2 cores)
    python benchmarks/bench.py --shape qwen2.5-1.5b    # Qwen2.5-1.5B's real shape, on a GPU
    python benchmarks/bench.py --estimate              # peak GPU memory of the 1.5B default, from shapes

What it runs. For every configuration (all optimisations on = train.py's defaults; each one turned
off alone; gradient checkpointing turned on; all off; and "seed" = all off plus the seed's
old-log-prob forward pass, which train.py now skips when num_iterations == 1) a fresh worker
process builds the same random model (same seed, same weights), a DapoTrainer with the seed's
default settings (num_generations 4, batch_size 1, gradient_accumulation_steps 2,
max_prompt_length 256, max_generate_length 128, num_iterations 1, Adam) and runs one warm-up
optimizer step (on --warmup_tokens-long responses: it only has to run every code path once and
create Adam's states), then --steps measured ones through DapoTrainer.train_epochs, the real
loop. The table averages trainer.history over the measured steps, plus a wall clock per step and
the peak memory over them: CUDA: torch.cuda.max_memory_allocated, reset after warm-up; CPU: the
kernel's peak RSS (VmHWM, reset after warm-up through /proc/self/clear_refs), in total and above
the RSS before the measured steps. Configurations that do the same work as the default are
skipped unless named in --configs (-bf16/-tf32 on CPU, -batch_generation with batch_size 1). A
last worker checks that the configurations give the same loss, log-probs and gradients on one
fixed micro-batch.

The model. A random Qwen2 from a config, never downloaded: "small" (4 layers, hidden 256, for a
CPU) or "qwen2.5-1.5b" (the real shape, for a GPU). Both have Qwen2.5's real vocabulary of
151,936 ids, so the lm_head and the log-softmax cost what they cost in the real run.

The tokenizer and data. tiny_world's synthetic GSM8K-style problems and its 120-id tokenizer (its
prompts are 101-132 tokens, in the range of real GSM8K prompts under Qwen's tokenizer). The model
samples ids up to 151,935, which that tokenizer does not know: a Hugging Face fast tokenizer drops
unknown ids silently, so responses would decode to almost empty strings and the reward phase would
cost nothing. Instead the tokenizer's batch_decode is wrapped to decode `id % len(tokenizer)`:
every sampled id becomes one known token, responses decode to text of their real token length,
and the reward functions do their real amount of work. Nothing touches sampling itself (no logits
processor, no bad_words_ids): the generate call is exactly the trainer's. EOS detection uses the
raw ids, so this does not change response lengths either. fast_sampling draws other random numbers
than generate's multinomial, from the same distribution; responses still run to the maximum.

What that implies. A random model almost never samples an EOS id (2 of 151,936 ids), so every
response runs to max_generate_length: the worst case for sampling time and memory, and padding
responses "to the longest" saves nothing here (the longest is the maximum). With batch_size 1,
batch_generation is also a no-op (one prompt per generate call either way). Rewards of random
text are almost always equal within a group, so the seed's dynamic sampling would skip every
group and never train: the benchmark uses filter_metric="none" (every group trains; one sampling
round per micro-batch, for every configuration alike).
"""

import argparse
import contextlib
import inspect
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = {
    # CPU-sized, but with the real vocabulary, so that lm_head / log-softmax costs are realistic.
    "small": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=2),
    # Qwen2.5-1.5B(-Instruct)'s config.json.
    "qwen2.5-1.5b": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2),
}
COMMON_SHAPE = dict(vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})

OFF = dict(pad_to_longest=False, batch_generation=False, efficient_log_probs=False, fast_sampling=False, bf16=False, tf32=False, gradient_checkpointing=False)
# name -> (DapoArguments overrides, emulate the seed's old-log-prob pass, needs CUDA)
CONFIGS = {
    "default (all on)": ({}, False, False),
    "-pad_to_longest": (dict(pad_to_longest=False), False, False),
    "-batch_generation": (dict(batch_generation=False), False, False),
    "-efficient_log_probs": (dict(efficient_log_probs=False), False, False),
    "-fast_sampling": (dict(fast_sampling=False), False, False),
    "-bf16": (dict(bf16=False), False, True),
    "-tf32": (dict(tf32=False), False, True),
    "+gradient_checkpointing": (dict(gradient_checkpointing=True), False, False),
    "all off": (OFF, False, False),
    "seed (all off + old-lp pass)": (OFF, True, False),
}
WORKER_OPTIONS = ("shape", "device", "steps", "warmup", "warmup_tokens", "seed", "num_generations", "batch_size", "gradient_accumulation_steps",
                  "num_iterations", "max_prompt_length", "max_generate_length", "threads")
REFERENCE = "all off"  # the seed's computation of the loss: full logits, float32 log-softmax, full widths


# ============================================================
# Helpers shared by the workers
# ============================================================
def model_config(shape, tokenizer):
    from transformers import Qwen2Config

    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    return Qwen2Config(
        **SHAPES[shape], **COMMON_SHAPE, bos_token_id=endoftext, eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id, dtype="float32"
    )


def build_model(shape, tokenizer, device, seed):
    """A random float32 Qwen2 of the given shape, initialised on `device` (the same weights for the same seed)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    config = model_config(shape, tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    endoftext, im_end = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    model.generation_config = GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=tokenizer.pad_token_id)
    return model


def load_tokenizer(model_dir):
    """tiny_world's tokenizer, with a batch_decode that maps ids beyond it into it (see the module docstring)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    size, batch_decode = len(tokenizer), tokenizer.batch_decode

    def decode_in_vocabulary(sequences, *args, **kwargs):
        if torch.is_tensor(sequences):
            sequences = sequences.remainder(size)
        else:
            sequences = [[int(i) % size for i in row] for row in sequences]
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
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def synchronize(device):
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def dapo_arguments(opts, world, output_dir, overrides):
    from train import DapoArguments

    model_dir, data_dir = world
    return DapoArguments(
        model_path=model_dir,
        data_path=data_dir,
        output_dir=output_dir,
        device=opts.device,
        seed=opts.seed,
        epoch=1,
        max_steps=opts.warmup + opts.steps,
        eval_steps=10**9,
        save_steps=10**9,
        num_generations=opts.num_generations,
        batch_size=opts.batch_size,
        gradient_accumulation_steps=opts.gradient_accumulation_steps,
        num_iterations=opts.num_iterations,
        max_prompt_length=opts.max_prompt_length,
        max_generate_length=opts.max_generate_length,
        filter_metric="none",  # see the module docstring
        **overrides,
    )


def make_trainer(opts, world, output_dir, overrides, seed_old_pass=False):
    import torch

    from reward_func import correctness_reward, digit_reward, hard_format_reward, mark_reward
    from train import DapoTrainer, GSM8KDataset

    class BenchTrainer(DapoTrainer):
        """DapoTrainer plus counters, a wall clock per optimizer step and peak-memory resets."""

        def generate_samples(self, inputs):
            samples = super().generate_samples(inputs)
            self.bench_sampled_tokens += sum(int(s.response_length.sum()) for s in samples)
            return samples

        def generate_experiences(self, inputs):
            result = super().generate_experiences(inputs)
            if seed_old_pass and self.args.num_iterations == 1:
                # The seed computed pi_old even with a single pass over each batch, where it equals
                # logp.detach(). Same cost as the seed: one no-grad forward per kept group.
                start = time.perf_counter()
                with torch.no_grad():
                    for ids, mask, action_mask in zip(result["prompt_response_ids"], result["attention_mask"], result["action_mask"]):
                        self.get_action_log_probs(self.model, ids, mask, action_mask.size(1))
                synchronize(self.args.device)
                self.metrics["time/old_ref_log_probs"][-1] += time.perf_counter() - start
            return result

        def train_step(self, model, inputs, optimizer, step):
            self.bench_widths.append(tuple(inputs["prompt_response_ids"].shape))
            return super().train_step(model, inputs, optimizer, step)

        def log_step(self, *args, **kwargs):  # (progress) in older train.py versions
            super().log_step(*args, **kwargs)
            synchronize(self.args.device)
            now = time.perf_counter()
            record = self.history[-1]
            record["bench/wall"] = now - self.bench_clock
            record["bench/sampled_tokens"] = self.bench_sampled_tokens
            record["bench/widths"] = self.bench_widths
            self.bench_sampled_tokens, self.bench_widths = 0, []
            if self.update_steps == opts.warmup:  # measured steps start now
                self.generation_config.max_new_tokens = self.args.max_generate_length
                self.bench_start_memory()
            self.bench_clock = time.perf_counter()

        def bench_start_memory(self):
            import gc

            gc.collect()
            if self.args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
                self.bench_base = torch.cuda.memory_allocated()
            else:
                self.bench_peak_reset = reset_peak_rss()
                self.bench_base = rss_bytes()

    args = dapo_arguments(opts, world, output_dir, overrides)
    tokenizer = load_tokenizer(world[0])
    model = build_model(opts.shape, tokenizer, opts.device, opts.seed)
    trainer = BenchTrainer(
        model=model,
        reward_funcs=[correctness_reward, digit_reward, hard_format_reward, mark_reward],
        args=args,
        train_dataset=GSM8KDataset(world[1], tokenizer, split="train"),
        eval_dataset=GSM8KDataset(world[1], tokenizer, split="test"),
        tokenizer=tokenizer,
    )
    trainer.bench_sampled_tokens, trainer.bench_widths = 0, []
    if opts.device.startswith("cuda"):
        # train.py only ever switches TF32 on (a process-wide flag); make "-tf32" mean off here.
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(args.tf32)
    return trainer


# ============================================================
# Worker 1: timing and memory of one configuration
# ============================================================
def run_config(opts, world, name):
    import torch

    overrides, seed_old_pass, _ = CONFIGS[name]
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(opts, world, output_dir, overrides, seed_old_pass)
        trainer.progress = _NoProgress()  # train() would open a tqdm bar here
        if opts.warmup:  # warm-up steps run every code path (and create Adam's states) on short responses
            trainer.generation_config.max_new_tokens = min(opts.warmup_tokens, opts.max_generate_length)
        synchronize(opts.device)
        trainer.bench_clock = time.perf_counter()
        if opts.warmup == 0:
            trainer.bench_start_memory()
        # train() without its initial evaluation; older train.py versions took the bar as an argument.
        if inspect.signature(trainer.train_epochs).parameters:
            trainer.train_epochs(trainer.progress)
        else:
            trainer.train_epochs()
        measured = trainer.history[opts.warmup :]
        if len(measured) < opts.steps:
            raise RuntimeError(f"only {len(measured)} measured steps ran; the data set is too small")
        keys = ["time/sampling", "time/reward", "time/old_ref_log_probs", "time/training", "bench/wall", "num_tokens", "bench/sampled_tokens", "completions/mean_length"]
        result = {key: sum(r.get(key, 0.0) for r in measured) / len(measured) for key in keys}
        result["widths"] = sorted({w for r in measured for w in r["bench/widths"]})
        result["loss"] = [r["loss"] for r in measured]
        if opts.device.startswith("cuda"):
            result["peak_bytes"] = torch.cuda.max_memory_allocated()
            result["peak_delta_bytes"] = result["peak_bytes"] - trainer.bench_base
            result["peak_kind"] = "cuda max_memory_allocated"
        else:
            result["peak_bytes"] = peak_rss_bytes()
            result["peak_delta_bytes"] = result["peak_bytes"] - trainer.bench_base
            result["peak_kind"] = "peak RSS (VmHWM, reset after warm-up)" if trainer.bench_peak_reset else "peak RSS (ru_maxrss, warm-up included)"
    return result


class _NoProgress:
    def set_postfix(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass


# ============================================================
# Worker 2: the same loss on identical inputs
# ============================================================
def pad_to_full_width(inputs, max_prompt_length, max_generate_length, pad_token_id):
    """What pad_to_longest=False makes of the same tokens: prompts left-padded to max_prompt_length,
    responses right-padded to max_generate_length (masked out)."""
    import torch.nn.functional as F

    T = inputs["action_mask"].size(1)
    P = inputs["prompt_response_ids"].size(1) - T
    left, right = max_prompt_length - P, max_generate_length - T
    out = dict(inputs)
    out["prompt_response_ids"] = F.pad(inputs["prompt_response_ids"], (left, right), value=pad_token_id)
    out["attention_mask"] = F.pad(inputs["attention_mask"], (left, right), value=0)
    for key in ("action_mask", "old_action_log_probs"):
        out[key] = F.pad(inputs[key], (0, right))
    return out


def run_loss_check(opts, world, names):
    """compute_loss + backward on one fixed micro-batch under each configuration's log-prob settings."""
    import torch

    from train import pad_and_cat_groups

    with tempfile.TemporaryDirectory() as output_dir:
        trainer = make_trainer(opts, world, output_dir, {})
        args, model = trainer.args, trainer.model
        batch = next(iter(torch.utils.data.DataLoader(trainer.train_dataset, batch_size=opts.batch_size, shuffle=False)))
        inputs = pad_and_cat_groups(trainer.generate_experiences(batch), trainer.tokenizer.pad_token_id)
        mask = inputs["action_mask"]
        N, T = mask.shape
        # Make the loss depend on the log-probs: num_iterations == 1 gives ratio 1 and loss = -mean(A)
        # whatever they are. A fixed pi_old a little off pi, and fixed non-zero advantages.
        g = torch.Generator().manual_seed(0)
        args.num_iterations = 2
        args.efficient_log_probs, args.bf16 = False, False
        with torch.no_grad():
            log_probs = trainer.get_action_log_probs(model, inputs["prompt_response_ids"], inputs["attention_mask"], T)
        inputs["old_action_log_probs"] = (log_probs + 0.2 * torch.randn(N, T, generator=g).to(log_probs.device)) * mask
        inputs["advantages"] = torch.randn(N, generator=g).to(log_probs.device)
        inputs["num_step_tokens"] = int(mask.sum())
        full = pad_to_full_width(inputs, args.max_prompt_length, args.max_generate_length, trainer.tokenizer.pad_token_id)

        # The reference first: its gradients are kept, every other configuration's are compared and dropped.
        names = sorted(names, key=lambda name: name != REFERENCE)
        out, ref = {}, None
        for name in names:
            overrides, _, _ = CONFIGS[name]
            settings = {**dict(efficient_log_probs=True, bf16=True, tf32=True, gradient_checkpointing=False, pad_to_longest=True), **overrides}
            args.efficient_log_probs, args.bf16 = settings["efficient_log_probs"], settings["bf16"]
            if opts.device.startswith("cuda"):
                torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = settings["tf32"]
            if settings["gradient_checkpointing"]:
                model.gradient_checkpointing_enable()
            else:
                model.gradient_checkpointing_disable()
            x = inputs if settings["pad_to_longest"] else full
            model.train()
            model.zero_grad(set_to_none=True)
            loss = trainer.compute_loss(model, x)
            loss.backward()
            with torch.no_grad():
                lp = trainer.get_action_log_probs(model, x["prompt_response_ids"], x["attention_mask"], x["action_mask"].size(1))[:, :T]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
            lp = lp[mask.bool()].double()
            if ref is None:  # the first row is the reference
                norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
                ref = (loss.item(), lp, [g.detach().clone() for g in grads], norm)
            diff = math.sqrt(sum(float((g.double() - r.double()).pow(2).sum()) for g, r in zip(grads, ref[2])))
            out[name] = dict(loss=loss.item(), loss_diff=abs(loss.item() - ref[0]), log_prob_diff=float((lp - ref[1]).abs().max()), grad_rel_diff=diff / max(ref[3], 1e-30))
        model.gradient_checkpointing_disable()
    return dict(rows=out, shape=[N, T], tokens=int(mask.sum()), reference=names[0])


# ============================================================
# --estimate: peak GPU memory of the default configuration, from the shapes
# ============================================================
def parameter_count(shape):
    s = {**SHAPES[shape], **COMMON_SHAPE}
    H, I, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = s["num_key_value_heads"] * (H // s["num_attention_heads"])
    per_layer = (H * H + H) + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H  # q(+b), k, v(+b), o, MLP, 2 norms
    embeddings = V * H * (1 if s["tie_word_embeddings"] else 2)
    return L * per_layer + embeddings + H


def estimate(opts):
    """Print the estimated peak GPU memory of the default (and the all-off) configuration."""
    s = {**SHAPES[opts.estimate_shape], **COMMON_SHAPE}
    H, I, L, V = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = s["num_key_value_heads"] * (H // s["num_attention_heads"])
    n = parameter_count(opts.estimate_shape)
    N = opts.batch_size * opts.num_generations  # rows of one micro-batch
    P, T = opts.max_prompt_length, opts.max_generate_length  # worst case: both full
    S = P + T
    GB = 2**30

    def activations(bytes_per, tokens):
        # Tensors autograd keeps per token and layer (SDPA/flash attention: no [S, S] scores kept):
        # 2 RMSNorms keep their float32 input and normalised output (4 x 4H bytes); q, k, v
        # projections' outputs and rotated q, k; attention output; o_proj and MLP inputs; MLP's
        # gate, up, silu(gate) and product (4 x I); the residual stream stays float32 (weights are float32).
        per_token_layer = 16 * H + bytes_per * ((H + 2 * kv) + (H + kv) + H + H + H + 4 * I)
        return L * tokens * per_token_layer

    static = dict(params=4 * n, grads=4 * n, adam=8 * n)
    rows = []
    for label, bf16, efficient, width in (("default (all on)", True, True, S), ("all off (seed)", False, False, S)):
        b = 2 if bf16 else 4
        act = activations(b, N * width)
        weight_cache = 2 * n if bf16 else 0  # autocast keeps a bf16 copy of every weight during forward
        if efficient:
            logits = N * T * V * b  # the T scoring positions' logits, which SelectiveLogSoftmax keeps for backward
            logits_peak = logits + N * T * V * b + 2 * T * V * 4  # + their gradient and one row's float32 temporaries
        else:
            logits = N * S * V * b + (N * S * V * 4 if b != 4 else 0) + N * S * V * 4  # logits, .float(), log_softmax out
            logits_peak = logits + 2 * N * S * V * 4  # + its gradient and log_softmax backward's temporary
        total = sum(static.values()) + act + weight_cache + logits_peak
        rows.append((label, act, weight_cache, logits_peak, total))

    print(f"ESTIMATE (from shapes, not measured) of peak GPU memory, {opts.estimate_shape}: {n / 1e9:.3f} B parameters")
    print(f"  micro-batch: {N} rows x (P={P} + T={T}) tokens (both at their maximum: the worst case)")
    print(f"  float32 parameters {static['params'] / GB:6.2f} GiB, gradients {static['grads'] / GB:6.2f} GiB, Adam m+v {static['adam'] / GB:6.2f} GiB"
          f"  = {sum(static.values()) / GB:.2f} GiB static")
    print(f"  {'configuration':<22}{'activations':>13}{'bf16 weights':>14}{'logits+lsm':>12}{'peak total':>12}")
    for label, act, cache, logits, total in rows:
        print(f"  {label:<22}{act / GB:>10.2f} GiB{cache / GB:>10.2f} GiB{logits / GB:>8.2f} GiB{total / GB:>8.2f} GiB")
    print("  (sampling's KV cache, ~" f"{2 * L * 2 * kv * S * N / GB * 1024:.0f} MiB in bf16, is freed before training; allocator "
          "fragmentation and CUDA context, ~1-3 GiB, are not included)")


# ============================================================
# The driver
# ============================================================
def run_worker(opts, world, task):
    """Run `task` (a configuration name or "losscheck") in a fresh Python process; return its JSON result."""
    command = [sys.executable, os.path.abspath(__file__), f"--_worker={task}", f"--_world={json.dumps(world)}"] + opts.passthrough
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_RESULT "):
            return json.loads(line[len("BENCH_RESULT ") :])
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"worker {task!r} failed with exit code {proc.returncode}")


def format_table(opts, results, device_name):
    default = results.get("default (all on)")
    head = (f"{'configuration':<30}{'step s':>8}{'x def':>7}{'sample':>8}{'reward':>8}{'old/ref':>8}{'train':>8}"
            f"{'smp tok/s':>10}{'trn tok/s':>10}{'peak GiB':>10}{'+GiB':>7}  widths N x (P+T)")
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        step = r["bench/wall"]
        ratio = step / default["bench/wall"] if default else math.nan
        widths = ",".join(f"{n}x{w}" for n, w in sorted(set(map(tuple, r["widths"]))))
        lines.append(
            f"{name:<30}{step:>8.2f}{ratio:>7.2f}{r['time/sampling']:>8.2f}{r['time/reward']:>8.3f}{r['time/old_ref_log_probs']:>8.2f}"
            f"{r['time/training']:>8.2f}{r['bench/sampled_tokens'] / max(r['time/sampling'], 1e-9):>10.1f}"
            f"{r['num_tokens'] / max(r['time/training'], 1e-9):>10.1f}{r['peak_bytes'] / 2**30:>10.2f}{r['peak_delta_bytes'] / 2**30:>7.2f}  {widths}"
        )
    kinds = sorted({r["peak_kind"] for r in results.values()})
    lines.append("")
    best = f", fastest of {opts.repeats} runs" if opts.repeats > 1 else ""
    lines.append(f"step s: wall seconds per optimizer step (mean of {opts.steps} after {opts.warmup} warm-up{best}); sample/reward/old/ref/train: "
                 "trainer.history's per-step phase totals; x def: step time / default's.")
    lines.append("smp tok/s: sampled response tokens / sampling seconds; trn tok/s: trained (action-mask) tokens / training seconds.")
    lines.append(f"peak GiB: {', '.join(kinds)} over the measured steps; +GiB: that minus the level before them "
                 f"(model{', Adam states' if opts.warmup else ''} and allocator already in place). Device: {device_name}.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small", help="model shape (random weights); default: small")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--steps", type=int, default=None, help="measured optimizer steps per configuration (default: 1 on CPU, 3 on CUDA)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up optimizer steps first (default 1)")
    parser.add_argument("--warmup_tokens", type=int, default=16, help="max new tokens per response in warm-up steps (default 16)")
    parser.add_argument("--configs", default=None, help="comma-separated subset of: " + "; ".join(CONFIGS) + ". Default: all "
                        "but the no-ops (-bf16/-tf32 on CPU, -batch_generation with batch_size 1)")
    parser.add_argument("--repeats", type=int, default=1, help="run the configurations this many times, in alternating order, "
                        "and report each one's fastest run (steadier on a shared machine)")
    parser.add_argument("--no_loss_check", action="store_true", help="skip the same-loss-on-identical-inputs check")
    parser.add_argument("--estimate", action="store_true", help="only print the estimated peak GPU memory of the default configuration")
    parser.add_argument("--estimate_shape", choices=sorted(SHAPES), default="qwen2.5-1.5b", help="shape for --estimate (default qwen2.5-1.5b)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--num_iterations", type=int, default=1)
    parser.add_argument("--max_prompt_length", type=int, default=256)
    parser.add_argument("--max_generate_length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default). On a CPU shared with other "
                        "jobs, --threads 1 gives far steadier numbers (a descheduled thread stalls every parallel op)")
    parser.add_argument("--json", default=None, help="also write all results to this JSON file")
    parser.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_world", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)

    if opts.estimate:
        estimate(opts)
        return None

    import torch

    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.device is None:
        opts.device = "cuda" if torch.cuda.is_available() else "cpu"
    if opts.steps is None:
        opts.steps = 3 if opts.device.startswith("cuda") else 1
    opts.passthrough = [f"--{key}={getattr(opts, key)}" for key in WORKER_OPTIONS]
    cuda = opts.device.startswith("cuda")

    if opts._worker:  # inside a worker process
        world = json.loads(opts._world)
        result = run_loss_check(opts, world, json.loads(opts._worker[len("losscheck:"):])) if opts._worker.startswith("losscheck:") else run_config(opts, world, opts._worker)
        print("BENCH_RESULT " + json.dumps(result))
        return result

    skipped = {}
    if opts.configs:
        names = [n.strip() for n in opts.configs.split(",")]
    else:
        names = list(CONFIGS)
        if not cuda:
            skipped.update({"-bf16": "bf16 autocast acts on CUDA only", "-tf32": "TF32 acts on CUDA only"})
        if opts.batch_size == 1:
            skipped["-batch_generation"] = "batch_size 1: one prompt per generate call either way"
        names = [n for n in names if n not in skipped]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; choose from {list(CONFIGS)}")
    device_name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} torch threads, {os.cpu_count()} cores"

    from tiny_world import build_tiny_world

    prompts_needed = (opts.warmup + opts.steps) * opts.gradient_accumulation_steps * opts.batch_size
    with tempfile.TemporaryDirectory() as root:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):  # datasets' progress bars
            world = list(build_tiny_world(root, num_train=max(64, prompts_needed), num_test=8, seed=0))
        print(f"shape {opts.shape}: {parameter_count(opts.shape) / 1e6:.1f} M parameters, vocabulary 151,936; device {device_name}")
        print(f"settings: num_generations {opts.num_generations}, batch_size {opts.batch_size}, gradient_accumulation_steps "
              f"{opts.gradient_accumulation_steps}, max_prompt_length {opts.max_prompt_length}, max_generate_length "
              f"{opts.max_generate_length}, num_iterations {opts.num_iterations}, filter_metric none; "
              f"{opts.warmup} warm-up + {opts.steps} measured steps per configuration", flush=True)
        for name, why in skipped.items():
            print(f"  {name}: skipped, the same work as the default here ({why})")
        results = {}
        for repeat in range(opts.repeats):  # alternate the order, keep each configuration's fastest run
            for name in names if repeat % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                result = run_worker(opts, world, name)
                print(f"  {name}: {result['bench/wall']:.2f} s/step  ({time.perf_counter() - start:.0f} s with set-up)", flush=True)
                if name not in results or result["bench/wall"] < results[name]["bench/wall"]:
                    results[name] = result
        results = {name: results[name] for name in names}
        check = None
        if not opts.no_loss_check:
            check_names = [n for n in dict.fromkeys(names + [REFERENCE]) if not CONFIGS[n][1]]  # the seed row computes the same loss as all off
            check = run_worker(opts, world, "losscheck:" + json.dumps(check_names))

    print()
    print(format_table(opts, results, device_name))
    if "default (all on)" in results:
        base = results["default (all on)"]["bench/wall"]
        for other in ("all off", "seed (all off + old-lp pass)"):
            if other in results:
                speedup = results[other]["bench/wall"] / base
                print(f"speed-up of the default over {other!r}: {speedup:.2f}x  (target >= 2x: {'MET' if speedup >= 2 else 'NOT MET'})")
    if check:
        print()
        print(f"same loss on identical inputs: one fixed micro-batch of {check['shape'][0]} x {check['shape'][1]} response tokens "
              f"({check['tokens']} unmasked), fixed advantages and pi_old; each row's log-prob settings vs {check['reference']!r}"
              + (" (the seed's float32 computation)" if check["reference"] == REFERENCE else ""))
        print(f"  {'configuration':<30}{'loss':>14}{'|d loss|':>11}{'max|d logp|':>13}{'|d grad|/|grad|':>17}")
        for name, row in check["rows"].items():
            print(f"  {name:<30}{row['loss']:>14.8f}{row['loss_diff']:>11.2e}{row['log_prob_diff']:>13.2e}{row['grad_rel_diff']:>17.2e}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(dict(results=results, loss_check=check, device=device_name, options={k: v for k, v in vars(opts).items() if k != "passthrough"}), f, indent=1)
    return results


if __name__ == "__main__":
    main()
