"""Model FLOPs from the shapes, the device's peak, and from them a step's perf/throughput and perf/mfu (verl's names).

Counted per token of a pass, as nanoGPT's and verl's estimates do (docs/outputs.md#throughput-and-mfu):
    2 x the decoder's parameters (every real token, prompt included)
    + 2 x vocabulary x hidden (the output layer, where a token is drawn or scored)
    + 4 x layers x attention width x the tokens it attends to (QK^T and the weighted sum; causal: itself and those
      before it)
for a forward-only pass (sampling, pi_old's and pi_ref's log-probs), and 3 x that for a trained one (forward and
backward: the 6N of a trained token). Padding, recomputation (gradient checkpointing) and evaluation are not
counted: MFU is the share of the device's peak that went into the model's own arithmetic.
"""

import functools
import time
from dataclasses import dataclass

import torch

# Dense (no sparsity) peak TFLOPS per GPU from NVIDIA's datasheets: (bf16, tf32, fp32) tensor-core rates
PEAK_TFLOPS = {
    "B200": (2250.0, 1100.0, 75.0),
    "GH200": (989.4, 494.7, 66.9),
    "H200": (989.4, 494.7, 66.9),
    "H100 NVL": (835.5, 417.5, 60.0),
    "H100 PCIe": (756.5, 378.0, 51.2),
    "H100": (989.4, 494.7, 66.9),  # SXM
    "H800": (989.4, 494.7, 66.9),
    "A100": (312.0, 156.0, 19.5),
    "A800": (312.0, 156.0, 19.5),
    "L40S": (362.1, 183.0, 91.6),
    "L40": (181.0, 90.5, 90.5),
    "L4": (121.0, 60.0, 30.3),
    "A40": (149.7, 74.8, 37.4),
    "A30": (165.0, 82.0, 10.3),
    "A10": (125.0, 62.5, 31.2),
    "RTX A6000": (154.8, 77.4, 38.7),
}


@dataclass(frozen=True)
class FlopShape:
    """What a token costs, from a model's shapes (model_shape)."""

    decoder: int  # parameters every token passes through: all but the input embeddings and the output layer
    head: int  # the output layer's, vocabulary x hidden: applied where a token is drawn or scored
    attention: int  # 4 x layers x attention width: forward FLOPs per (token, earlier token) pair


def model_shape(model):
    """The FlopShape of a causal LM (a LoRA-wrapped one too: its adapters count with the decoder)."""
    config, embedding = model.config, model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied output layer is counted once
    decoder = total - embedding.numel() - (0 if head is embedding else head.numel())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return FlopShape(decoder, head.numel(), 4 * config.num_hidden_layers * config.num_attention_heads * head_dim)


def pass_flops(shape, attention_mask, num_actions, passes=1):
    """FLOPs of scoring these rows' responses, passes times (3 = one trained pass: forward and backward). Every real
    token goes through the decoder and attends to the real tokens up to it; the output layer runs at the response
    positions. attention_mask: [N, P+T] (a prompt's real tokens, then its response's), num_actions: T. A 0-dim
    float64 tensor on the mask's device: read with the step's other numbers, no device read of its own."""
    lengths = attention_mask.sum(dim=1, dtype=torch.float64)  # [N]
    responses = attention_mask[:, attention_mask.size(1) - num_actions :].sum(dtype=torch.float64)
    pairs = (lengths * (lengths + 1) / 2).sum()  # causal: token k attends to k tokens
    return passes * (2 * shape.decoder * lengths.sum() + 2 * shape.head * responses + shape.attention * pairs)


def log_prob_flops(shape, micro_batches):
    """FLOPs of the forward passes that took pi_old's and pi_ref's log-probs of a rollout's micro-batches (train.py's
    MicroBatch: a pass where old_action_log_probs, ref_action_log_probs are set), as a float: one read a rollout."""
    passes = [(m.old_action_log_probs is not None) + (m.ref_action_log_probs is not None) for m in micro_batches]
    return float(
        sum(pass_flops(shape, m.attention_mask, m.action_mask.size(1), n) for m, n in zip(micro_batches, passes))
    )


def sampling_flops(shape, groups):
    """FLOPs of drawing groups (train.py's Samples), as a float: one read a sampling round. Each group's prompt
    pass once (kernels.generate_sharing_prompts), then each drawn token through the decoder and the output layer,
    attending to the prompt and the tokens before it (the KV cache)."""
    total = 0.0
    for group in groups:
        mask, num_actions = group.attention_mask, group.num_actions  # [G, P+T] of the group, one prompt
        prompt = mask[0, : mask.size(1) - num_actions].sum(dtype=torch.float64)
        drawn = mask[:, mask.size(1) - num_actions :].sum(dim=1, dtype=torch.float64)  # [G]
        pairs = prompt * (prompt + 1) / 2 + (drawn * prompt + drawn * (drawn + 1) / 2).sum()
        tokens = drawn.sum()
        total = total + 2 * shape.decoder * (prompt + tokens) + 2 * shape.head * tokens + shape.attention * pairs
    return float(total)


def peak_flops(device, bf16=True, tf32=True):
    """The device's peak FLOP/s for the precision the run computes in: a GPU's dense bf16 (bf16 autocast), TF32 or
    float32 rate from PEAK_TFLOPS by its name; a CPU, or a GPU not in the table, measured once (matmul_probe)."""
    if not device.startswith("cuda"):
        return matmul_probe("cpu", torch.float32, torch.get_num_threads())
    name = torch.cuda.get_device_name(device)
    column = 0 if bf16 else 1 if tf32 else 2
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100", "L40S" before "L4"
        if key in name:
            return PEAK_TFLOPS[key][column] * 1e12
    return matmul_probe(device, torch.bfloat16 if bf16 else torch.float32, 0)


@functools.lru_cache(maxsize=None)
def matmul_probe(device, dtype, threads, size=None, repeats=20):
    """The fastest of `repeats` square matmuls on this device, in FLOP/s: a peak this code can reach (threads: the
    CPU threads it runs on, part of the cache key). Measured once per process, in about 0.1 s on a CPU: many short
    products, so that on a shared machine some run undisturbed (512 x 512 on one Xeon thread: 153 GFLOP/s three
    times in a row; 5 products of 1024 x 1024 read 72 to 76, half of it)."""
    size = size or (512 if device == "cpu" else 8192)
    a = b = torch.full((size, size), 0.5, device=device, dtype=dtype)  # no draw from torch's RNG: a run's samples stay
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        if device != "cpu":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device != "cpu":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def perf_metrics(record, peak, processes=1):
    """perf/throughput: response tokens sampled and trained per second of the step, per process; perf/mfu: the step's
    model FLOPs (all processes) / (its seconds x processes x the peak). record: the step's, with time/step."""
    seconds = record["time/step"] * processes
    tokens = record.get("sampled_tokens", 0) + record.get("num_tokens", 0)
    return {"perf/throughput": tokens / seconds, "perf/mfu": record.get("perf/flops", 0) / (seconds * peak)}
