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

--fsdp=true (World.apply_fsdp; models whose training state does not fit one GPU): torch's fully_shard
(FSDP2) on every decoder layer, then the root, for the policy and the reference model. The rest stays:
  - gradients are reduce-scattered by FSDP in each backward, summed (divide factor 1, ReduceOp.SUM), so
    reduce_gradients does nothing; accumulation keeps sharded gradients (reduced every micro-step: the
    unsynced alternative would hold full gradients until the last one).
  - every forward and backward is a collective: equal_micro_batches gives every rank as many micro-batches,
    padding with placeholders that weigh nothing (an empty loss, no unit in the step's count).
  - generate (a forward per token, ranks stopping at different lengths) runs inside `unsharded`: the whole
    model gathered once per call, once per evaluation (while_unsharded), resharded after.
  - checkpoints and the final model: full states gathered to rank 0 (full_model_state,
    full_optimizer_state) and written as one process writes them; a resume loads them on every rank and
    keeps each shard (load_model_state, load_optimizer_state).
Without --fsdp none of this runs, and torch.distributed.fsdp is never imported.
"""

import atexit
import contextlib
import functools
import os
import sys
from collections import defaultdict

import torch
import torch.distributed as dist

GRAD_BUCKET = 2**24  # gradient elements per all-reduce (64 MB of float32)


def setup(device="cpu"):
    """This process's World: one process when WORLD_SIZE is unset or 1; else join (or reuse) the process
    group: NCCL when the device is CUDA (each process on cuda:LOCAL_RANK), gloo on CPU."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return World()
    if not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
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


def launcher(processes):
    """How to start a run of this many processes: the command a resume must repeat."""
    return "python train.py" if processes == 1 else f"torchrun --nproc_per_node={processes} train.py"


def step_slice(items, index, parts):
    """The index-th of `parts` near-equal consecutive slices of items (a rollout's micro-batches split over
    steps_per_generation optimizer steps). With len(items) = parts * k: items[index * k : (index + 1) * k]."""
    size, extra = divmod(len(items), parts)
    first = index * size + min(index, extra)
    return items[first : first + size + (index < extra)]


def balanced_shares(counts, total):
    """How many of its buffered groups each rank trains on so that together they take `total`: up to
    total / N each, the rest from the ranks that have more, in rank order."""
    shares = [min(count, total // len(counts)) for count in counts]
    missing = total - sum(shares)
    for rank, count in enumerate(counts):
        extra = min(count - shares[rank], missing)
        shares[rank], missing = shares[rank] + extra, missing - extra
    return shares


def to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: to_cpu(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


class World:
    """Rank `rank` of `size` processes. With size 1 every collective returns its input."""

    def __init__(self, rank=0, size=1, device="cpu"):
        self.rank, self.size, self.device = rank, size, device
        self.synced_skips = 0  # state.skipped_groups (over all ranks) at the last sync; set again by resume
        self.fsdp = False  # set by apply_fsdp
        self.unsharded_depth = 0  # nested `unsharded` blocks: the outermost gathers and reshards

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
        are already divided by the whole step's unit count, so the sum is the one-process gradient. Under
        --fsdp, nothing: FSDP reduce-scattered them (summed) in each backward."""
        if self.size == 1 or self.fsdp:
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

    # ---- FSDP (--fsdp) ----
    def apply_fsdp(self, enabled, *models):
        """--fsdp: shard each model (None skipped) with torch's fully_shard (FSDP2): every decoder layer, then
        the root (embeddings, final norm, lm_head). Parameters, gradients and the optimizer's states (made
        afterwards, over the sharded parameters) then live 1/N on each rank; a module's full parameters
        exist only around its forward and backward. Gradients are reduce-scattered as a plain SUM (divide
        factor 1), as reduce_gradients would. Without --fsdp, nothing (and nothing imported)."""
        if not enabled:
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device, (self.size,))
        for model in models:
            if model is None:
                continue
            layers = getattr(getattr(model, "model", None), "layers", None)
            if layers is None:
                raise ValueError(f"--fsdp shards decoder layers model.model.layers; {type(model).__name__} has none")
            for layer in layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            for module in fsdp_modules(model):
                module.set_gradient_divide_factor(1.0)  # the losses are divided by the step's units already
                module.set_force_sum_reduction_for_comms(True)  # ReduceOp.SUM: no PREMUL_SUM (gloo has none)
        self.fsdp = True

    @contextlib.contextmanager
    def unsharded(self, model):
        """--fsdp: the whole model gathered on every rank for the block, resharded after. generate calls
        forward once per token and ranks stop at different lengths, so per-forward all-gathers would not
        pair up across ranks (a hang); one all-gather per block does. Nested blocks gather once."""
        if not self.fsdp or self.unsharded_depth:
            self.unsharded_depth += 1
            try:
                yield
            finally:
                self.unsharded_depth -= 1
            return
        modules = fsdp_modules(model)
        for module in modules:
            module.set_reshard_after_forward(False, recurse=False)
            module.unshard()
        self.unsharded_depth = 1
        try:
            yield
        finally:
            self.unsharded_depth = 0
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(module is not model, recurse=False)  # fully_shard's defaults

    def while_unsharded(self, model, iterable):
        """iterable's items, with the model unsharded from before the first to after the last (evaluation:
        ranks may hold different numbers of batches, even none; each gathers once)."""
        with self.unsharded(model):
            yield from iterable

    def equal_micro_batches(self, make, groups, batch_size):
        """make(groups): the rollout's micro-batches. Under --fsdp every forward and backward is a collective,
        so every rank needs as many micro-batches: the ranks with fewer get placeholders that weigh nothing
        (one token of context, no response row: the loss is an empty sum and adds no unit to the step's
        count, while forward and backward still run, all-gathering and reduce-scattering with the others)."""
        if not self.fsdp:
            return make(groups)
        mine = -(-len(groups["advantages"]) // batch_size)
        most = max(self.gather(mine))  # before any forward: the all-gathers must pair up
        micro_batches = make(groups)
        for _ in range(most - mine):
            micro_batches += make(placeholder_group(self.device))
        return micro_batches

    def full_model_state(self, model):
        """--fsdp: the full state dict (CPU tensors) on rank 0, {} on the others; collective. Else None (the
        model's own state_dict is the full one)."""
        if not self.fsdp:
            return None
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_optimizer_state(self, model, optimizer):
        """--fsdp: the optimizer's full state on rank 0, in optimizer.state_dict()'s own format (parameters
        numbered in order), so that a checkpoint reads the same with or without FSDP; collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        by_name = get_optimizer_state_dict(model, optimizer, options=options)
        if not self.is_main:
            return None
        state, groups, index = {}, [], 0
        for group in by_name["param_groups"]:
            numbers = list(range(index, index + len(group["params"])))
            for number, name in zip(numbers, group["params"]):
                if name in by_name["state"]:
                    state[number] = by_name["state"][name]
            groups.append(group | {"params": numbers})
            index += len(numbers)
        return {"state": state, "param_groups": groups}

    def load_model_state(self, model, weights):
        """model.load_state_dict(weights) with full weights; under --fsdp each rank keeps its shard."""
        if not self.fsdp:
            return model.load_state_dict(weights)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state(self, model, optimizer, saved):
        """optimizer.load_state_dict(saved) with a full, numbered state dict; under --fsdp each rank keeps its
        shard of it."""
        if not self.fsdp:
            return optimizer.load_state_dict(saved)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = [name for name, _ in model.named_parameters()]  # the optimizer's order: model.parameters()
        by_name = {
            "state": {names[number]: value for number, value in saved["state"].items()},
            "param_groups": [
                group | {"params": [names[n] for n in group["params"]]} for group in saved["param_groups"]
            ],
        }
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))

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

    def rollout_size(self, state, per_rank):
        """After a sampling round: None while the ranks together hold fewer than per_rank * N valid groups,
        else how many of its buffered groups this rank trains on. Collective: every rank decides the same.
        Also makes state.skipped_groups the count over all ranks."""
        held = len(state.buffer["advantages"])
        if self.size == 1:
            return per_rank if held >= per_rank else None
        rows = self.gather((held, state.skipped_groups - self.synced_skips))
        state.skipped_groups = self.synced_skips = self.synced_skips + sum(new for _, new in rows)
        counts = [count for count, _ in rows]
        if sum(counts) < per_rank * self.size:
            return None
        return balanced_shares(counts, per_rank * self.size)[self.rank]

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

    # ---- checkpoints ----
    def save_checkpoint(self, trainer, save):
        """save(trainer) on rank 0 with every rank's loop state and RNG in the loop state's "ranks". Under
        --fsdp, the full model and optimizer state are gathered first (every rank takes part) and rank 0
        writes them as one process would."""
        if self.size == 1:
            return save(trainer)
        if self.fsdp:
            model_state = self.full_model_state(trainer.model)
            optimizer_state = self.full_optimizer_state(trainer.model, trainer.optimizer)
            save = functools.partial(save, model_state=model_state, optimizer_state=optimizer_state)
        cuda_rng = torch.cuda.get_rng_state() if self.device == "cuda" else None
        mine = {"loop": trainer.state.state_dict(), "rng": torch.get_rng_state(), "cuda_rng": cuda_rng}
        everyone = self.gather(mine)
        path = None
        if self.is_main:
            trainer.state.ranks = everyone
            try:
                path = save(trainer)
            finally:
                del trainer.state.ranks
        return self.from_rank_0(path)  # also keeps the others from going on before the checkpoint exists

    def resume(self, trainer, checkpoint, resume):
        """Called on trainer.world (its sync counter is what rollout_size reads next).
        resume(trainer, checkpoint) on every rank, then this rank's own loop state and RNG. Rank 0 alone
        cuts the logs back, first; the others wait for it (under --fsdp they load with it, then wait)."""
        assert trainer.world is self, "resume through trainer.world: it holds this rank's sync state"
        if self.size == 1:
            return resume(trainer, checkpoint)
        if not self.is_main and not self.fsdp:  # --fsdp: loading the shards is collective, all ranks at once
            self.from_rank_0(None)
        try:
            resume(trainer, checkpoint, cut_logs=self.is_main)
        finally:
            if self.is_main or self.fsdp:
                self.from_rank_0(None)
        mine = trainer.state.ranks[self.rank]
        del trainer.state.ranks
        trainer.state.load_state_dict(mine["loop"])
        self.synced_skips = trainer.state.skipped_groups
        torch.set_rng_state(mine["rng"].cpu())
        if mine["cuda_rng"] is not None and self.device == "cuda":
            torch.cuda.set_rng_state(mine["cuda_rng"].cpu())


def fsdp_modules(model):
    """The modules fully_shard wrapped (the root among them), in model.modules() order."""
    from torch.distributed.fsdp import FSDPModule

    return [module for module in model.modules() if isinstance(module, FSDPModule)]


def placeholder_group(device):
    """A micro-batch's worth of nothing for equal_micro_batches: one row of two tokens (a one-token prompt and
    one response position) and no response row: the loss broadcasts to an empty [0, 1] tensor."""
    return {
        "prompt_response_ids": [torch.zeros(1, 2, dtype=torch.long, device=device)],
        "attention_mask": [torch.ones(1, 2, dtype=torch.long, device=device)],
        "action_mask": [torch.zeros(0, 1, dtype=torch.long, device=device)],
        "advantages": [torch.zeros(0, device=device)],
    }
