#!/usr/bin/env python
"""LoRA with use_vllm: the time to sync vLLM after an optimizer step, merged weights against the adapters alone.

    python benchmarks/lora_vllm_sync.py [--shape small] [--lora_r 16] [--rounds 5]

One random Qwen2 of bench.py's shape (Qwen2.5's 151,936-token vocabulary) with peft LoRA adapters on every linear
layer of the decoder, and two vLLM engines in this process built from it (VllmSampler): "merged" gets
W + (alpha / r) B A for every weight after each step (reload_weights, the default), "adapters" keeps the base
and gets the adapters alone (vllm_sync_adapters: peft's files written, then reloaded in place by vLLM's LoRA
manager). Each round moves every B, then syncs each engine (in turn, alternating which goes first) and times
it; the table gives the median. Then both engines answer one prompt greedily and their log-probs are compared
with the policy's own (the gap).
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="small")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    from bench import shape_config
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dapo_utils.vllm_sampler import VllmSampler

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape_config(opts.shape), dtype="float32"))
    model = get_peft_model(model, LoraConfig(r=opts.lora_r, lora_alpha=2 * opts.lora_r, target_modules="all-linear"))
    samplers = {}
    for name, rank in (("merged", 0), ("adapters", opts.lora_r)):
        start = time.perf_counter()
        samplers[name] = VllmSampler(model, max_model_len=256, lora_rank=rank)
        print(f"{name}: engine built in {time.perf_counter() - start:.1f} s", flush=True)
    times = {name: [] for name in samplers}
    for i in range(opts.rounds):
        with torch.no_grad():
            for p in (p for n, p in model.named_parameters() if "lora_B" in n):
                p.add_(torch.randn_like(p) * 0.01)  # an optimizer step
        for name in sorted(samplers, reverse=i % 2 == 1):
            start = time.perf_counter()
            samplers[name].load_weights(model)
            times[name].append(time.perf_counter() - start)
    adapter_bytes = os.path.getsize(os.path.join(samplers["adapters"].adapter_dir, "adapter_model.safetensors"))
    merged_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if "lora_" not in n)
    prompt = torch.arange(5, 37).unsqueeze(0)  # [1, 32]
    print(f"\nshape {opts.shape}, r {opts.lora_r}, {opts.rounds} rounds, median seconds per sync:")
    print(f"{'sync':9} {'s / sync':>9} {'MB pushed':>10} {'gap max':>9}")
    for name, sampler in samplers.items():
        sequence, log_probs = sampler.sample(prompt, torch.ones_like(prompt), 0, 0.0, 1.0, 0, 16, [])  # [1, 32 + T]
        ids = sequence[0, prompt.size(1) :]  # the response [T]
        with torch.no_grad():
            logits = model(sequence).logits[0, prompt.size(1) - 1 : -1]  # [T, V]
        mine = logits.log_softmax(-1).gather(1, ids.unsqueeze(1)).squeeze(1)
        gap = (mine - log_probs[0]).abs().max().item()
        pushed = adapter_bytes if name == "adapters" else merged_bytes
        print(f"{name:9} {statistics.median(times[name]):>9.3f} {pushed / 1e6:>10.1f} {gap:>9.1e}")


if __name__ == "__main__":
    main()
