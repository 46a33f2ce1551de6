"""The measured speed-ups train.py relies on (benchmarks/bench.py and benchmarks/log_probs.py,
docs/performance.md): each computes exactly what the plain version computes, with less time and memory.

    output_layer_scores / log_probs_from_hidden   log-probs of the labels and the entropy from the last hidden
                                             states, 512 positions at a time, with a backward that recomputes
                                             each block's logits: no [N, T, V] logits or gradient (a flat
                                             ~0.3 GiB where the seed's grow with T x V; benchmarks/log_probs.py)
    reuse_freed_memory                       on CPU, freed tensors' memory stays in the process for the next
                                             ones instead of going back to the kernel and faulting in again
"""

import contextlib
import ctypes

import torch


def bf16_autocast(args):
    """bf16 autocast for forward passes on CUDA (args.bf16: the weights stay float32); a no-op context elsewhere."""
    if args.bf16 and args.device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# Positions per block (verl's chunk size): a block's logits are [512, V] (297 MiB in float32 with Qwen's 151,936
# ids) whatever the response length or a packed row's length; a micro-batch of the seed's lengths (4 x 128
# response tokens) is one block. The float32 passes over a block go 32 rows at a time, through a [32, V] buffer
# (19 MiB) that stays in cache, not through [512, V] temporaries (a CPU micro-step 1.09x faster).
POSITIONS_PER_BLOCK, ROWS_PER_PASS = 512, 32


def block_logits(hidden, weight, temperature):
    """Logits of a block of positions as the output layer makes them (hidden [C, H] @ weight [V, H]^T, in the
    weight's dtype: bf16 under autocast), then in float32, divided by the temperature there: [C, V]. Float32, as
    generate's TemperatureLogitsWarper and vLLM's sampler divide them: bf16 logits / 0.7 round to bf16 again, and
    the log-probs moved by 0.03 nats on average (more than the sampler/learner gap the stale-weight guard reads)."""
    logits = (hidden.to(weight.dtype) @ weight.T).float()
    return logits if temperature == 1.0 else logits.div_(temperature)  # in place: one [C, V] float32 at a time


def pieces(*tensors):
    """The tensors' first ROWS_PER_PASS rows together, then the next ones, ..."""
    return zip(*(tensor.split(ROWS_PER_PASS) for tensor in tensors))


def softmax_stats(x, labels, buffer):
    """x [c, V] float32 logits, labels [c] -> (log p[label], entropy H = lse - E_p[x], logsumexp), each [c]; one
    exp(x - max) in buffer [>= c, V] gives all three."""
    peak = x.amax(dim=-1, keepdim=True)  # [c, 1]
    shifted = torch.sub(x, peak, out=buffer[: len(x)]).exp_()  # [c, V]
    total = shifted.sum(dim=-1)  # [c]
    lse = peak.squeeze(-1) + total.log()
    return x.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse, lse - shifted.mul_(x).sum(dim=-1) / total, lse


def log_softmax_grad_(x, lse, labels, g):
    """x [C, V] float32 logits, overwritten with g * (onehot(labels) - softmax(x)): d (g * log p[label]) / dx;
    ROWS_PER_PASS rows at a time. Returns x."""
    for x_, lse_, labels_, g_ in pieces(x, lse, labels, g.unsqueeze(-1)):  # g_ [c, 1]
        x_.sub_(lse_.unsqueeze(-1)).exp_().mul_(-g_).scatter_add_(-1, labels_.unsqueeze(-1), g_)
    return x


def taken_grad(weight):
    """weight.grad, taken off the weight, when backward can add W's gradient to it in place and return it; else None.

    Autograd adds a returned gradient to an existing .grad, so the returned sum would be a second [V, H] float32
    beside .grad (0.87 GiB at Qwen2.5-1.5B's shape, the stage's largest tensor once the logits are blocks) in every
    micro-step after a step's first. Returned with .grad cleared, it becomes .grad again (a tied embedding's
    gradient added first): the same sum, without the second tensor. Only where autograd would do no more than that
    add: a leaf whose AccumulateGrad this backward runs (not torch.autograd.grad, not backward(inputs=) without
    it), a dense float32 .grad, no tensor hooks (they would see the sum so far, not this pass's gradient)."""
    grad = weight.grad
    if grad is None or grad.dtype != torch.float32 or not grad.is_contiguous() or weight._backward_hooks:
        return None
    try:
        accumulates = torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(weight).node)
    except RuntimeError:  # torch.autograd.grad: it returns the gradient, .grad is not its to change
        return None
    if not accumulates:
        return None
    weight.grad = None
    return grad


class LogProbsFromHidden(torch.autograd.Function):
    """log softmax(h W^T / tau)[label] with its gradient, and the entropy without one, a block of positions at a time.

    Forward: per block of POSITIONS_PER_BLOCK positions, the logits [C, V] give the label's log-prob, the entropy
    and the logsumexp (softmax_stats); the logsumexp [K] and the last block's logits are kept. Backward, last
    block first: each block's logits are computed again (but the kept ones), overwritten with their gradient
    (log_softmax_grad_), whose products with W and h add to the gradients of the hidden states and of W (float32,
    in W's .grad itself where autograd would only add to it: taken_grad). One block of logits at a time and no
    [K, V] tensor in either pass; the cost is the output layer's matmul once more in backward for every block but
    the last (none at the seed's lengths).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, dtype):  # hidden [K, H], weight [V, H], labels [K]
        w = weight.to(dtype)  # one cast for all blocks (autocast casts once per forward pass too)
        log_probs = torch.empty(labels.shape, dtype=torch.float32, device=hidden.device)  # [K]
        entropy, lse = torch.empty_like(log_probs), torch.empty_like(log_probs)  # [K]
        buffer = torch.empty(ROWS_PER_PASS, w.size(0), device=hidden.device)  # [32, V], reused
        x = None
        for s in range(0, labels.numel(), POSITIONS_PER_BLOCK):
            at = slice(s, s + POSITIONS_PER_BLOCK)
            x = None  # the previous block goes before this one is made
            x = block_logits(hidden[at], w, temperature)  # [C, V]
            stats = [softmax_stats(*rows, buffer) for rows in pieces(x, labels[at])]
            log_probs[at], entropy[at], lse[at] = (torch.cat(values) for values in zip(*stats))  # [C] each
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.dtype, ctx.kept = temperature, dtype, x  # x: the last block's logits [C, V]
        ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, lse = ctx.saved_tensors
        w, tau = weight.to(ctx.dtype), ctx.temperature
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None  # [K, H]
        grad_weight = taken_grad(weight) if ctx.needs_input_grad[1] else None  # [V, H], summed in float32
        for s in reversed(range(0, labels.numel(), POSITIONS_PER_BLOCK)):
            at = slice(s, s + POSITIONS_PER_BLOCK)
            x = block_logits(hidden[at], w, tau) if ctx.kept is None else ctx.kept  # [C, V], as in forward
            ctx.kept = None
            grad_z = log_softmax_grad_(x, lse[at], labels[at], grad_log_probs[at])  # [C, V] float32
            if tau != 1.0:
                grad_z.div_(tau)  # through logits / temperature, in float32 as forward; in place: x is not read again
            grad_z = grad_z.to(ctx.dtype)
            if grad_hidden is not None:
                grad_hidden[at] = grad_z @ w
            if ctx.needs_input_grad[1]:  # W's gradient: one [V, H] float32 sum, no product per block beside it
                h = hidden[at].to(ctx.dtype)
                if grad_weight is None:
                    grad_weight = (grad_z.T @ h).float()
                elif grad_z.dtype == torch.float32:
                    grad_weight.addmm_(grad_z.T, h)  # no [V, H] temporary
                else:
                    grad_weight += grad_z.T @ h  # a [V, H] temporary in the logits' dtype (bf16), freed at once
            del x, grad_z  # this block's logits go before the next block's are made
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def log_probs_from_hidden(hidden, weight, labels, temperature=1.0):
    """hidden [N, T, H] (the last layer's, normed), weight [V, H] (the output layer's), labels [N, T] ->
    (log_probs [N, T], entropy [N, T]) of softmax(hidden @ weight^T / temperature), both float32; only the
    log-probs carry a gradient (to hidden and weight). The matmuls run in the autocast dtype when autocast is on
    (as the output layer would), else in the weight's. Extra memory: one [POSITIONS_PER_BLOCK, V] block of logits
    at a time whatever N and T, and W's gradient where it has no .grad yet."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    log_probs, entropy = LogProbsFromHidden.apply(hidden.flatten(0, -2), weight, labels.flatten(), temperature, dtype)
    return log_probs.view_as(labels), entropy.view_as(labels)


@contextlib.contextmanager
def output_layer_scores(model, labels, temperature=1.0):
    """Inside the block, model(...).logits is (log-probs, entropy) of labels [N, T], stacked [N, T, 2], not the
    [N, T, V] logits: the output layer (model.get_output_embeddings(), tied or not, under PEFT too) runs
    log_probs_from_hidden on its input. It runs inside the model's own forward, so that FSDP2 (which gathers the
    root module's parameters, the output layer's among them, around that forward and again before its backward)
    hands it the whole weight, and its gradient reaches the weight FSDP reduce-scatters."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise ValueError(f"log-probs from hidden states need a bias-free nn.Linear output layer, not {head!r}")
    head.forward = lambda hidden: torch.stack(log_probs_from_hidden(hidden, head.weight, labels, temperature), -1)
    try:
        yield
    finally:
        del head.forward  # the class's forward again


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
