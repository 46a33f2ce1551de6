"""The measured speed-ups train.py relies on (benchmarks/bench.py and benchmarks/log_probs.py,
docs/performance.md): each computes exactly what the plain version computes, with less time and memory.

    sampling_processors / SampleKeptTokens   draw each token among the ids top-k / top-p keep (19% less
                                             sampling time than generate's multinomial over 151,936 ids)
    generate_sharing_prompts                 the G copies of a prompt share one forward pass over it
    selective_log_softmax                    log-probs of the labels and the entropy, 32 positions at a time,
                                             with a hand-written backward (1.18x faster, 2/3 of the peak memory
                                             of a float32 log_softmax in get_action_log_probs)
    reuse_freed_memory                       on CPU, freed tensors' memory stays in the process for the next
                                             ones instead of going back to the kernel and faulting in again
"""

import ctypes
import math

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
from transformers import TopPLogitsWarper


class SampleKeptTokens(LogitsProcessor):
    """Draw the next token from softmax(scores), looking only at the tokens the warpers kept.

    generate's torch.multinomial walks all 151,936 ids of Qwen's vocabulary (a third of a CPU decode step);
    over the ~50 that top-k keeps it costs nothing. Same distribution (ties at the top-k boundary included),
    other random draws. Returns 0 at the drawn token and -inf elsewhere, for generate's greedy argmax.
    """

    def __call__(self, input_ids, scores):  # scores: [N, V], -inf where a warper removed a token
        num_kept = int(torch.isfinite(scores).sum(dim=-1).max())
        if num_kept == scores.size(-1):  # nothing removed (top_k 0, top_p 1)
            drawn = torch.multinomial(scores.softmax(dim=-1), 1)  # [N, 1]
        else:
            kept_scores, kept_ids = scores.topk(num_kept, dim=-1)  # [N, K]
            drawn = kept_ids.gather(-1, torch.multinomial(kept_scores.softmax(dim=-1), 1))  # [N, 1]
        return torch.full_like(scores, -math.inf).scatter_(-1, drawn, 0.0)


def sampling_processors(temperature, top_k, top_p):
    """Hugging Face's own warpers, in generate's order, then SampleKeptTokens (for greedy generate)."""
    processors = LogitsProcessorList()
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    processors.append(SampleKeptTokens())
    return processors


@torch.no_grad()
def generate_sharing_prompts(model, input_ids, attention_mask, **generate_kwargs):
    """model.generate(input_ids=..., attention_mask=..., **generate_kwargs), where each run of identical rows
    (a prompt and its G - 1 copies) shares one prompt pass: the KV cache of the distinct prompts' tokens but
    the last is computed once, selected for every row, and generate goes on from the last prompt token. The
    same logits as G separate prompt passes. input_ids, attention_mask: [N, P] -> [N, P+T]."""
    rows = torch.cat([input_ids, attention_mask], dim=1)  # [N, 2P]: equal ids with other masks stay apart
    distinct, row_of = torch.unique_consecutive(rows, dim=0, return_inverse=True)  # [U, 2P], [N]
    if len(distinct) == len(rows) or input_ids.size(1) < 2:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **generate_kwargs)
    ids, mask = distinct.split(input_ids.size(1), dim=1)  # [U, P] each
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # as generate numbers them (pads: 0)
    cache = DynamicCache(config=model.config)
    inputs = dict(attention_mask=mask[:, :-1], position_ids=position_ids[:, :-1], logits_to_keep=1)
    model(ids[:, :-1], past_key_values=cache, use_cache=True, **inputs)
    cache.batch_select_indices(row_of)  # [U, ...] -> [N, ...]
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, **generate_kwargs)


# Positions per block of the log-softmax: its float32 temporaries are [32, V] (19 MiB with Qwen's 151,936 ids)
# whatever the response length or a packed row's length; on CPU 16-128 positions time within 25% (perf docs).
POSITIONS_PER_CHUNK = 32


def position_chunks(N, T):
    """(row, positions) blocks covering an [N, T] grid, POSITIONS_PER_CHUNK positions at a time."""
    return [(i, slice(s, s + POSITIONS_PER_CHUNK)) for i in range(N) for s in range(0, T, POSITIONS_PER_CHUNK)]


class SelectiveLogSoftmax(torch.autograd.Function):
    """Block by block: log softmax(x)[label] with its gradient, and the entropy of softmax(x) without one.

    Per block of [C, V] logits, one exp(x - max) buffer gives the logsumexp and, with one more multiply-add,
    the entropy H = lse - E_p[x]. Backward writes d log p[label] / dx = onehot - softmax(x) straight into
    the gradient. Nothing of size [N, T, V] is kept beyond the logits (log_softmax would keep its output).
    """

    @staticmethod
    def forward(ctx, logits, labels):
        N, T, V = logits.shape
        log_probs = torch.empty(N, T, dtype=torch.float32, device=logits.device)  # [N, T]
        entropy, lse = torch.empty_like(log_probs), torch.empty_like(log_probs)  # [N, T]
        buffer = torch.empty(min(T, POSITIONS_PER_CHUNK), V, dtype=torch.float32, device=logits.device)  # reused
        for i, at in position_chunks(N, T):
            x = logits[i, at].float()  # [C, V]; a copy only when the logits are bf16
            out = buffer[: x.size(0)]
            peak = x.amax(dim=-1, keepdim=True)  # [C, 1]
            total = torch.sub(x, peak, out=out).exp_().sum(dim=-1)  # [C]
            lse[i, at] = peak.squeeze(-1) + total.log()
            entropy[i, at] = lse[i, at] - out.mul_(x).sum(dim=-1) / total
            log_probs[i, at] = x.gather(-1, labels[i, at].unsqueeze(-1)).squeeze(-1) - lse[i, at]
        ctx.save_for_backward(logits, labels, lse)
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, lse = ctx.saved_tensors
        N, T, V = logits.shape
        grad = torch.empty_like(logits)  # [N, T, V]
        as_float32 = logits.dtype == torch.float32
        buffer = None if as_float32 else torch.empty(min(T, POSITIONS_PER_CHUNK), V, device=logits.device)
        for i, at in position_chunks(N, T):
            g = grad_log_probs[i, at].unsqueeze(-1)  # [C, 1]
            out = grad[i, at] if as_float32 else buffer[: g.size(0)]  # [C, V]
            torch.sub(logits[i, at].float(), lse[i, at].unsqueeze(-1), out=out).exp_().mul_(-g)  # -g * softmax(x)
            out.scatter_add_(-1, labels[i, at].unsqueeze(-1), g)  # + g at the label
            if not as_float32:
                grad[i, at].copy_(out)
        return grad, None


def selective_log_softmax(logits, labels):
    """logits [N, T, V] (any float dtype), labels [N, T] -> (log_probs [N, T], entropy [N, T]), both float32;
    only log_probs carries a gradient. Peak extra memory is one block's [POSITIONS_PER_CHUNK, V]."""
    return SelectiveLogSoftmax.apply(logits, labels)


def reuse_freed_memory():
    """glibc: keep freed memory in the process for the next tensors of the same size. Returns False elsewhere.

    A decode step's [N, 151936] float32 logits and their top-k / softmax temporaries are a few MB each: glibc
    serves them with mmap and unmaps them when freed (or trims the heap top), so the next step faults every
    page in again: 360,000-410,000 page faults per 8 x 128-token rollout of the benchmark's model. Raising both
    thresholds to 1 GiB keeps them in the heap: ~30 faults, sampling 1.17x faster (benchmarks/bench.py,
    +freed_memory_to_kernel). Process-wide, like torch.set_num_threads; the cost is RSS that is not handed back
    to the kernel (+0.5 GiB of peak RSS on the benchmark's step).
    """
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    return bool(mallopt(M_MMAP_THRESHOLD, 2**30)) and bool(mallopt(M_TRIM_THRESHOLD, 2**30))
