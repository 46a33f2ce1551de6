"""Models and checkpoints: load a policy (folder or .gguf); save, find, check (sha256 of each file) and load
checkpoints that resume a run exactly, cutting the logs back to the checkpoint's step; the final model saved
atomically; writes that fail (a full disk) in one line; Ctrl-C and SIGTERM that stop with a checkpoint."""

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

from dapo_utils.curves import in_words, read_jsonl, read_step_log, subfolders
from dapo_utils.writes import WRITE_ERRORS, WriteFailed, why, writing

TRAINER_STATE = "trainer_state.pt"  # in the newest checkpoint: optimizer, scheduler, loop state, RNG
ARGS_FILE = "dapo_args.json"  # in each checkpoint: the DapoArguments used
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C; SIGTERM: what SLURM and Kubernetes send before a kill
CHECKSUMS = "checksums.json"  # in each checkpoint: {file: sha256}, checked on resume (a flipped bit reads back)
# in output_dir
LOG_FILES = ("training_losses.txt", "accuracy_losses.txt", "metrics.jsonl", "samples.jsonl", "evaluations.jsonl")
# What one optimizer step is made of: changing one of these on resume would silently change the run.
STEP_SETTINGS = ("num_generations", "batch_size", "gradient_accumulation_steps", "steps_per_generation")
STEP_SETTINGS += ("num_iterations", "loss_agg_mode", "filter_metric", "seed", "use_vllm")
STEP_SETTINGS += ("scale_rewards", "importance_sampling_level")  # the advantages buffered, the ratio of the loss
STEP_SETTINGS += ("lora_r", "lora_alpha", "lora_target_modules")  # the adapters' shapes and scale
ADAPTER_CONFIG = "adapter_config.json"  # peft's: the folder holds LoRA adapters (lora.py), not a whole model


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

    Written at a step end to checkpoint_N.tmp with the sha256 of each file, read back (checkpoint_damage) and
    renamed into place, so a crash (or a full disk: one line, WriteFailed) never leaves a complete-looking half
    checkpoint. Only then do older checkpoints drop their trainer state (keeping weights and tokenizer): one
    intact resumable checkpoint always exists.
    model_state, optimizer_state: the full states when the trainer's are sharded (--fsdp; see
    save_run_checkpoint); None = the model's and optimizer's own.
    """
    args, step = trainer.args, trainer.state.update_steps
    final = checkpoint_path(args.output_dir, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        trainer.model.save_pretrained(tmp, state_dict=model_state)
        trainer.tokenizer.save_pretrained(tmp)
        cuda_rng = torch.cuda.get_rng_state_all() if args.device.startswith("cuda") else []
        optimizer_state = trainer.optimizer.state_dict() if optimizer_state is None else optimizer_state
        state = {"optimizer": optimizer_state, "scheduler": trainer.scheduler.state_dict()}
        state.update(loop=trainer.state.state_dict(), rng=torch.get_rng_state(), cuda_rng=cuda_rng)
        torch.save(state, os.path.join(tmp, TRAINER_STATE))
        # Absolute paths: a resumed run may start in another working directory.
        saved_args = dataclasses.asdict(args) | {
            k: os.path.abspath(getattr(args, k)) for k in ("model_path", "data_path")
        }
        with open(os.path.join(tmp, ARGS_FILE), "w", encoding="utf-8") as f:
            json.dump(saved_args, f, indent=2)
        write_checksums(tmp)
        damage = checkpoint_damage(tmp, checksums=False)  # read back before any older trainer state goes
        if damage:
            raise OSError(damage)
    except (*WRITE_ERRORS, KeyboardInterrupt) as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, KeyboardInterrupt):  # a second Ctrl-C while writing: no half checkpoint stays
            raise
        previous = [s for s in find_checkpoints(args.output_dir) if s != step]
        intact = f"checkpoint_{max(previous)} is intact" if previous else "no earlier checkpoint exists"
        raise WriteFailed(f"could not write checkpoint_{step} (disk full?): {why(error)}; {intact}") from error
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    # Only the newest checkpoint keeps the trainer state (a 1.5B model's Adam states are 12 GB).
    older = sorted(s for s in find_checkpoints(args.output_dir) if s != step)
    for old in older:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(checkpoint_path(args.output_dir, old), TRAINER_STATE))
    for old in older[: max(0, len(older) + 1 - args.save_total_limit)] if args.save_total_limit else []:
        shutil.rmtree(checkpoint_path(args.output_dir, old))
    return final


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
    return saved | {"output_dir": os.path.dirname(os.path.abspath(checkpoint))}


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
    field is refused. Only then are the logs cut back to the checkpoint's step, so that no line repeats."""
    args = trainer.args
    with open(os.path.join(checkpoint, ARGS_FILE), encoding="utf-8") as f:
        saved_args = json.load(f)
    changed = [
        f"{k} ({saved_args.get(k)!r} -> {getattr(args, k)!r})"
        for k in STEP_SETTINGS
        if saved_args.get(k, getattr(type(args), k)) != getattr(args, k)  # a field newer than the checkpoint: default
    ]
    if changed:
        raise ValueError(f"cannot resume {checkpoint} with other step settings: {', '.join(changed)}; start a new run")
    world = trainer.world  # --fsdp: full states in CPU memory, each rank keeps its shard
    device = "cpu" if world.fsdp else args.device
    saved = torch.load(os.path.join(checkpoint, TRAINER_STATE), map_location=device, weights_only=True)
    if args.lora_r:  # the adapters; the frozen base is model_path's
        from dapo_utils.lora import load_adapters

        load_adapters(trainer.model, checkpoint)
    else:
        weights = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()
        world.load_model_state(trainer.model, weights)
    settings = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
    world.load_optimizer_state(trainer.model, trainer.optimizer, saved["optimizer"])
    trainer.scheduler.load_state_dict(saved["scheduler"])
    trainer.scheduler.base_lrs = [args.lr] * len(settings)
    for group, setting in zip(trainer.optimizer.param_groups, settings):  # this run's settings, not the saved ones
        group.update(setting, lr=args.lr * trainer.scheduler.lr_lambdas[0](trainer.scheduler.last_epoch))
    trainer.state.load_state_dict(saved["loop"])
    torch.set_rng_state(saved["rng"].cpu())
    if saved["cuda_rng"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in saved["cuda_rng"]])
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


def save_run_checkpoint(trainer):
    """save_checkpoint, under any number of processes (trainer.world): rank 0 writes it, with every rank's loop
    state and RNG in the loop state's "ranks"; --fsdp gathers the full model and optimizer states first (every
    rank takes part). Returns its path on every rank."""
    world = trainer.world
    if world.size == 1:
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
    """resume, under any number of processes (trainer.world): every rank loads the checkpoint, then its own loop
    state and RNG. Rank 0 alone cuts the logs back, first; the others wait for it (under --fsdp they load
    with it, then wait)."""
    world = trainer.world
    if world.size == 1:
        return resume(trainer, checkpoint)
    if not world.is_main and not world.fsdp:  # --fsdp: loading the shards is collective, all ranks at once
        world.from_rank_0(None)
    try:
        resume(trainer, checkpoint, cut_logs=world.is_main)
    finally:
        if world.is_main or world.fsdp:
            world.from_rank_0(None)
    mine = trainer.state.ranks[world.rank]
    del trainer.state.ranks
    trainer.state.load_state_dict(mine["loop"])
    torch.set_rng_state(mine["rng"].cpu())
    if mine["cuda_rng"] is not None and world.device == "cuda":
        torch.cuda.set_rng_state(mine["cuda_rng"].cpu())


def cut_log(path, keep):
    """Rewrite a log keeping the lines for which keep(line) holds (atomically: tmp file + rename). A line
    that does not parse, the last one of a run that died mid-write, is dropped."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        with contextlib.suppress(ValueError, IndexError):
            if keep(line):
                kept.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def find_checkpoints(output_dir):
    """The step numbers of output_dir/checkpoint_N folders."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    return [int(name[11:]) for name in names if name.startswith("checkpoint_") and name[11:].isdigit()]


def find_checkpoint(resume, output_dir):
    """--resume=output/checkpoint_N, or --resume=latest: the newest one in output_dir. One that does not read
    back is refused naming its damaged file and the newest intact checkpoint."""
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
    if damage:
        raise ValueError(f"{damage}; {intact_checkpoint(os.path.dirname(resume) or '.')}")
    return resume


def checkpoint_damage(folder, needs=(ARGS_FILE, TRAINER_STATE), checksums=True):
    """'' when a checkpoint reads back, else its first missing or damaged file in words (needs: the files besides
    the weights; () for a model folder). Cheap, no tensor loaded: each weights file's safetensors header, whose
    offsets must cover the file's size; the trainer state's zip index (torch.save writes a zip whose index is at
    its end); the arguments' JSON. With checksums, also each file's sha256 in checksums.json (a flipped bit)."""
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
    return checksum_damage(folder) if checksums else ""


def file_sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder):
    """folder/checksums.json: the sha256 of each file in folder."""
    names = sorted(name for name in os.listdir(folder) if name != CHECKSUMS)
    with open(os.path.join(folder, CHECKSUMS), "w", encoding="utf-8") as f:
        json.dump({name: file_sha256(os.path.join(folder, name)) for name in names}, f, indent=2)


def checksum_damage(folder):
    """'' when each file that checksums.json lists and folder still holds has its sha256 (an older checkpoint's
    trainer state is gone on purpose; a checkpoint written before checksums has none to check)."""
    path = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(path):
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            expected = dict(json.load(f))
    except (OSError, ValueError, TypeError) as error:
        return f"{path} is damaged ({error})"
    for name, digest in expected.items():
        file = os.path.join(folder, name)
        if os.path.isfile(file) and file_sha256(file) != digest:
            return f"{file} is damaged (its sha256 is not the one in {CHECKSUMS}: changed since it was written)"
    return ""


def intact_checkpoint(output_dir):
    """What --resume can use after a damaged checkpoint: the newest one that reads back, else the newest
    weights that do (a new run can start from them)."""
    steps = sorted(find_checkpoints(output_dir), reverse=True)
    for step in steps:
        if not checkpoint_damage(checkpoint_path(output_dir, step)):
            return f"the newest intact checkpoint: --resume={checkpoint_path(output_dir, step)}"
    for step in steps:
        if not checkpoint_damage(checkpoint_path(output_dir, step), needs=(ARGS_FILE,)):
            weights = checkpoint_path(output_dir, step)
            return (
                f"no intact checkpoint keeps a trainer state; start a new run from its weights: --model_path={weights}"
            )
    return "no intact checkpoint is left: start a new run"


# ---- the final model, signals ----
def save_final_model(model, tokenizer, output_dir, state_dict=None, merge_lora=False):
    """The finished run's model and tokenizer in output_dir, atomically: written to output_dir/final_model.tmp,
    then moved in with Ctrl-C and SIGTERM held back for the moves (milliseconds), and only then are the weights
    files of an earlier model that the new one does not have removed. A failure (a full disk) or Ctrl-C while
    writing leaves output_dir's earlier files as they were. With LoRA the model is the adapter folder and, with
    merge_lora, output_dir/merged the base with the adapters merged in, a model that from_pretrained loads alone."""
    tmp, intact = os.path.join(output_dir, "final_model.tmp"), f"; {output_dir} keeps its earlier files"
    newest = find_checkpoints(output_dir)
    intact += f", and checkpoint_{max(newest)} this run's weights" if newest else ""
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing("the final model to", tmp, intact), sigterm_as_ctrl_c():
            model.save_pretrained(tmp, state_dict=state_dict)
            tokenizer.save_pretrained(tmp)
            if merge_lora:
                from dapo_utils.lora import MERGED_DIR, save_merged

                save_merged(model, tokenizer, os.path.join(tmp, MERGED_DIR))
    except BaseException as error:  # a full disk, Ctrl-C, SIGTERM: nothing in output_dir has changed
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, KeyboardInterrupt):
            print(f"stopped while writing the final model{intact}")
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


@contextlib.contextmanager
def sigterm_as_ctrl_c():
    """SIGTERM raises KeyboardInterrupt in the block, as Ctrl-C does, so that its clean-up runs."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def deferred_interrupts(trainer):
    """First Ctrl-C or SIGTERM: the trainer finishes its optimizer step (or its sampling round), saves a
    checkpoint and stops (it reads trainer.stop_requested at each step end and between sampling rounds).
    Second: stop at once."""

    def request_stop(signum, frame):
        if trainer.stop_requested:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        tqdm.write(f"{name}: stopping after this step with a checkpoint ({name} again: stop now, no checkpoint)")

    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    previous = {number: signal.signal(number, request_stop) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
