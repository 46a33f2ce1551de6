"""Data-parallel DAPO across processes: `torchrun --nproc_per_node=N train.py` or `accelerate launch
--num_processes N train.py` (both set WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT), on one node or several
(`torchrun --nnodes=M ... --rdzv_backend=c10d`: RANK is global, LOCAL_RANK the process's place on its node).
Without WORLD_SIZE (plain `python train.py`) there is one process, no process group, and every method here is a
no-op.

N processes take the one-process step (the step of one process with N times the gradient accumulation), dynamic
sampling included. How (see setup's World for each piece):
  - prompts: every rank walks the epoch's seeded order of prompt batches. Each sampling call takes the batches
    one process would take (World.rounds_to_sample, from the groups held over all ranks), and each rank samples
    its consecutive part of them (step_slice: a rank may have none). Groups are scored, and dynamic sampling
    keeps or drops them, on the rank that sampled them: a group's statistics are its own.
  - the step decision is made in the sampling order: after each sampling round the ranks share the places (in the
    epoch's order) of the groups they hold; once they hold the rollout's groups together, the rollout is the
    first ones by place (rollout_order) -- one process's buffer[:count] -- and each rank trains its consecutive
    part of every optimizer step's slice (step_shares), the groups sent over by the ranks that sampled them
    (World.exchange). The rest stays buffered where it was sampled.
  - gradients: every micro-batch's loss is divided by the step's unit count summed over ALL ranks (tokens,
    responses or groups, per loss_agg_mode), and after the accumulation loop the gradients are SUMMED
    across ranks (one all-reduce per step, in buckets). That is exactly the one-process gradient of the
    step's groups. No DDP: its hooks average (a factor N to undo) and sync on every backward unless told not to.
  - rank 0 alone writes logs, curves, checkpoints and the final model, and holds the output folder's lock;
    metrics of all ranks are gathered first. Evaluation splits its problems across ranks and sums the counts.
  - checkpoints hold every rank's loop state and RNG (gathered to rank 0) and the number of processes; a resume
    under another number regroups them (regrouped): the weights and optimizer states are whole.

--fsdp=true shards the model over the ranks: fsdp.py, imported only then.
"""

import atexit
import contextlib
import dataclasses
import datetime
import os
import socket
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

GRAD_BUCKET = 2**24  # gradient elements per all-reduce (64 MB of float32)

# (host, PID) of every rank, in rank order, once the process group has started: which rank's process ended
PROCESSES = []
# What a collective raises when its connection to another rank breaks: gloo's words (the peer's process ended and
# its sockets closed), NCCL's ("remote process exited or there was a network error")
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")
# Seconds a rank waits for the process of a rank that closed its connections to end: one ending in an error of
# its own (a reward function's, say) closes them at its exit, a few milliseconds before it has ended
EXIT_WAIT = 1.0


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
        backend, timeout = "nccl" if device.startswith("cuda") else "gloo", datetime.timedelta(seconds=timeout)
        dist.init_process_group(backend, timeout=timeout, **this_attempts_store())
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
        PROCESSES[:] = [None] * dist.get_world_size()
        dist.all_gather_object(PROCESSES, (socket.gethostname(), os.getpid()))
    return World(dist.get_rank(), dist.get_world_size(), "cuda" if device.startswith("cuda") else "cpu")


def this_attempts_store():
    """init_process_group's store under torchrun, in keys of this attempt alone (TORCHELASTIC_RESTART_COUNT); {}
    elsewhere (its own env:// store). torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE) and keeps it
    through a restart (--max-restarts), with the addresses the killed group's ranks left under the same keys:
    the new group's gloo or NCCL read them and connect to processes that are gone (a timeout, or a hang; pytorch
    issue 167288). Measured with torch 2.13, gloo, 2 processes and rank 0 killed: 4 of 6 restarts failed so, 0 of 6
    in this attempt's keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    address, port, size = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(address, port, size, is_master=False)  # the agent's, as env:// would join it
    attempt = f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return dict(store=dist.PrefixStore(attempt, store), rank=int(os.environ["RANK"]), world_size=size)


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


def peer_lost(error):
    """Whether error is a collective's that lost another rank: its process ended (killed, out of memory)."""
    lost = isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_LOST)
    return lost and dist.is_initialized() and dist.get_world_size() > 1


def peer_lost_line(advice):
    """The line this rank ends with once another rank's process has gone: which rank (those whose process on this
    host has ended; with two ranks, the other; else unnamed) and what comes next: torchrun starts the job again
    while its --max-restarts allow, else `advice` (resume_advice: the command that continues)."""
    rank = dist.get_rank()
    gone = [str(r) for r in ended_ranks(rank)]
    if len(gone) == 1:
        who = f"rank {gone[0]} is gone (its process ended)"
    elif gone:
        who = f"ranks {', '.join(gone)} are gone (their processes ended)"
    elif len(PROCESSES) == 2:  # the one other rank: on another node, or still exiting
        who = f"rank {1 - rank} is gone (its connection closed)"
    else:
        who = "another rank is gone"
    restarts, done = (int(os.environ.get(f"TORCHELASTIC_{key}", "0")) for key in ("MAX_RESTARTS", "RESTART_COUNT"))
    then = f"torchrun starts the job again (restart {done + 1} of {restarts})" if done < restarts else advice
    return f"rank {rank}: {who}; {then}"


def ended_ranks(rank):
    """The ranks but `rank` whose process on this host has ended, once one has or EXIT_WAIT seconds have passed."""
    host, deadline = socket.gethostname(), time.monotonic() + EXIT_WAIT
    while True:
        gone = [r for r, (on, pid) in enumerate(PROCESSES) if r != rank and on == host and process_ended(pid)]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.01)


def process_ended(pid):
    """Whether process pid has ended: gone, or a zombie that its parent (torchrun's agent) has not reaped yet."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # its state, after the name
    except ProcessLookupError:
        return True
    except OSError:  # another user's process, or no /proc (macOS): it exists
        return False


def step_slice(items, index, parts):
    """The index-th of `parts` near-equal consecutive slices of items (a rollout's micro-batches split over
    steps_per_generation optimizer steps). With len(items) = parts * k: items[index * k : (index + 1) * k]."""
    size, extra = divmod(len(items), parts)
    first = index * size + min(index, extra)
    return items[first : first + size + (index < extra)]


def rollout_order(held, count):
    """The step decision, in the sampling order. held[r]: the places (in the epoch's prompt order) of the groups
    rank r holds, in its buffer's order. Returns the rollout, the first `count` of all of them by place, as (rank,
    position in that rank's buffer), or None while they are fewer. One process: buffer[:count], the seed's."""
    everyone = sorted(
        (place, rank, position) for rank, places in enumerate(held) for position, place in enumerate(places)
    )
    return None if len(everyone) < count else [(rank, position) for _, rank, position in everyone[:count]]


def step_shares(items, steps, rank, size):
    """Rank `rank`'s part of a rollout's items (groups, or micro-batches) in the sampling order, for `size` ranks:
    of each of the `steps` optimizer steps' consecutive slices (step_slice), its consecutive part (rank 0 the
    first). Each rank's part is itself `steps` equal slices, one per optimizer step. One rank: all of them."""
    return [item for step in range(steps) for item in step_slice(step_slice(items, step, steps), rank, size)]


def joined_steps(parts, steps):
    """The rollout's items in the sampling order again, from every rank's step_shares (parts, in rank order)."""
    return [item for step in range(steps) for part in parts for item in step_slice(part, step, steps)]


def regrouped(saved, rank, size, steps):
    """This rank's {"loop", "rng", "cuda_rng"} from a checkpoint's, one per rank that wrote it (saved; the loop
    states are train.LoopState.state_dict's). Under as many processes: its own. Under another number (the weights
    and optimizer states are whole, the step the same: checkpoints.resume checks it): the groups buffered by the
    writing ranks rank, rank + size, ... (the rollout takes them in the sampling order wherever they are); the
    rollout being trained re-split step by step (steps: steps_per_generation); the whole-run counts on rank 0; the
    RNG of writing rank `rank`, none for a rank the run did not have (it keeps its own seed's)."""
    if len(saved) == size:
        return saved[rank]
    loops = [entry["loop"] for entry in saved]
    buffer = [group for r, other in enumerate(loops) if r % size == rank for group in other["buffer"]]
    loop = dict(loops[0], buffer=sorted(buffer, key=lambda group: group.get("index", 0)))  # in the sampling order
    if loop["rollout"] is not None:
        loop["rollout"] = step_shares(joined_steps([other["rollout"] for other in loops], steps), steps, rank, size)
    for key in ("skipped_groups", "truncated_prompts"):  # whole-run counts, logged as sums over the ranks
        loop[key] = sum(other[key] for other in loops) if rank == 0 else 0
    rng = saved[rank] if rank < len(saved) else {"rng": None, "cuda_rng": None}
    return {"loop": loop, "rng": rng["rng"], "cuda_rng": rng["cuda_rng"]}


def to_device(value, device):
    """value (a tensor, or a dict, list, tuple or dataclass of them) with its tensors on device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {key: to_device(v, device) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value, **{f.name: to_device(getattr(value, f.name), device) for f in dataclasses.fields(value)}
        )
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
        dist.all_gather_object(values, to_device(value, "cpu"))
        return values

    def from_rank_0(self, value):
        """Rank 0's value on every rank."""
        if self.size == 1:
            return value
        box = [to_device(value, "cpu")]
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
        """Sum the step's gradients over ranks (in place; a parameter no micro-batch reached adds zeros). The losses
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

    def full_model_state(self, model):
        return None  # the model's own state_dict is the full one

    def full_optimizer_state(self, model, optimizer):
        return None  # the optimizer's own state_dict is the full one

    def load_model_state(self, model, weights):
        return model.load_state_dict(weights)

    def load_optimizer_state(self, model, optimizer, saved):
        return optimizer.load_state_dict(saved)

    # ---- sampling ----
    def rounds_to_sample(self, held, per_rank, batch_size, generation_batch_size=0):
        """How many prompt batches the next sampling call takes, over all ranks, given `held` buffered groups over
        all ranks: the least the rollout (per_rank groups on each rank) still needs -- each batch adds at most
        batch_size groups, so the rollout cannot fill before the last of them: the seed's rounds, in the seed's
        order, sampled at once, as one process would take them -- or more when generation_batch_size (prompts,
        over all ranks) asks for more."""
        needed = max(1, -(-(per_rank * self.size - held) // batch_size))
        return max(needed, -(-generation_batch_size // batch_size))

    def take_rollout(self, buffer, count, steps):
        """The next rollout from every rank's buffered groups (buffer: this rank's, each with its .index, its place in
        the epoch's prompt order): the first `count` in that order, wherever they were sampled (one process:
        buffer[:count], the seed's). Returns (this rank's part of every one of the `steps` optimizer steps, sent
        over by the ranks that hold them; the groups it keeps buffered), or None while all hold fewer. Collective."""
        order = rollout_order(self.gather([group.index for group in buffer]), count)  # [(rank, position)]
        if order is None:
            return None
        parts = [step_shares(order, steps, rank, self.size) for rank in range(self.size)]
        incoming = self.exchange([[buffer[at] for rank, at in part if rank == self.rank] for part in parts])
        incoming = [iter(groups) for groups in incoming]  # each rank's, in this rank's order
        taken = {at for rank, at in order if rank == self.rank}
        kept = [group for at, group in enumerate(buffer) if at not in taken]
        return [next(incoming[rank]) for rank, _ in parts[self.rank]], kept

    def exchange(self, outgoing):
        """Objects between ranks: outgoing[t] goes to rank t (this rank's own entry stays here, untouched). Returns
        what each rank sent this one, in rank order, its tensors on this rank's device. One scatter per rank."""
        if self.size == 1:
            return list(outgoing)
        incoming = []
        for source in range(self.size):
            box, sent = [None], None
            if source == self.rank:
                sent = [None if t == self.rank else to_device(items, "cpu") for t, items in enumerate(outgoing)]
            dist.scatter_object_list(box, sent, src=source)
            incoming.append(outgoing[source] if source == self.rank else to_device(box[0], self.device))
        return incoming

    def on_rank_0(self, decide):
        """decide() on rank 0 alone (a choice every rank must share: which checkpoint, the output folder's state),
        its value on every rank. If it raises, rank 0 raises it (and says why) and the other ranks exit (status 1)
        without a word, instead of waiting for a rank that has gone."""
        if self.size == 1:
            return decide()
        value, error = None, None
        if self.is_main:
            try:
                value = decide()
            except BaseException as raised:  # noqa: BLE001 - re-raised below, after the others are told
                error = raised
        value, failed = self.from_rank_0((None, True) if error is not None else (value, False))
        if error is not None:
            raise error
        if failed:
            sys.exit(1)
        return value

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
