"""Models and checkpoints: load a policy (folder or .gguf); save (crash-consistently: fsynced before the rename, a
killed write completed by the lock's next holder), find, check (sha256 of each file but the editable
dapo_args.json) and load checkpoints that resume a run exactly, cutting the logs back to the checkpoint's step;
the final model saved atomically; writes that fail (a full disk) in one line, with the checkpoint to resume;
Ctrl-C, SIGTERM and SIGHUP that stop with a checkpoint, or, before training, at once with the clean-ups run."""

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import threading
import types
import typing
import zipfile

import safetensors
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo_utils import distributed
from dapo_utils.curves import in_words, read_jsonl, read_step_log, subfolders
from dapo_utils.distributed import to_device
from dapo_utils.options import run_command
from dapo_utils.writes import WRITE_ERRORS, WriteFailed, why, writing

TRAINER_STATE = "trainer_state.pt"  # in the newest checkpoint: optimizer, scheduler, loop state, RNG
ARGS_FILE = "dapo_args.json"  # in each checkpoint: the DapoArguments used
# Ctrl-C; SIGTERM: what SLURM and Kubernetes send before a kill; SIGHUP: a closed terminal or ssh session
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# In each checkpoint: {file: sha256} of every file but ARGS_FILE, checked on resume (a flipped bit reads back).
# dapo_args.json is the file a user reads and may edit: its keys and types are checked (checkpoint_arguments), and
# the step settings it may not change are checked against the trainer state's own copy (resume).
CHECKSUMS = "checksums.json"
TMP, ASIDE = ".tmp", ".old"  # checkpoint_N.tmp: being written; checkpoint_N.old: the one it replaces (move_into_place)
# in output_dir
LOG_FILES = ("training_losses.txt", "accuracy_losses.txt", "metrics.jsonl", "samples.jsonl", "evaluations.jsonl")
# What one optimizer step is made of: changing one of these on resume would silently change the run.
# (and gradient_accumulation_steps times the number of processes: resume checks it)
STEP_SETTINGS = ("num_generations", "batch_size", "steps_per_generation")
STEP_SETTINGS += ("num_iterations", "loss_agg_mode", "filter_metric", "seed", "use_vllm", "test_size")
STEP_SETTINGS += ("scale_rewards", "importance_sampling_level")  # the advantages buffered, the ratio of the loss
STEP_SETTINGS += ("lora_r", "lora_alpha", "lora_target_modules")  # the adapters' shapes and scale
ADAPTER_CONFIG = "adapter_config.json"  # peft's: the folder holds LoRA adapters (lora.py), not a whole model
PATH_FIELDS = ("model_path", "data_path", "output_dir")  # saved absolute in dapo_args.json


def load_causal_lm(path):
    """A float32 causal LM from a Hugging Face folder, or from a .gguf file (dequantised on load), or a LoRA adapter
    folder's base with its adapters merged in."""
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        from dapo_utils.lora import load_merged

        return load_merged(path, load_causal_lm)
    if not path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # plain float32 weights now: forget the GGUF "quantizer" so that saving works
    del model.config.quantization_config
    return model


def policy_model(model, args, device):
    """The policy to train: model (a path: loaded) in float32 on device; with lora_r > 0 wrapped with fresh LoRA
    adapters on its frozen base (lora.py: TRL's peft_config, verl's lora_rank)."""
    model = (load_causal_lm(model) if isinstance(model, str) else model).to(device, torch.float32)
    if args.lora_r > 0:
        from dapo_utils.lora import add_adapters

        return add_adapters(model, args)
    return model


def reference_model(policy, args):
    """pi_ref for beta > 0 (None when beta == 0: no reference model, half the memory): a frozen copy of the policy,
    in bf16 where it only runs under autocast (CUDA with bf16); with LoRA the policy itself, its adapters off."""
    if args.beta == 0.0:
        return None
    if args.lora_r:
        from dapo_utils.lora import AdaptersOff

        return AdaptersOff(policy)
    dtype = torch.bfloat16 if args.bf16 and args.device.startswith("cuda") else torch.float32
    return copy.deepcopy(policy).to(dtype).eval().requires_grad_(False)


def non_finite_weights(model):
    """'' when every weight is finite, else the parameters that hold a NaN or an infinity in words (under --fsdp:
    this rank's shards)."""
    params = [(name, p.to_local() if hasattr(p, "to_local") else p) for name, p in model.named_parameters()]
    finite = torch.stack([p.detach().isfinite().all() for _, p in params]).tolist()  # one device sync
    bad = [name for (name, _), ok in zip(params, finite) if not ok]
    return "" if not bad else bad[0] if len(bad) == 1 else f"{bad[0]} and {len(bad) - 1} more tensors"


def load_tokenizer(path):
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def checkpoint_path(output_dir, step):
    return os.path.join(output_dir, f"checkpoint_{step}")


def save_checkpoint(trainer, model_state=None, optimizer_state=None):
    """output_dir/checkpoint_N: model, tokenizer, optimizer, scheduler, loop position, RNG, arguments.

    Written at a step end to checkpoint_N.tmp with the sha256 of each file, read back (checkpoint_damage), each
    file and the folder fsynced, then moved into place (move_into_place), so a crash (or a full disk: one line,
    WriteFailed) never leaves a complete-looking half checkpoint. Only once its name is durable do older
    checkpoints drop their trainer state (keeping weights and tokenizer): at every instant a complete resumable
    copy exists, which complete_interrupted_saves puts in place after a kill.
    model_state, optimizer_state: the full states when the trainer's are sharded (--fsdp; see
    save_run_checkpoint); None = the model's and optimizer's own.
    """
    args, step = trainer.args, trainer.state.update_steps
    final = checkpoint_path(args.output_dir, step)
    tmp = final + TMP
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        trainer.model.save_pretrained(tmp, state_dict=model_state)
        trainer.tokenizer.save_pretrained(tmp)
        cuda_rng = torch.cuda.get_rng_state(args.device) if args.device.startswith("cuda") else None  # this GPU's
        optimizer_state = trainer.optimizer.state_dict() if optimizer_state is None else optimizer_state
        state = {"optimizer": optimizer_state, "scheduler": trainer.scheduler.state_dict()}
        state.update(loop=trainer.state.state_dict(), rng=torch.get_rng_state(), cuda_rng=cuda_rng)
        # What an edit of dapo_args.json may not change, and the step size another process count must keep:
        state["step_settings"] = {k: getattr(args, k) for k in (*STEP_SETTINGS, "gradient_accumulation_steps")}
        torch.save(state, os.path.join(tmp, TRAINER_STATE))
        with open(os.path.join(tmp, ARGS_FILE), "w", encoding="utf-8") as f:
            json.dump(saved_arguments(args), f, indent=2)
        write_checksums(tmp)
        damage = checkpoint_damage(tmp, checksums=False)  # read back before any older trainer state goes
        if damage:
            raise OSError(damage)
        for name in os.listdir(tmp):  # on the disk, not in the page cache, before a rename can expose it
            fsync_path(os.path.join(tmp, name))
        fsync_path(tmp)
    except (*WRITE_ERRORS, KeyboardInterrupt) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C while writing: no half checkpoint stays
            raise
        raise WriteFailed(f"could not write checkpoint_{step} (disk full?): {why(error)}") from error
    move_into_place(tmp, final)
    # Only the newest checkpoint keeps the trainer state (a 1.5B model's Adam states are 12 GB).
    older = sorted(s for s in find_checkpoints(args.output_dir) if s != step)
    for old in older:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(checkpoint_path(args.output_dir, old), TRAINER_STATE))
    for old in older[: max(0, len(older) + 1 - args.save_total_limit)] if args.save_total_limit else []:
        shutil.rmtree(checkpoint_path(args.output_dir, old))
    return final


def fsync_path(path):
    """Make a file's bytes, or a folder's names (the files created, renamed or removed in it), durable: on the
    disk, so that a power cut keeps them."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def move_into_place(tmp, final):
    """Rename the complete and durable folder tmp (checkpoint_N.tmp) to final. A rewrite of checkpoint_N (a resumed
    run stopped before its next step) first moves the existing one aside to checkpoint_N.old, removed only once
    the new name is durable (the folder fsynced): a kill between any two of these steps leaves a complete copy of
    step N under one of the three names, which complete_interrupted_saves puts back in place."""
    aside = final + ASIDE
    if os.path.isdir(final):
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_path(os.path.dirname(final))
    shutil.rmtree(aside, ignore_errors=True)


def complete_interrupted_saves(output_dir):
    """Finish the checkpoint writes a kill -9 or a power cut cut short in output_dir, so that the newest complete
    checkpoint is a checkpoint_N that --resume finds: a complete checkpoint_N.tmp (unfinished_damage) is moved into
    place as save_checkpoint would have, an incomplete one removed; a checkpoint_N.old goes back in place when no
    checkpoint_N is there, else it is removed. For the lock's holder (hold_output_dir), before a checkpoint is
    chosen: no other process writes there."""
    for step in sorted(set(find_checkpoints(output_dir, TMP) + find_checkpoints(output_dir, ASIDE))):
        final = checkpoint_path(output_dir, step)
        tmp, aside = final + TMP, final + ASIDE
        if os.path.isdir(tmp) and not unfinished_damage(tmp):  # the newer write of step N: it goes in place
            print(f"completing the write of {final}, which was cut short")
            move_into_place(tmp, final)
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.isdir(aside) and not os.path.isdir(final):
            os.rename(aside, final)
            fsync_path(output_dir)
        shutil.rmtree(aside, ignore_errors=True)


def unfinished_damage(folder):
    """'' when a checkpoint_N.tmp left by a killed write is complete: checkpoint_damage's checks, and every file
    that its checksums.json (written after the others) lists is there with its sha256; else what is not."""
    damage = checkpoint_damage(folder, (ARGS_FILE, TRAINER_STATE, CHECKSUMS), checksums=False)
    if damage:
        return damage
    with open(os.path.join(folder, CHECKSUMS), encoding="utf-8") as f:
        listed = list(json.load(f))
    missing = [name for name in listed if not os.path.isfile(os.path.join(folder, name))]
    return f"{os.path.join(folder, missing[0])} is missing" if missing else checksum_damage(folder, listed)


def saved_arguments(args):
    """A checkpoint's dapo_args.json: every field as resolved, the paths absolute (a resumed run may start in another
    working directory, or find a moved run's folders). output_dir/dapo_args.json holds the same and more (record.py)."""
    return dataclasses.asdict(args) | {k: os.path.abspath(getattr(args, k)) for k in PATH_FIELDS}


def checkpoint_arguments(checkpoint, arguments_class):
    """The arguments_class (DapoArguments) fields a resumed run inherits: all but the device (the machine's own),
    with output_dir the folder that holds the checkpoint. A key that is no field, or a value of another type
    (an edited or foreign file), is a ValueError naming the file and the key."""
    path = os.path.join(checkpoint, ARGS_FILE)
    with open(path, encoding="utf-8") as f:
        saved = json.load(f)
    fields = {field.name: field for field in dataclasses.fields(arguments_class)}
    if not isinstance(saved, dict):
        raise ValueError(f"{path} holds no arguments ({type(saved).__name__}, not an object): a damaged checkpoint")
    for key, value in saved.items():
        if key not in fields:
            raise ValueError(f"{path} has the key {key!r}, which is no {arguments_class.__name__} field: remove it")
        field = fields[key]  # HfArgumentParser drops Optional from a field's type: None fits a None default
        if not (fits(value, field.type) or (value is None and field.default is None)):
            kind = field.type.__name__ if isinstance(field.type, type) else str(field.type).replace("typing.", "")
            raise ValueError(f"{path}: {key} = {value!r} is not of its type ({kind}): correct or remove it")
    saved.pop("device", None)
    output_dir = os.path.dirname(os.path.abspath(checkpoint))
    for key in PATH_FIELDS[:2]:  # a run folder moved with its model or data inside: where they are now
        if key in saved and saved.get("output_dir"):
            moved = moved_path(saved[key], saved["output_dir"], output_dir)
            if moved != saved[key]:
                print(f"{key} {saved[key]!r} is gone: using {moved!r}, at its place in the moved run folder")
            saved[key] = moved
    return saved | {"output_dir": output_dir}


def moved_path(path, old_output_dir, output_dir):
    """Where a checkpoint's path (model_path, data_path) that no longer exists lies now that its run folder moved
    from old_output_dir to output_dir: at the same place inside it. The path itself when it exists, lies outside
    the run folder, or is not in the moved one either. An old_output_dir saved relative (before this version
    saved it absolute) is found inside the absolute path."""
    if os.path.exists(path):
        return path
    old = os.path.normpath(old_output_dir)
    if os.path.isabs(old):
        inside = os.path.relpath(path, old)
    else:  # relative to the working directory the run started in: look for it in the path
        marker = os.sep + old + os.sep
        inside = path.rsplit(marker, 1)[1] if marker in path and old != os.curdir else os.pardir
    candidate = os.path.normpath(os.path.join(output_dir, inside))
    return candidate if not inside.startswith(os.pardir) and os.path.exists(candidate) else path


def fits(value, kind):
    """Whether a JSON value fits a dataclass field's type (str, int, float, bool, Literal, Optional, List)."""
    origin, parts = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return value in parts
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, part) for part in parts)
    if origin is list:
        return isinstance(value, list) and all(fits(item, parts[0]) for item in value)
    if kind is float:  # JSON writes 1.0 as 1.0 but a hand edit may write 1
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, type(None) if kind is type(None) else kind)


def resume(trainer, checkpoint, cut_logs=True):
    """Continue from a checkpoint: weights, optimizer, scheduler, loop position and RNG. Optimizer settings
    given anew (lr, weight_decay, warmup_steps, max_grad_norm) apply from here on; a changed STEP_SETTINGS
    field is refused, and so is another step size: another number of processes resumes with as many micro-batches
    a step over all of them. Only then are the logs cut back to the checkpoint's step, so that no line repeats."""
    args, world = trainer.args, trainer.world
    reads = world.is_main or not world.fsdp  # --fsdp: rank 0 alone reads the full states, the others get shards
    saved = read_trainer_state(checkpoint, world)
    written = saved.get("step_settings")  # as the run had them, whatever an edit of dapo_args.json says
    if written is None:  # a checkpoint of an earlier version: its arguments file
        with open(os.path.join(checkpoint, ARGS_FILE), encoding="utf-8") as f:
            written = json.load(f)
    changed = [
        f"{k} ({written.get(k)!r} -> {getattr(args, k)!r})"
        for k in STEP_SETTINGS
        if written.get(k, getattr(type(args), k)) != getattr(args, k)  # a field newer than the checkpoint: default
    ]
    if changed:
        raise ValueError(
            f"cannot resume {checkpoint} with other step settings: {', '.join(changed)} (given on the command line "
            f"or edited in its {ARGS_FILE}); put them back, or start a new run"
        )
    step_change = other_step_size(written, saved["loop"].get("world_size", 1), args, world.size)
    if step_change:
        raise ValueError(f"cannot resume {checkpoint}: {step_change}")
    if args.lora_r:  # the adapters; the frozen base is model_path's
        from dapo_utils.lora import load_adapters

        load_adapters(trainer.model, checkpoint)
    else:  # no local holds the full weights past their load (the optimizer's full states come next)
        world.load_model_state(trainer.model, load_causal_lm(checkpoint).state_dict() if reads else {})
    settings = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
    world.load_optimizer_state(trainer.model, trainer.optimizer, saved.pop("optimizer"))
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.scheduler.base_lrs = [args.lr] * len(settings)
    for group, setting in zip(trainer.optimizer.param_groups, settings):  # this run's settings, not the saved ones
        group.update(setting, lr=args.lr * trainer.scheduler.lr_lambdas[0](trainer.scheduler.last_epoch))
    # The optimizer's states went to their parameters' device (load_state_dict); the buffered groups and the
    # unfinished rollout go to the run's, where the next micro-batch meets the model's hidden states.
    trainer.state.load_state_dict(to_device(saved["loop"], args.device))
    torch.set_rng_state(saved["rng"])
    set_cuda_rng(saved["cuda_rng"], args.device)
    trainer.resumed = True
    step, out = trainer.state.update_steps, args.output_dir
    if not cut_logs:  # another process of this run writes the logs
        return
    # training_losses lines carry the steps finished *before* their micro-step; the others, their step.
    cut_log(os.path.join(out, LOG_FILES[0]), lambda line: int(line.split(",")[0]) < step)
    cut_log(os.path.join(out, LOG_FILES[1]), lambda line: int(line.split(",")[0]) <= step)
    for name in LOG_FILES[2:]:
        cut_log(os.path.join(out, name), lambda line: json.loads(line)["step"] <= step)
    trainer.history = read_jsonl(os.path.join(out, LOG_FILES[2]))
    accuracies = read_step_log(os.path.join(out, LOG_FILES[1]))  # the progress bar shows the last one
    trainer.last_accuracy = accuracies[max(accuracies)] if accuracies else float("nan")


def read_trainer_state(checkpoint, world):
    """The checkpoint's trainer state, in CPU memory. Under --fsdp rank 0 alone reads the file, whose optimizer
    states are whole (twice the weights' bytes), and sends the rest (loop states, RNG, scheduler, step settings)
    to the other ranks, whose "optimizer" is None: FsdpWorld.load_optimizer_state sends them their shards. A file
    that does not load raises on rank 0; the others exit (World.on_rank_0)."""
    path = os.path.join(checkpoint, TRAINER_STATE)
    if not world.fsdp:
        return torch.load(path, map_location="cpu", weights_only=True)
    full = {}

    def read():
        full.update(torch.load(path, map_location="cpu", weights_only=True))
        return {key: value for key, value in full.items() if key != "optimizer"}

    return world.on_rank_0(read) | {"optimizer": full.get("optimizer")}


def other_step_size(saved_args, processes, args, size):
    """'' when a run of `size` processes with args takes the step a checkpoint's run took (saved_args over
    `processes` processes): as many micro-batches over all processes. Else what differs, and the settings that
    resume it."""
    before, now = saved_args.get("gradient_accumulation_steps", 1), args.gradient_accumulation_steps
    if before * processes == now * size:
        return ""
    fixes = [f"--gradient_accumulation_steps={before * processes // size}"] if before * processes % size == 0 else []
    if processes != size:  # or as it ran
        fixes.append(f"{run_command(processes)} --gradient_accumulation_steps={before}")
    return (
        f"its steps were {before} micro-batches on each of {processes} process(es), this run's {now} on each of "
        f"{size}: resume with {' or with '.join(fixes)}"
    )


def save_run_checkpoint(trainer):
    """save_checkpoint, under any number of processes (trainer.world): rank 0 writes it, with every rank's loop
    state and RNG in the loop state's "ranks"; --fsdp gathers the full model and optimizer states first (every
    rank takes part). Returns its path on every rank."""
    world = trainer.world
    if world.size == 1 and not world.fsdp:  # (--fsdp in one process: its states are gathered all the same)
        return save_checkpoint(trainer)
    model_state = world.full_model_state(trainer.model)  # --fsdp: gathered to rank 0; else None (the model's own)
    optimizer_state = world.full_optimizer_state(trainer.model, trainer.optimizer)
    cuda_rng = torch.cuda.get_rng_state() if world.device == "cuda" else None
    everyone = world.gather({"loop": trainer.state.state_dict(), "rng": torch.get_rng_state(), "cuda_rng": cuda_rng})
    path = None
    if world.is_main:
        trainer.state.ranks = everyone
        try:
            path = save_checkpoint(trainer, model_state, optimizer_state)
        finally:
            del trainer.state.ranks
    return world.from_rank_0(path)  # also keeps the others from going on before the checkpoint exists


def resume_run(trainer, checkpoint):
    """resume, under any number of processes (trainer.world): every rank resumes the checkpoint, then its own loop
    state and RNG, regrouped when another number of processes wrote it (distributed.regrouped). Rank 0 alone cuts
    the logs back, first; the others wait for it (under --fsdp they take their shards from it, then wait)."""
    world = trainer.world
    if not world.is_main and not world.fsdp:  # --fsdp: loading the shards is collective, all ranks at once
        world.from_rank_0(None)
    try:
        resume(trainer, checkpoint, cut_logs=world.is_main)
    finally:
        if world.is_main or world.fsdp:
            world.from_rank_0(None)
    saved = vars(trainer.state).pop("ranks", None)  # each writing rank's loop state and RNG (several processes)
    if saved is None and world.size == 1:  # one process resumes its own checkpoint: resume restored it all
        return
    saved = saved or [{"loop": trainer.state.state_dict(), "rng": torch.get_rng_state(), "cuda_rng": None}]
    mine = distributed.regrouped(saved, world.rank, world.size, trainer.args.steps_per_generation)
    trainer.state.load_state_dict(mine["loop"])
    if mine["rng"] is None:  # a rank the writing run did not have: its own seed's stream, as a fresh run's rank
        torch.manual_seed(trainer.args.seed + world.rank)
    else:
        torch.set_rng_state(mine["rng"].cpu())
    set_cuda_rng(mine["cuda_rng"], trainer.args.device)


def set_cuda_rng(state, device):
    """The RNG state of the run's GPU (device: "cuda" is the current one), as the checkpoint saved it; None: a CPU
    run's. A checkpoint written before holds a list, every visible GPU's: this device's entry is taken, so that a
    resume with fewer visible GPUs (another node, another CUDA_VISIBLE_DEVICES) does not fail."""
    if not (device.startswith("cuda") and torch.cuda.is_available()) or state is None:
        return
    if isinstance(state, list):
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        state = state[index] if index < len(state) else None
    if state is not None:
        torch.cuda.set_rng_state(state.cpu(), device)


def cut_log(path, keep):
    """Rewrite a log keeping the lines for which keep(line) holds (atomically: tmp file + rename). A line
    that does not parse, the last one of a run that died mid-write, is dropped. A failed write (a full disk:
    WriteFailed) or an interruption leaves the log as it was and no tmp file."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        with contextlib.suppress(ValueError, IndexError):
            if keep(line):
                kept.append(line if line.endswith("\n") else line + "\n")
    try:
        with writing("the log cut back to the checkpoint's step", path + ".tmp", f"; {path} is as it was"):
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.writelines(kept)
            os.replace(path + ".tmp", path)
    except BaseException:  # a full disk, Ctrl-C
        with contextlib.suppress(FileNotFoundError):
            os.remove(path + ".tmp")
        raise


def find_checkpoints(output_dir, end=""):
    """The step numbers of output_dir/checkpoint_N folders (end: of checkpoint_N{end}, e.g. the TMP ones)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    stems = [name.removesuffix(end) for name in names if name.startswith("checkpoint_") and name.endswith(end)]
    return [int(stem[11:]) for stem in stems if stem[11:].isdigit()]


def find_checkpoint(resume, output_dir):
    """--resume=output/checkpoint_N; --resume=latest: the newest one in output_dir; --resume=auto (verl's
    resume_mode auto, for launch scripts that restart): the newest intact one, or None when output_dir holds no
    checkpoint (a fresh run). One that does not read back is refused naming its damaged file and the newest
    intact checkpoint."""
    if resume == "auto":
        if not find_checkpoints(output_dir):
            return None
        intact = newest_intact_checkpoint(output_dir)
        newest = checkpoint_path(output_dir, max(find_checkpoints(output_dir)))
        if intact and intact != newest:  # a newer one that does not read back: say so, resume the intact one
            print(f"{checkpoint_damage(newest)}: resuming {intact}, the newest intact checkpoint")
        if intact:
            return os.path.normpath(intact)
        resume = "latest"  # none reads back: refused below, naming the newest one's damage
    if resume == "latest":
        if not find_checkpoints(output_dir):
            found, problem = subfolders(output_dir, find_checkpoints), f"no checkpoint to resume in {output_dir!r}"
            if found:  # e.g. the demo's, in ./output/demo
                raise ValueError(f"{problem}; {in_words(found)} some: add --output_dir={found[0]}")
            raise ValueError(f"{problem}: start a new run without --resume")
        resume = checkpoint_path(output_dir, max(find_checkpoints(output_dir)))
    resume = os.path.normpath(resume)
    if not os.path.isfile(os.path.join(resume, ARGS_FILE)):
        raise ValueError(f"{resume!r} is not a checkpoint folder (no {ARGS_FILE} in it)")
    damage = checkpoint_damage(resume)
    if damage.startswith(os.path.join(resume, ARGS_FILE)):  # not JSON: a hand edit that went wrong?
        raise ValueError(f"{damage}: correct it")
    if damage:
        raise ValueError(f"{damage}; {intact_checkpoint(os.path.dirname(resume) or '.')}")
    return resume


def checkpoint_damage(folder, needs=(ARGS_FILE, TRAINER_STATE), checksums=True):
    """'' when a checkpoint reads back, else its first missing or damaged file in words (needs: the files besides
    the weights; () for a model folder). Cheap, no tensor loaded: each weights file's safetensors header, whose
    offsets must cover the file's size; the trainer state's zip index (torch.save writes a zip whose index is at
    its end); the arguments' JSON. With checksums, also the sha256 in checksums.json of each of these files but
    the arguments (a flipped bit)."""
    weights = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors")) or ["model.safetensors"]
    for name in [*weights, *needs]:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            newest = " (only the newest checkpoint keeps one)" if name == TRAINER_STATE else ""
            return f"{path} is missing{newest}"
        try:
            if name.endswith(".safetensors"):
                safetensors.safe_open(path, "pt").keys()
            elif name == TRAINER_STATE:
                zipfile.ZipFile(path).close()
            else:
                with open(path, encoding="utf-8") as f:
                    json.load(f)
        except Exception as error:  # noqa: BLE001 - SafetensorError, BadZipFile, JSONDecodeError, OSError
            return f"{path} is damaged ({error})"
    return checksum_damage(folder, [*weights, *needs]) if checksums else ""


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder):
    """folder/checksums.json: the sha256 of each file in folder but the arguments (the file a user may edit)."""
    names = sorted(name for name in os.listdir(folder) if name not in (CHECKSUMS, ARGS_FILE))
    with open(os.path.join(folder, CHECKSUMS), "w", encoding="utf-8") as f:
        json.dump({name: file_sha256(os.path.join(folder, name)) for name in names}, f, indent=2)


def checksum_damage(folder, names):
    """'' when each of names that checksums.json lists (an older checkpoint's trainer state is gone on purpose; the
    arguments are not checked, though a checkpoint of an earlier version lists them) has its sha256; a checkpoint
    written before checksums has none to check."""
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(path):
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            expected = dict(json.load(f))
    except (OSError, ValueError, TypeError) as error:
        return f"{path} is damaged ({error})"
    for name in [name for name in names if name in expected and name != ARGS_FILE]:
        file = os.path.join(folder, name)
        if file_sha256(file) != expected[name]:
            return f"{file} is damaged (its sha256 is not the one in {CHECKSUMS}: changed since it was written)"
    return ""


def newest_intact_checkpoint(output_dir):
    """The newest checkpoint_N of output_dir that reads back (checkpoint_damage), or None."""
    for step in sorted(find_checkpoints(output_dir), reverse=True):
        if not checkpoint_damage(checkpoint_path(output_dir, step)):
            return checkpoint_path(output_dir, step)
    return None


def intact_checkpoint(output_dir):
    """What to use after a damaged checkpoint: the newest checkpoint that resumes (--resume), and, when newer
    weights read back (a checkpoint whose trainer state alone is hurt), those to start a new run from
    (--model_path)."""
    steps = sorted(find_checkpoints(output_dir), reverse=True)
    intact = lambda step, needs: not checkpoint_damage(checkpoint_path(output_dir, step), needs)  # noqa: E731
    weights = next((step for step in steps if intact(step, ())), None)
    if weights is None:
        return "no intact checkpoint is left: start a new run"
    resumable = next((step for step in steps if intact(step, (ARGS_FILE, TRAINER_STATE))), None)
    start = (
        f"start a new run from the weights of checkpoint_{weights}: --model_path={checkpoint_path(output_dir, weights)}"
    )
    if resumable is None:
        return f"no intact checkpoint keeps a trainer state; {start}"
    newest = f"the newest intact checkpoint: --resume={checkpoint_path(output_dir, resumable)}"
    return newest if resumable == weights else f"{start}; or continue from {newest}"


# ---- the final model, signals ----
def save_final_model(model, tokenizer, output_dir, state_dict=None, merge_lora=False, step=None):
    """The finished run's model and tokenizer in output_dir, atomically: written to output_dir/final_model.tmp,
    then moved in with Ctrl-C, SIGTERM and SIGHUP held back for the moves (milliseconds), and only then are the
    weights files of an earlier model that the new one does not have removed. A failure (a full disk: WriteFailed,
    saying whether a checkpoint holds this run's weights of `step`, the step it reached) or a stop signal
    (Interrupted) while writing leaves output_dir's earlier files as they were. With LoRA the model is the
    adapter folder and, with merge_lora, output_dir/merged the base with the adapters merged in, a model that
    from_pretrained loads alone."""
    tmp, intact = os.path.join(output_dir, "final_model.tmp"), f"; {output_dir} keeps its earlier files"
    newest = newest_checkpoint(output_dir)
    if newest is None:
        lost = "; no checkpoint holds this run's weights: they are lost"
    else:
        lost = f"; the weights of step {step} are in no checkpoint" if step not in (None, newest) else ""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing("the final model to", tmp, intact + lost), stop_signals_raise(FINAL_SAVE + intact + lost):
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            if merge_lora:
                from dapo_utils.lora import MERGED_DIR, save_merged

                save_merged(model, tokenizer, os.path.join(tmp, MERGED_DIR))
    except BaseException:  # a full disk, Ctrl-C, SIGTERM: nothing in output_dir has changed
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        new = set(os.listdir(tmp))
        for name in sorted(new):
            if os.path.isdir(os.path.join(output_dir, name)):  # an earlier merged/ model: os.replace needs it gone
                shutil.rmtree(os.path.join(output_dir, name))
            os.replace(os.path.join(tmp, name), os.path.join(output_dir, name))
        for name in os.listdir(output_dir):  # an earlier model's other shards: the new index does not name them
            if name.startswith("model") and name.endswith((".safetensors", ".index.json")) and name not in new:
                os.remove(os.path.join(output_dir, name))
        os.rmdir(tmp)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def newest_checkpoint(output_dir):
    """The step of the newest checkpoint in output_dir that reads back (header checks: milliseconds), None when
    none does. Checkpoints are renamed into place whole, so this is the one to resume."""
    steps = sorted(find_checkpoints(output_dir), reverse=True)
    return next((s for s in steps if not checkpoint_damage(checkpoint_path(output_dir, s), checksums=False)), None)


def resume_advice(output_dir, fix, launcher, start):
    """After a run stopped: the newest checkpoint that resumes and the command that continues from it once `fix`
    (e.g. "free space") is done, or that there is none and `start`, the command that starts the run again."""
    then, newest = f"{fix}, then " if fix else "", newest_checkpoint(output_dir)
    if newest is None:
        return f"there is no checkpoint to resume: {then}start the run again with {start}"
    command = f"{launcher} --resume={checkpoint_path(output_dir, newest)}"
    return f"the newest checkpoint is checkpoint_{newest} (step {newest}): {then}continue with {command}"


STARTING = "while starting"  # Interrupted's phase before training: nothing trained, nothing to resume
FINAL_SAVE = "while writing the final model"
AT_ONCE = "again, at once, without a checkpoint of this step"  # deferred_interrupts' second signal


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, SIGTERM or SIGHUP (signum), raised where the program stands so that the clean-up of each block it
    leaves runs (the lock, temporary folders). phase: what the run was doing, in words (STARTING, FINAL_SAVE, ...):
    launch.main's one line says it."""

    def __init__(self, signum, phase):
        super().__init__(signum, phase)
        self.signum, self.phase = signum, phase

    @property
    def name(self):
        return signal_name(self.signum)


def signal_name(signum):
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


@contextlib.contextmanager
def stop_signals_raise(phase):
    """In the block, Ctrl-C, SIGTERM and SIGHUP raise Interrupted(signum, phase), as Ctrl-C raises KeyboardInterrupt,
    so that every clean-up on the way out runs: without it SIGTERM and SIGHUP end the process at once."""

    def interrupt(signum, frame):
        raise Interrupted(signum, phase)

    with stop_signal_handler(interrupt):
        yield


@contextlib.contextmanager
def stop_signal_handler(handler):
    """handler for Ctrl-C, SIGTERM and SIGHUP in the block, the previous handlers back after it. A SIGHUP that is
    ignored (nohup: the run is to outlive its terminal) stays ignored. Nothing outside the main thread, which alone
    gets signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ignored = {signal.SIGHUP} if signal.getsignal(signal.SIGHUP) == signal.SIG_IGN else set()
    previous = {number: signal.signal(number, handler) for number in STOP_SIGNALS if number not in ignored}
    try:
        yield
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def say(line):
    """Print a line above the progress bar; a terminal that is gone (SIGHUP: a closed ssh session) is no error."""
    with contextlib.suppress(OSError):
        tqdm.write(line)


@contextlib.contextmanager
def deferred_interrupts(trainer):
    """First Ctrl-C, SIGTERM or SIGHUP: the trainer finishes its optimizer step (or its sampling round, its
    checkpoint write, its evaluation's batch), saves the checkpoint of its last finished step and stops (it reads
    trainer.stop_requested at each step end, between sampling rounds and before each evaluation batch).
    A second Ctrl-C: stop at once (Interrupted, phase AT_ONCE). A second SIGTERM or SIGHUP changes nothing: a
    scheduler's comes twice (SLURM signals every process of the job, and torchrun passes its own on to its
    workers), and its SIGKILL ends the grace."""

    def request_stop(signum, frame):
        if trainer.stop_requested:
            if signum == signal.SIGINT:
                raise Interrupted(signum, AT_ONCE)
            return
        trainer.stop_requested = True
        name = signal_name(signum)
        say(f"{name}: stopping with a checkpoint of the last finished step (Ctrl-C again: stop now, no checkpoint)")

    with stop_signal_handler(request_stop):
        yield


def stop_if_requested(trainer, metrics, saved=None):
    """After Ctrl-C or SIGTERM on any rank (deferred_interrupts): a checkpoint of where the trainer's loop is (saved:
    one just written of it), with the step's metrics so far (trainer.state.metrics, for the resumed run), the command
    that resumes it (trainer.command: its interpreter, launcher and mode); then KeyboardInterrupt."""
    if trainer.world.any(trainer.stop_requested):
        trainer.state.metrics = dict(metrics)
        path = saved or save_run_checkpoint(trainer)
        if trainer.world.is_main:  # one line for the job, not one per rank
            say(f"stopped; continue with: {trainer.command} --resume={path}")
        raise KeyboardInterrupt
