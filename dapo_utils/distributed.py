"""Data-parallel DAPO across processes: `torchrun --nproc_per_node=N train.py` or `accelerate launch
--num_processes N train.py` (both set WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT). Without WORLD_SIZE
(plain `python train.py`) there is one process, no process group, and every method here is a no-op.

How a step is shared (see setup's World for each piece):
  - prompts: the epoch's seeded order is the same on every rank; rank r samples batches r, r+N, r+2N, ...
    (the last len % N batches are dropped, so that every rank samples as many rounds). Whole groups stay
    on the rank that sampled them: group statistics and dynamic sampling are local.
  - the step decision is collective: after each sampling round the ranks share their buffered group counts;
    the step happens when all ranks together hold groups_per_rollout * N groups, then each rank trains on its
    share (balanced; a rank may have fewer, or none).
  - gradients: every micro-batch's loss is divided by the step's unit count summed over ALL ranks (tokens,
    responses or groups, per loss_agg_mode), and after the accumulation loop the gradients are SUMMED
    across ranks (one all-reduce per step, in buckets). That is exactly the one-process gradient of the
    step's N * b groups, whatever each rank held. No DDP: its hooks average (a factor N to undo), sync on
    every backward unless told not to, and hang when ranks run different numbers of backward passes.
  - rank 0 alone writes logs, curves, checkpoints and the final model; metrics of all ranks are gathered
    first. Evaluation splits its problems across ranks and sums the counts.
  - checkpoints hold every rank's loop state and RNG (gathered to rank 0), and the world size: a resume under
    another world size is refused with a message.

--fsdp=true shards the model over the ranks: fsdp.py, imported only then.
"""

import atexit
import contextlib
import datetime
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

GRAD_BUCKET = 2**24  # gradient elements per all-reduce (64 MB of float32)


def setup(device="cpu", num_threads=0, timeout=1800):
    """This process's World: one process when WORLD_SIZE is unset or 1; else join (or reuse) the process
    group: NCCL when the device is CUDA (each process on cuda:LOCAL_RANK), gloo on CPU. num_threads > 0: torch's
    CPU threads (a CPU's sums, and so the samples, depend on their number; 0 keeps torch's default). timeout:
    the seconds a collective waits for the other ranks (DapoArguments.ddp_timeout; NCCL's own default is 10
    minutes, shorter than rank 0 alone writing a 1.5B model's checkpoint on slow storage)."""
    torch.set_num_threads(num_threads or torch.get_num_threads())
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # (torchrun --fsdp, 1 process: init_device_mesh makes a group)
        return World(device="cuda" if device.startswith("cuda") else "cpu")
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    return World(dist.get_rank(), dist.get_world_size(), "cuda" if device.startswith("cuda") else "cpu")


def end_of_run():
    """`python train.py` ends here once main() has returned. A process of a multi-process run ends with
    os._exit(0), its process group destroyed, without the interpreter's shutdown. Under --fsdp the sharded model
    holds the group and outlives even `del` and gc.collect() (torch's FSDP state keeps it), so
    destroy_process_group cannot join gloo's worker threads, and a worker that drops a finished collective's
    tensor during the shutdown needs the GIL and aborts the process ("terminate called without an active
    exception": 2 of 111 runs of a 2-process --fsdp training on a loaded 2-core machine, after everything was
    written; 0 of 210 since). All the run writes is closed by then; stdout and stderr are flushed. One process
    (vLLM's own group of 1 included) goes through the usual shutdown."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def launcher(processes, fsdp=False):
    """How to start a run of this many processes: the command a resume must repeat (--fsdp: torchrun, even for 1)."""
    return "python train.py" if processes == 1 and not fsdp else f"torchrun --nproc_per_node={processes} train.py"


def step_slice(items, index, parts):
    """The index-th of `parts` near-equal consecutive slices of items (a rollout's micro-batches split over
    steps_per_generation optimizer steps). With len(items) = parts * k: items[index * k : (index + 1) * k]."""
    size, extra = divmod(len(items), parts)
    first = index * size + min(index, extra)
    return items[first : first + size + (index < extra)]


def rollout_share(counts, per_rank, rank=0):
    """The step decision, after each sampling round, from every rank's buffered group count (counts, in rank
    order; [held] in one process): None while together they hold fewer than per_rank * N groups, else how many
    of its groups this rank trains on. In one process: per_rank once held >= per_rank."""
    if sum(counts) < per_rank * len(counts):
        return None
    return balanced_shares(counts, per_rank * len(counts))[rank]


def balanced_shares(counts, total):
    """How many of its buffered groups each rank trains on so that together they take `total`: up to
    total / N each, the rest from the ranks that have more, in rank order."""
    shares = [min(count, total // len(counts)) for count in counts]
    missing = total - sum(shares)
    for rank, count in enumerate(counts):
        extra = min(count - shares[rank], missing)
        shares[rank], missing = shares[rank] + extra, missing - extra
    return shares


def to_device(value, device):
    """value with every tensor in it (in dicts, lists and tuples, nested) on device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(v, device) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    return value


def to_cpu(value):
    return to_device(value, "cpu")


class World:
    """Rank `rank` of `size` processes. With size 1 every collective returns its input."""

    fsdp = False  # fsdp.FsdpWorld: parameters, gradients and optimizer states sharded over the ranks

    def __init__(self, rank=0, size=1, device="cpu"):
        self.rank, self.size, self.device = rank, size, device

    @property
    def is_main(self):
        return self.rank == 0

    # ---- collectives on plain Python values ----
    def sum(self, value):
        """value summed over ranks (int stays int)."""
        if self.size == 1:
            return value
        dtype = torch.float64 if isinstance(value, float) else torch.int64
        tensor = torch.tensor(value, dtype=dtype, device=self.device)
        dist.all_reduce(tensor)
        return type(value)(tensor.item())

    def any(self, flag):
        return bool(self.sum(int(flag))) if self.size > 1 else flag

    def gather(self, value):
        """[value of rank 0, value of rank 1, ...] on every rank."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        dist.all_gather_object(values, to_cpu(value))
        return values

    def from_rank_0(self, value):
        """Rank 0's value on every rank."""
        if self.size == 1:
            return value
        box = [to_cpu(value)]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # ---- the model ----
    def broadcast_parameters(self, model):
        """Start every rank from rank 0's weights (they load the same files; this makes it certain). A model
        still on the CPU under NCCL (--fsdp keeps it there until sharded) goes over one tensor at a time."""
        if self.size > 1:
            for tensor in model.state_dict().values():
                on_device = tensor.data if tensor.device.type == self.device else tensor.data.to(self.device)
                dist.broadcast(on_device, src=0)
                if on_device is not tensor.data:
                    tensor.data.copy_(on_device)

    def reduce_gradients(self, model):
        """Sum the step's gradients over ranks (in place; a rank without a micro-batch adds zeros). The losses
        are already divided by the whole step's unit count, so the sum is the one-process gradient."""
        if self.size == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket = []
        for i, p in enumerate(params):
            bucket.append(p.grad)
            if i == len(params) - 1 or sum(g.numel() for g in bucket) + params[i + 1].numel() > GRAD_BUCKET:
                flat = torch.cat([g.flatten() for g in bucket])
                dist.all_reduce(flat)  # sum
                for g, chunk in zip(bucket, flat.split([g.numel() for g in bucket])):
                    g.copy_(chunk.view_as(g))
                bucket = []

    # ---- what --fsdp changes (fsdp.FsdpWorld); without it, the model is whole on every rank ----
    def unsharded(self, model):
        return contextlib.nullcontext()

    def while_unsharded(self, model, iterable):
        return iterable

    def placeholder_groups(self, num_micro_batches):
        """Groups to make extra micro-batches of, so that every rank runs as many: none without --fsdp."""
        return []

    def full_model_state(self, model):
        return None  # the model's own state_dict is the full one

    def full_optimizer_state(self, model, optimizer):
        return None  # the optimizer's own state_dict is the full one

    def load_model_state(self, model, weights):
        return model.load_state_dict(weights)

    def load_optimizer_state(self, model, optimizer, saved):
        return optimizer.load_state_dict(saved)

    # ---- sampling ----
    def shard(self, batches):
        """This rank's prompt batches: r, r + N, ...; the last len % N are dropped so that ranks run equal rounds."""
        if self.size == 1:
            yield from batches
            return
        usable = len(batches) // self.size * self.size
        for index, batch in enumerate(batches):
            if index >= usable:
                return
            if index % self.size == self.rank:
                yield batch

    def rounds_to_sample(self, held, per_rank, batch_size, generation_batch_size=0):
        """How many prompt batches this rank samples in its next call, given `held` buffered groups: the least
        the rollout still needs (each batch adds at most batch_size groups per rank, so the rollout cannot fill
        before the last of them: the seed's rounds, in the seed's order, sampled at once), or more when
        generation_batch_size (prompts over all ranks) asks for more. Collective under torchrun."""
        missing = per_rank * self.size - self.sum(held)
        needed = max(1, -(-missing // (batch_size * self.size)))
        return max(needed, -(-generation_batch_size // (batch_size * self.size)))

    # ---- logging ----
    def gather_step(self, metrics):
        """One optimizer step's metrics (micro-step losses included) from every rank, in rank order. Timings
        become the slowest rank's total (wall-clock); the rest is concatenated, so means are over all ranks."""
        if self.size == 1:
            return metrics
        gathered = self.gather(dict(metrics))
        merged = defaultdict(list)
        for rank_metrics in gathered:
            for key, values in rank_metrics.items():
                merged[key].extend(values)
        for key in merged:
            if key.startswith("time/"):
                merged[key] = [max(sum(m.get(key, [])) for m in gathered)]
        return merged

    def share(self, dataset):
        """This rank's evaluation problems: rank, rank + N, ..."""
        if self.size == 1:
            return dataset
        return torch.utils.data.Subset(dataset, range(self.rank, len(dataset), self.size))

    def gather_eval(self, records, examples, max_examples):
        """Every rank's evaluation records, and the first max_examples examples, in the problems' order (share
        gave rank r the problems r, r + N, ...): interleaved back."""
        if self.size == 1:
            return records, examples
        rows = self.gather((records, examples))
        interleave = lambda lists: [x[i] for i in range(max(map(len, lists))) for x in lists if i < len(x)]  # noqa
        return interleave([r for r, _ in rows]), interleave([e for _, e in rows])[:max_examples]
