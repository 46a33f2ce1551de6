"""--fsdp=true under torchrun (models whose training state does not fit one GPU): FsdpWorld, the World of a
run whose policy and reference model are sharded with torch's fully_shard (FSDP2), every decoder layer, then
the root. Imported only with --fsdp (DapoTrainer.__init__). What changes from distributed.World:
  - gradients are reduce-scattered by FSDP in each backward, summed (divide factor 1, ReduceOp.SUM), so
    reduce_gradients does nothing; accumulation keeps sharded gradients (reduced every micro-step: the
    unsynced alternative would hold full gradients until the last one).
  - every forward and backward is a collective: every rank trains as many micro-batches (train.py's rollout
    gives each rank its equal part of every step: distributed.step_shares).
  - generate (a forward per token, ranks stopping at different lengths) runs inside `unsharded`: the whole
    model gathered once per sampling round on every rank (one without a prompt that round too), once per
    evaluation (while_unsharded), resharded after.
  - checkpoints and the final model: full states gathered to rank 0 (full_model_state,
    full_optimizer_state) and written as one process writes them; a resume reads them on rank 0 alone, which
    sends each rank its shards one tensor at a time (load_model_state, load_optimizer_state): one full copy in
    host memory, not one per rank.
"""

import contextlib

from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from dapo_utils.distributed import World

FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0, in CPU memory
FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # rank 0's full state, sharded


class FsdpWorld(World):
    """A World whose models are sharded over its ranks (shard)."""

    fsdp = True

    def __init__(self, rank, size, device):
        super().__init__(rank, size, device)
        self.unsharded_depth = 0  # nested `unsharded` blocks: the outermost gathers and reshards

    @classmethod
    def shard_models(cls, world, *models):
        """world's ranks, with each model (None skipped) sharded by fully_shard: every decoder layer, then the root
        (embeddings, final norm, lm_head). Parameters, gradients and the optimizer's states (made afterwards, over
        the sharded parameters) then live 1/N on each rank; a module's full parameters exist only around its
        forward and backward. Gradients are reduce-scattered as a plain SUM (divide factor 1), as
        World.reduce_gradients would."""
        mesh = init_device_mesh(world.device, (world.size,))
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
        return cls(world.rank, world.size, world.device)

    def reduce_gradients(self, model):
        """Nothing: FSDP reduce-scattered them (summed) in each backward."""

    @contextlib.contextmanager
    def unsharded(self, model):
        """The whole model gathered on every rank for the block, resharded after. the sampler calls forward once
        per token and ranks stop at different lengths, so per-forward all-gathers would not pair up across
        ranks (a hang); one all-gather per block does. Nested blocks gather once."""
        if self.unsharded_depth:
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

    def full_model_state(self, model):
        """The full state dict (CPU tensors) on rank 0, {} on the others; collective."""
        return get_model_state_dict(model, options=FULL_STATE)

    def full_optimizer_state(self, model, optimizer):
        """The optimizer's full state on rank 0, in optimizer.state_dict()'s own format (parameters numbered in
        order), so that a checkpoint reads the same with or without FSDP; collective."""
        by_name = get_optimizer_state_dict(model, optimizer, options=FULL_STATE)
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
        """model.load_state_dict(weights) with rank 0's full weights ({} on the others, which read nothing): each
        tensor is broadcast in turn and every rank keeps its shard. Collective."""
        set_model_state_dict(model, weights, options=FROM_RANK_0)

    def load_optimizer_state(self, model, optimizer, saved):
        """optimizer.load_state_dict(saved) with rank 0's full, numbered state dict (None on the others): each
        tensor is broadcast in turn and every rank keeps its shard. Collective."""
        by_name = {}
        if saved is not None:
            names = [name for name, _ in model.named_parameters()]  # the optimizer's order: model.parameters()
            by_name["state"] = {names[number]: value for number, value in saved["state"].items()}
            by_name["param_groups"] = [
                group | {"params": [names[n] for n in group["params"]]} for group in saved["param_groups"]
            ]
        set_optimizer_state_dict(model, optimizer, by_name, options=FROM_RANK_0)


def fsdp_modules(model):
    """The modules fully_shard wrapped (the root among them), in model.modules() order."""
    return [module for module in model.modules() if isinstance(module, FSDPModule)]
