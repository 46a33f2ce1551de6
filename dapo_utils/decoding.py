"""The default sampler (train.py's sample() without vLLM): responses drawn from Hugging Face generate's distribution
(temperature, then top-k keeping ties at the k-th value, then top-p; greedy at temperature 0), decoded near what the
machine allows.

    decode                  on CPU: the prompt pass once per distinct prompt (the G copies of a prompt share its
                            KV cache), then a plain loop over HF's KV cache with no per-token pass over the
                            vocabulary but the output layer's product and one top-k (generate makes about ten:
                            its warpers, its softmax, its stopping checks); the output layer's product with MKL's
                            packed weight where torch has MKL, which reads it near the memory's bandwidth where
                            F.linear reaches about half (docs/performance.md)
    generate_with_graphs    on CUDA: HF generate over a static KV cache, whose decode step generate compiles with
                            torch.compile(mode="reduce-overhead"): the step replays as CUDA graphs, without the per-op
                            launch overhead that dominates a small batch's decode on a GPU (generate alone, static
                            cache or not: the seed's sampler)
    draw_tokens             one token per row from the warped distribution, among the ids top-k keeps

Each gives the same distribution as generate(do_sample=True) with the same settings (tests/test_decoding.py), with
other random draws. The model's own generation_config (a repetition penalty, greedy defaults, ...) is never read:
sampling is the trainer's settings and nothing else.
"""

import contextlib
import math
from typing import NamedTuple

import torch
from transformers import DynamicCache, GenerationConfig


class Sampling(NamedTuple):
    """What a sampling call draws: generate's settings of the same names (temperature 0 = greedy)."""

    max_new_tokens: int
    eos_token_ids: list  # every id that ends a response
    pad_token_id: int  # what a row holds after its EOS
    temperature: float
    top_k: int  # 0 = off
    top_p: float  # 1.0 = off


def warped_scores(scores, temperature, top_k, top_p):
    """generate's warpers on float32 scores [N, V] (overwritten): divided by the temperature, then top-k (every id
    at least as large as the k-th largest: ties kept, as TopKLogitsWarper keeps them), then top-p (TopPLogitsWarper's
    rule). Returns (kept scores [N, K], their ids [N, K]) with -inf where a row keeps fewer than K; ids None when
    every id is kept (K = V, in vocabulary order)."""
    if temperature != 1.0:
        scores.div_(temperature)  # float32, as generate's TemperatureLogitsWarper divides
    vocabulary = scores.size(-1)
    values, ids = scores, None
    if 0 < top_k < vocabulary:
        values, ids = scores.topk(min(top_k + 1, vocabulary))  # [N, k+1], descending: k+1 tells a tie at the k-th
        kth = values[:, top_k - 1 : top_k]  # [N, 1]
        tied = values[:, top_k:] == kth  # [N, 1]: the (k+1)-th equals the k-th, so TopK keeps more than k
        if bool((tied & kth.isfinite()).any()):  # rare (a float32 tie); then every id >= the k-th, per row
            values, ids = scores.topk(int((scores >= kth).sum(-1).max()))
            values = values.masked_fill(values < kth, -math.inf)
        else:
            values, ids = values[:, :top_k], ids[:, :top_k]
    if top_p < 1.0:
        if ids is None:
            values, ids = scores.sort(dim=-1, descending=True)
        ascending = values.flip(-1)  # TopPLogitsWarper's order: drop the ids whose cumulative mass is <= 1 - top_p
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False  # min_tokens_to_keep=1: the most likely id stays
        values = ascending.masked_fill(drop, -math.inf).flip(-1)
    return values, ids


def draw_tokens(scores, temperature, top_k, top_p):
    """One token per row of float32 scores [N, V] (overwritten): softmax of the warped scores (warped_scores), drawn
    among the ~k ids top-k keeps, not all V (a full-vocabulary torch.multinomial is a third of a CPU decode step);
    argmax at temperature 0. Returns [N] long."""
    if temperature == 0:
        return scores.argmax(-1)
    values, ids = warped_scores(scores, temperature, top_k, top_p)
    drawn = torch.multinomial(values.softmax(-1), 1)  # [N, 1]
    return (drawn if ids is None else ids.gather(-1, drawn)).squeeze(-1)


def packed_weight_head(head, rows):
    """A replacement for the output layer's forward on [rows, 1, H] hidden states during decode: MKL's product with
    the weight packed once per call (torch.ops.mkl, prepacked for `rows` rows) where torch has MKL, else W @ h^T,
    which MKL and OpenBLAS run faster than F.linear's h @ W^T at a few rows. Float32, as the layer computes it; it
    differs from F.linear's logits by rounding only (the order of the sum)."""
    weight = head.weight  # [V, H]
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)  # one pass over W, per sampling call
        return lambda hidden: torch.ops.mkl._mkl_linear(hidden[:, -1], packed, weight, None, rows).unsqueeze(1)
    return lambda hidden: (weight @ hidden[:, -1].T).T.unsqueeze(1)


@contextlib.contextmanager
def fast_output_layer(model, rows):
    """Inside the block, the output layer of model (tied or not, under PEFT too) computes decode logits with
    packed_weight_head; a bias-free nn.Linear only (anything else keeps its own forward)."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.device.type != "cpu":
        yield
        return
    head.forward = packed_weight_head(head, rows)
    try:
        yield
    finally:
        del head.forward  # the class's forward again


def distinct_prompts(input_ids, attention_mask):
    """Each run of identical rows (a prompt and its G - 1 copies) once: ids, mask [U, P] and each row's run [N]."""
    rows = torch.cat([input_ids, attention_mask], dim=1)  # [N, 2P]: equal ids with other masks stay apart
    distinct, row_of = torch.unique_consecutive(rows, dim=0, return_inverse=True)  # [U, 2P], [N]
    return *distinct.split(input_ids.size(1), dim=1), row_of


def prefill(model, input_ids, attention_mask):
    """The prompt pass, once per distinct prompt (distinct_prompts), whose KV cache is then selected for every row.
    Returns (the last prompt token's float32 logits [N, V], the cache for N rows). input_ids, attention_mask: [N, P],
    left-padded."""
    ids, mask, row_of = distinct_prompts(input_ids, attention_mask)  # [U, P], [U, P], [N]
    position_ids = (mask.cumsum(dim=-1) - 1).clamp(min=0)  # as generate numbers them (pads: masked anyway)
    cache = DynamicCache(config=model.config)
    out = model(ids, attention_mask=mask, position_ids=position_ids, past_key_values=cache, logits_to_keep=1)
    if len(ids) < len(row_of):
        cache.batch_select_indices(row_of)  # [U, ...] -> [N, ...]
    return out.logits[row_of, -1].float(), cache  # [N, V]


@torch.no_grad()
def decode(model, input_ids, attention_mask, settings, logits_processor=None):
    """Draw up to settings.max_new_tokens tokens after each left-padded prompt: input_ids, attention_mask [N, P] ->
    ids [N, P + T'], T' <= max_new_tokens, as generate returns them (pad_token_id after a row's EOS; T' is the
    longest row). logits_processor(ids so far [N, P + t], scores [N, V]) -> scores, if given, runs on each step's
    float32 logits before the warpers (benchmarks force EOS with one)."""
    N, P = input_ids.shape
    T, eos = settings.max_new_tokens, torch.tensor(settings.eos_token_ids, dtype=torch.long, device=input_ids.device)
    sequences = torch.cat([input_ids, input_ids.new_full((N, T), settings.pad_token_id)], dim=1)  # [N, P+T]
    mask = torch.cat([attention_mask, attention_mask.new_ones((N, T))], dim=1)  # [N, P+T]: a row's next tokens
    positions = attention_mask.sum(dim=1, keepdim=True)  # [N, 1]: the first response token's position
    finished = torch.zeros(N, dtype=torch.bool, device=input_ids.device)
    logits, cache = prefill(model, input_ids, attention_mask)  # [N, V]
    with fast_output_layer(model, N):
        for t in range(T):
            if logits_processor is not None:
                logits = logits_processor(sequences[:, : P + t], logits)
            token = draw_tokens(logits, settings.temperature, settings.top_k, settings.top_p)  # [N]
            token = token.masked_fill(finished, settings.pad_token_id)  # a finished row pads, as generate's do
            sequences[:, P + t] = token
            finished |= torch.isin(token, eos)
            if t + 1 == T or bool(finished.all()):
                return sequences[:, : P + t + 1]
            out = model(token[:, None], attention_mask=mask[:, : P + t + 1], position_ids=positions + t,
                        past_key_values=cache)  # fmt: skip
            logits = out.logits[:, -1].float()  # [N, V] (bf16 under CUDA autocast)
    return sequences[:, :P]  # max_new_tokens 0


@torch.no_grad()
def generate(model, input_ids, attention_mask, settings, logits_processor=None, static_cache=False):
    """decode's result through HF generate, as the seed samples (its warpers and a multinomial over every id).
    static_cache: over a static KV cache (cache_implementation="static"), whose decode step generate compiles on
    CUDA with torch.compile(mode="reduce-overhead"), replayed as CUDA graphs without the per-op launch overhead that
    dominates a small batch's decode on a GPU; elsewhere it runs eagerly (how the tests check it on CPU). The
    model's generation_config is swapped out for the call, so that none of its fields reaches generate."""
    sample = settings.temperature > 0
    warpers = dict(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p) if sample else {}
    config = GenerationConfig(
        do_sample=sample, max_new_tokens=settings.max_new_tokens, eos_token_id=list(settings.eos_token_ids),
        pad_token_id=settings.pad_token_id, cache_implementation="static" if static_cache else None, **warpers,
    )  # fmt: skip
    processors = [] if logits_processor is None else [logits_processor]
    saved, model.generation_config = model.generation_config, config
    try:
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, generation_config=config, logits_processor=processors
        )
    finally:
        model.generation_config = saved


def generate_with_graphs(model, input_ids, attention_mask, settings, logits_processor=None, multiple=64):
    """generate over a static KV cache (CUDA's default sampler), the prompts left-padded to a multiple of `multiple`
    columns: the cache's length, and so the shapes torch.compile specialises and CUDA graphs are recorded for, takes
    a few values instead of one per prompt width (HF's advice for a static cache). The extra columns are masked
    pads, dropped from the result: the same ids as generate on the prompts as given."""
    extra = -input_ids.size(1) % multiple
    ids = torch.nn.functional.pad(input_ids, (extra, 0), value=settings.pad_token_id)  # [N, P + extra]
    mask = torch.nn.functional.pad(attention_mask, (extra, 0), value=0)
    out = generate(model, ids, mask, settings, logits_processor, static_cache=True)
    return out[:, extra:]  # [N, P + T']


def sampler(device, cuda_graphs, fsdp):
    """The default sampler for a run: generate_with_graphs on CUDA (cuda_graphs; not fsdp, whose gathered model is
    not compiled), decode elsewhere."""
    return generate_with_graphs if cuda_graphs and device.startswith("cuda") and not fsdp else decode
