"""Model FLOPs from the shapes, the device's peak, and from them a step's perf/throughput and perf/mfu (verl's names).

Counted per token of a pass, as nanoGPT's and verl's estimates do (docs/outputs.md#throughput-and-mfu):
    2 x the decoder's parameters (every real token, prompt included)
    + 2 x vocabulary x hidden (the output layer, where a token is drawn or scored)
    + 4 x layers x attention width x the tokens it attends to (QK^T and the weighted sum; causal: itself and those
      before it)
for a forward-only pass (sampling, pi_old's and pi_ref's log-probs), and 3 x that for a trained one (forward and
backward: the 6N of a trained token). Padding, recomputation (gradient checkpointing) and evaluation are not
counted: MFU is the share of the device's peak that went into the model's own arithmetic.

The roofline of sampling (perf/sampling_bound, sampling_bound): the least time a round can take on this device,
each part at the larger of the bytes it must read / the read bandwidth and its FLOPs / the peak (Roof: both
measured once per process on a CPU). A decode step reads every weight once for all the rows of its call, so small
batches sit on the bandwidth side: the output layer's V x H is most of what a small model's step reads.
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
    cached: int  # 2 x layers x key/value heads x head width: KV-cache elements per token (a decode step reads them)


def model_shape(model):
    """The FlopShape of a causal LM (a LoRA-wrapped one too: its adapters count with the decoder)."""
    config, embedding = model.config, model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())  # a tied output layer is counted once
    decoder = total - embedding.numel() - (0 if head is embedding else head.numel())
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads  # grouped-query attention caches fewer
    return FlopShape(decoder, head.numel(), 4 * layers * heads * head_dim, 2 * layers * kv_heads * head_dim)


def pass_bytes(shape, itemsize, cached_tokens=0):
    """Bytes a forward pass reads at the least: the weights it multiplies by, decoder and output layer (a tied output
    layer once: it is the embeddings; an embedding lookup reads a few rows, not counted), and the keys and values of
    cached_tokens earlier tokens (a decode step's KV cache, all its rows together; a tensor works elementwise).
    itemsize: bytes per element as the pass reads them (Roof.itemsize)."""
    return itemsize * (shape.decoder + shape.head + shape.cached * cached_tokens)


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
    pass once (decoding.prefill), then each drawn token through the decoder and the output layer,
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


def sampling_bound(shape, groups, rows, roof):
    """The roofline of drawing groups (train.py's Samples): the least seconds their sampling calls can take on this
    device, (prefill, decode) as floats. A call draws consecutive groups, rows // G of them (rows: at most this many
    responses per call, max_generation_rows; None: all in one call, vLLM's); per call, P a row's prompt tokens,
        prefill = max(itemsize x decoder / bandwidth,
                      sum over its prompts of (2 x decoder x P + attention x P (P + 1) / 2) / peak)
        decode  = sum over steps s = 1 .. its longest response of
                  max(pass_bytes(the P + s - 1 cached tokens of each row still drawing) / bandwidth,
                      sum over those rows of (2 x (decoder + head) + attention x (P + s)) / peak)
    The prefill is one pass over the call's distinct prompts (the G copies of a prompt share it, as
    decoding.prefill does), so the decoder's weights are read once; the output layer waits for the
    first drawn token. The rows of a call step together: a decode step reads the weights once for all its rows, up
    to its longest response. The FLOPs of both parts add up to sampling_flops'."""
    if not groups:
        return 0.0, 0.0
    G = groups[0].attention_mask.size(0)
    per_call = len(groups) if rows is None else max(1, rows // G)  # as generate_samples splits them
    parts = []
    for first in range(0, len(groups), per_call):
        call = groups[first : first + per_call]
        widths = [(g.attention_mask.size(1) - g.num_actions, g.num_actions) for g in call]  # prompt P, response T
        prompts = torch.stack([g.attention_mask[0, :p].sum() for g, (p, _) in zip(call, widths)]).double()  # [C]
        drawn = torch.cat([g.attention_mask[:, p:].sum(dim=1) for g, (p, _) in zip(call, widths)]).double()  # [R]
        steps = torch.arange(1, max(t for _, t in widths) + 1, dtype=torch.float64, device=drawn.device)  # [S]
        active = (drawn >= steps.unsqueeze(1)).double()  # [S, R]: rows still drawing at step s
        context = prompts.repeat_interleave(G) + steps.unsqueeze(1)  # [S, R]: tokens the step's token attends to
        flops = (active * (2 * (shape.decoder + shape.head) + shape.attention * context)).sum(dim=1)  # [S]
        nbytes = active.amax(dim=1) * pass_bytes(shape, roof.itemsize, (active * (context - 1)).sum(dim=1))  # [S]
        prompt_flops = (2 * shape.decoder * prompts + shape.attention * prompts * (prompts + 1) / 2).sum()
        prefill = torch.clamp(prompt_flops / roof.peak, min=roof.itemsize * shape.decoder / roof.bandwidth)
        parts.append(torch.stack([prefill, torch.maximum(nbytes / roof.bandwidth, flops / roof.peak).sum()]))
    return tuple(torch.stack(parts).sum(dim=0).tolist())  # one read a round


def sampling_metrics(shape, groups, rows, roof):
    """A sampling round's perf/flops (sampling_flops) and perf/sampling_bound (sampling_bound, prefill and decode
    together, in seconds), as step-log values."""
    return {
        "perf/flops": [sampling_flops(shape, groups)],
        "perf/sampling_bound": [sum(sampling_bound(shape, groups, rows, roof))],
    }


@dataclass(frozen=True)
class Roof:
    """The device as the roofline sees it (device_roof)."""

    peak: float  # FLOP/s in the precision the run computes in (peak_flops)
    bandwidth: float  # bytes/s it reads (read_bandwidth)
    itemsize: int  # bytes of a weight or a cached key/value as passes read them: 2 under bf16 autocast, else 4


def device_roof(device, bf16=True, tf32=True):
    """The Roof of a run on this device with these settings: the peak (a GPU's from its datasheet, else measured) and
    the read bandwidth (measured), once per process. Weights are float32 (train.py's policy); bf16 autocast
    (kernels.bf16_autocast: on CUDA) casts them once per call, and its passes read the bf16 copies and cache bf16
    keys and values."""
    autocast = bf16 and device.startswith("cuda")
    return Roof(peak_flops(device, bf16, tf32), read_bandwidth(device), 2 if autocast else 4)


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


def read_bandwidth(device):
    """The device's read bandwidth in bytes/s, measured once per process (and CPU thread count: bandwidth_probe)."""
    return bandwidth_probe(device, torch.get_num_threads() if device == "cpu" else 0)


@functools.lru_cache(maxsize=None)
def bandwidth_probe(device, threads, size=None):
    """The fastest sum of a float32 block, in bytes read per second: a read rate this code can reach, measured once
    per process (threads: part of the cache key, as matmul_probe's). On a CPU, in about 0.2 s: 512 MiB (more than
    this Xeon's 480 MiB L3) written, then read once in the order written, 32 MiB at a time, so that each block has
    left the caches when it is read and, on a shared machine, some reads run undisturbed (2 Xeon threads: about
    25 GB/s, as one sum over 1 GiB; five sums over 256 MiB read 12.5 while another process ran). On a GPU, the
    fastest of 3 sums over 1 GiB after one that warms up."""
    cpu = device == "cpu"
    size, chunks = size or (2**27 if cpu else 2**28), 16 if cpu else 1  # float32 elements
    blocks = torch.full((chunks, size // chunks), 0.5, device=device)  # no draw from torch's RNG: a run's samples stay
    best = float("inf")
    for block in list(blocks) if cpu else [blocks[0]] * 4:
        if not cpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        block.sum()
        if not cpu:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    del blocks, block
    if not cpu:  # hand the memory back: vLLM sizes its KV cache from what is left
        torch.cuda.empty_cache()
    return 4 * (size // chunks) / best


def perf_metrics(record, peak, processes=1):
    """perf/throughput: response tokens sampled and trained per second of the step, per process; perf/mfu: the step's
    model FLOPs (all processes) / (its seconds x processes x the peak); perf/sampling_roofline: time/sampling /
    perf/sampling_bound, how many times its roofline the step's sampling took (None without sampling). record: the
    step's, with time/step."""
    seconds = record["time/step"] * processes
    tokens = record.get("sampled_tokens", 0) + record.get("num_tokens", 0)
    sampling, bound = record.get("time/sampling"), record.get("perf/sampling_bound")
    return {
        "perf/throughput": tokens / seconds,
        "perf/mfu": record.get("perf/flops", 0) / (seconds * peak),
        "perf/sampling_roofline": sampling / bound if sampling and bound else None,
    }
