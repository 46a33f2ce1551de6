"""The command line of train.py: `--field=value` for every DapoArguments field, the settings a run starts from
(--demo, --resume), and the checks that run before a model loads (DapoArguments' values, input folders, the
data set's splits and columns, output_dir, reward weights), each failing with one line naming the problem and
its fix."""

import argparse
import dataclasses
import importlib.util
import inspect
import math
import os
import re
import sys
import time
import typing

import torch
from transformers import HfArgumentParser

from dapo_utils.checkpoints import (
    ADAPTER_CONFIG,
    checkpoint_arguments,
    checkpoint_damage,
    checkpoint_path,
    find_checkpoint,
    find_checkpoints,
)
from dapo_utils.data import load_split
from dapo_utils.presets import PRESETS
from dapo_utils.run_dir import LOCK_FILE


def check_arguments(args):
    """Reject bad DapoArguments up front, before anything loads, naming each field and the fix."""
    errors = []
    for field in dataclasses.fields(args):  # each field's rules, next to it in DapoArguments (arg's metadata)
        value, least = getattr(args, field.name), field.metadata.get("at_least")
        if least is not None and value < least:
            errors.append(f"{field.name} must be >= {least}" + (" (0 = off)" if least == 0 else ""))
        choices = typing.get_args(field.type) if typing.get_origin(field.type) is typing.Literal else None
        if choices and value not in choices:  # a Literal[...] field takes one of its values
            errors.append(f"{field.name} must be one of {choices}")
    values = dataclasses.asdict(args).items()
    errors += [f"{k} must be finite, not {v}" for k, v in values if isinstance(v, float) and not math.isfinite(v)]
    vllm = not args.use_vllm  # True: the use_vllm checks pass
    processes = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's
    tracker = args.report_to if args.report_to in ("tensorboard", "wandb", "trackio") else None  # a package
    checks = [
        (args.num_generations >= 2, "num_generations must be >= 2 (a group needs two responses to compare)"),
        (0 <= args.clip_eps_low < 1, "clip_eps_low must be in [0, 1)"),
        (0 <= args.clip_eps_high < 1, "clip_eps_high must be in [0, 1)"),
        (args.temperature > 0 and 0 < args.top_p <= 1, "temperature must be > 0 and top_p in (0, 1]"),
        (args.overlong_buffer_len < args.max_generate_length, "overlong_buffer_len must be < max_generate_length"),
        (not args.device.startswith("cuda") or torch.cuda.is_available(), "device is cuda but no GPU is visible"),
        (all(isinstance(w, (int, float)) for w in args.reward_weights or []), "reward_weights must be numbers"),
        (tracker is None or importlib.util.find_spec(tracker), f"report_to={tracker!r} needs: pip install {tracker}"),
        (vllm or importlib.util.find_spec("vllm"), "use_vllm needs vLLM: pip install -r requirements/vllm.txt"),
        (
            args.answer_checker != "math_verify" or importlib.util.find_spec("math_verify"),
            "answer_checker='math_verify' needs math-verify: pip install -r requirements/math.txt",
        ),
        (
            args.answer_format != "latex" or args.answer_checker == "math_verify",
            "answer_format='latex' needs answer_checker='math_verify' (the number checker reads \\frac{3}{4} as 4)",
        ),
        (vllm or not args.model_path.endswith(".gguf"), "use_vllm cannot load a .gguf model: convert it first"),
        (
            not args.lora_r or importlib.util.find_spec("peft"),
            "lora_r > 0 needs peft: pip install -r requirements/lora.txt",
        ),
        (args.lora_alpha > 0 and 0 <= args.lora_dropout < 1, "lora_alpha must be > 0 and lora_dropout in [0, 1)"),
        (not args.merge_lora or args.lora_r, "merge_lora merges LoRA adapters: it needs lora_r > 0"),
        (
            not args.vllm_sync_adapters or (args.lora_r and args.use_vllm),
            "vllm_sync_adapters needs lora_r and use_vllm",
        ),
        (not args.lora_r or not args.fsdp, "fsdp with lora_r > 0 is not supported: train the adapters without --fsdp"),
        (
            not args.fsdp or processes > 1,
            "fsdp shards over processes: torchrun --nproc_per_node=N train.py --fsdp=true",
        ),
        # vLLM's log-probs at T != 1 (processed_logprobs) are of the top-k/top-p-truncated distribution, pi_old's not
        (
            vllm or not args.score_with_temperature or args.temperature == 1 or (args.top_k == 0 and args.top_p == 1),
            "use_vllm with score_with_temperature and temperature != 1 needs top_k=0 and top_p=1",
        ),
    ]
    errors += [message for ok, message in checks if not ok]
    if errors:
        raise ValueError("invalid DapoArguments: " + "; ".join(errors))


def help_only(arguments_class):
    """arguments_class with only each field's help in its metadata: HfArgumentParser hands every metadata entry
    to argparse, and a field's rules beside it (at_least) are check_arguments', not argparse's."""
    fields = dataclasses.fields(arguments_class)
    helps = [
        (f.name, f.type, dataclasses.field(default=f.default, metadata={"help": f.metadata["help"]})) for f in fields
    ]
    return dataclasses.make_dataclass(arguments_class.__name__, helps)


def parse_cli(arguments_class, argv=None):
    """Returns (namespace with the modes (--demo, --eval_only, ...) and `started`, the command's start
    for its wall time, {field: value} of the fields given).

    Fields that are not given stay out of the overrides, so that presets and checkpoints can fill them. --help
    shows the modes first, then the fields in the sections of arguments_class (field_sections).
    """
    mode = (
        "[--demo | --eval_only [--compare=MODEL] | --resume=CHECKPOINT | --plot DIR... | --check_rewards | --ablation]"
    )
    usage = f"train.py {mode} [--preset=NAME] [--field=value ...]"
    parser = HfArgumentParser(None, usage=usage, description="DAPO training on GSM8K (Chinese).", allow_abbrev=False)
    modes = parser.add_argument_group("modes (none: train with the settings below)")
    modes.add_argument("--demo", action="store_true", help="train a tiny built-in world on CPU (no download)")
    modes.add_argument("--eval_only", action="store_true", help="evaluate model_path on the test split, no training")
    modes.add_argument("--compare", metavar="MODEL", help="with --eval_only: a second model, in a before/after table")
    modes.add_argument("--resume", metavar="CHECKPOINT", help="continue from output_dir/checkpoint_N, or 'latest'")
    modes.add_argument("--plot", metavar="DIR", nargs="+", help="draw DIR/curves.png; several DIRs: one overlay.png")
    modes.add_argument("--check_rewards", action="store_true", help="score each reference answer as a response, exit")
    modes.add_argument("--preset", choices=PRESETS, default="seed", help="named settings: docs/paper-options.md")
    modes.add_argument("--ablation", action="store_true", help="the paper's ladder, rung by rung: docs/ablation.md")
    modes.add_argument("--seeds", default="42,1,2", help="with --ablation: the seeds each rung runs with")
    modes.add_argument("--variants", action="store_true", help="with --ablation: also the GRPO family (dr_grpo, gspo)")
    modes.add_argument("--jobs", type=int, default=0, help="with --ablation: runs at a time (0: cores / num_threads)")
    modes.add_argument("--take_over_lock", action="store_true", help=f"take over {LOCK_FILE} of a run that has ended")
    fields = {f.name: f for f in dataclasses.fields(help_only(arguments_class))}
    for title, names in field_sections(arguments_class).items():
        group = parser.add_argument_group(title)
        for name in names:
            HfArgumentParser._parse_dataclass_field(group, fields[name])  # what HfArgumentParser(cls) does per field
    one_switch_per_bool(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, token in enumerate(argv):  # `--reward_weights=1,0.5` -> `--reward_weights 1 0.5`
        if token.startswith("--reward_weights="):
            argv[i : i + 1] = ["--reward_weights", *token.split("=", 1)[1].split(",")]
    if any(token.split("=")[0] == "--vllm_tensor_parallel_size" for token in argv):  # TRL's name, not offered here
        parser.error(
            "vllm_tensor_parallel_size is not offered: each process's vLLM engine holds the whole model on its "
            "own GPU (one engine per rank, tensor parallel size 1); to shard training use --fsdp=true"
        )
    unset = argparse.Namespace(started=time.perf_counter(), **dict.fromkeys(fields, dataclasses.MISSING))
    namespace = parser.parse_args(argv, namespace=unset)
    if namespace.compare and not namespace.eval_only:
        parser.error("--compare=MODEL compares two models without training: add --eval_only")
    flags, ladder = {token.split("=")[0] for token in argv}, {"--seeds", "--variants", "--jobs"}
    if flags & ladder and not namespace.ablation:
        parser.error(f"{min(flags & ladder)} sets up the ablation ladder: add --ablation")
    clash = flags & {"--resume", "--eval_only", "--compare", "--plot", "--check_rewards", "--preset", "--seed"}
    if clash and namespace.ablation:
        parser.error(f"--ablation runs each rung's preset with each of --seeds: it takes no {min(clash)}")
    given = {name: getattr(namespace, name) for name in fields}
    return namespace, {name: value for name, value in given.items() if value is not dataclasses.MISSING}


def field_sections(arguments_class):
    """{section: [field names]} in the order of arguments_class's source, a section per `# --- title ---` comment
    (a field before the first comment, or not found in the source: "settings")."""
    names, sections, title = {f.name for f in dataclasses.fields(arguments_class)}, {}, "settings"
    for line in inspect.getsource(arguments_class).splitlines():
        heading, field = re.fullmatch(r"\s*# --- (.+) ---", line), re.match(r"    (\w+): ", line)
        if heading:
            title = heading.group(1)
        elif field and field.group(1) in names:
            sections.setdefault(title, []).append(field.group(1))
            names.remove(field.group(1))
    if names:
        sections.setdefault("settings", []).extend(sorted(names))
    return sections


def one_switch_per_bool(parser):
    """--help shows `--bf16` and `--no_bf16` (HfArgumentParser adds --no_X for a bool field whose default is True)
    as one switch: the --no_X line goes, the --X line names it. Both still parse as before."""
    actions = {action.option_strings[0]: action for action in parser._actions if action.option_strings}
    for option, action in actions.items():
        if option.startswith("--no_") and f"--{action.dest}" in actions:
            actions[f"--{action.dest}"].help += f"; {option} = --{action.dest}=false"
            action.help = argparse.SUPPRESS


def run_settings(cli, given, arguments_class):
    """(overrides, checkpoint or None): what was given on the command line, over the checkpoint's settings
    (--resume), over the demo's (--demo)."""
    defaults, checkpoint = {}, None
    if cli.demo:
        from dapo_utils.tiny_world import DEMO_ARGS  # --preset paper too: the same world and steps

        defaults = dict(DEMO_ARGS)
    if cli.resume:
        output_dir = given.get("output_dir", defaults.get("output_dir", arguments_class.output_dir))
        checkpoint = find_checkpoint(cli.resume, output_dir)
        defaults |= checkpoint_arguments(checkpoint, arguments_class)
    return defaults | given, checkpoint


def download_help(args):
    return (
        "Download them first (about 3 GB and 5 MB; `hf` comes with huggingface_hub):\n"
        f"  hf download Qwen/Qwen2.5-1.5B-Instruct --local-dir {args.model_path}\n"
        f"  hf download swulling/gsm8k_chinese --repo-type dataset --local-dir {args.data_path}\n"
        "or from ModelScope:\n"
        f"  modelscope download --model Qwen/Qwen2.5-1.5B-Instruct --local_dir {args.model_path}\n"
        f"  modelscope download --dataset swulling/gsm8k_chinese --local_dir {args.data_path}\n"
        "(gsm8k_chinese has 7,473 train and 1,319 test rows.) Or point --model_path/--data_path at them.\n"
        "To see the trainer work without any download, run: python train.py --demo"
    )


def check_before_loading(args, num_reward_funcs):
    """The model and data folders exist and reward_weights fit the reward functions; else exit with one line
    naming the problem and its fix."""
    if not os.path.exists(args.model_path) or not os.path.exists(args.data_path):
        sys.exit(
            f"Model folder {args.model_path!r} or data set folder {args.data_path!r} not found.\n" + download_help(args)
        )
    if os.path.isdir(args.model_path) and not os.path.isfile(os.path.join(args.model_path, "config.json")):
        sys.exit(
            f"error: model folder {args.model_path!r} has no config.json (an interrupted download?)\n"
            + download_help(args)
        )
    if args.lora_r:  # the names, on the architecture built without its weights
        from dapo_utils.lora import model_skeleton, unmatched_targets

        unmatched = unmatched_targets(model_skeleton(args.model_path), args.lora_target_modules)
        if unmatched:
            sys.exit(
                f"error: lora_target_modules {unmatched} match no module of {args.model_path}: "
                "name its layers (q_proj,v_proj in Qwen2) or use all-linear"
            )
    if args.reward_weights is not None and len(args.reward_weights) != num_reward_funcs:
        sys.exit(
            f"error: reward_weights has {len(args.reward_weights)} entries for {num_reward_funcs} reward functions"
        )


def eval_model(path, flag):
    """What --eval_only loads for a model path: a .gguf file or a model folder (a checkpoint_N, a finished run's
    output_dir) as it is; a run's output_dir without a final model, its newest checkpoint. Else one line, exit."""
    folder_files = [os.path.join(path, name) for name in ("config.json", ADAPTER_CONFIG)]  # a model, LoRA adapters
    if (path.endswith(".gguf") and os.path.isfile(path)) or any(map(os.path.isfile, folder_files)):
        return path
    if find_checkpoints(path):
        return checkpoint_path(path, max(find_checkpoints(path)))
    sys.exit(
        f"error: {flag} {path!r} is not a model: give a model folder (with config.json), a LoRA adapter folder, a "
        ".gguf file, a checkpoint_N folder or the output_dir of a run"
    )


def check_eval_only(args, compare):
    """--eval_only's checks before anything loads, each exiting with one line: both models exist, read back
    (safetensors headers, checksums.json) and suit the sampler; the data set has a test split with rows and the
    columns; output_dir holds no earlier evaluation (or may overwrite it, as a run's folder). Returns the model paths to evaluate."""
    models = [eval_model(args.model_path, "--model_path")] + ([eval_model(compare, "--compare")] if compare else [])
    for flag, path in zip(("--model_path", "--compare"), models):
        if path.endswith(".gguf"):
            if args.use_vllm:
                sys.exit(f"error: {flag} {path!r}: use_vllm cannot load a .gguf model: convert it first")
            continue
        damage = checkpoint_damage(path, needs=()) if any(n.endswith(".safetensors") for n in os.listdir(path)) else ""
        if damage:
            sys.exit(f"error: {flag}: {damage}")
    results = os.path.join(args.output_dir, "eval_results.json")  # evaluation.run_eval writes it
    if os.path.exists(results) and not args.overwrite_output_dir:
        sys.exit(
            f"error: {results!r} holds an earlier evaluation: overwrite it with --overwrite_output_dir=true, "
            "or write this one to another --output_dir"
        )
    try:
        columns = (args.question_column, args.answer_column)  # 0: no test rows held out of train, the real test split
        load_split(args.data_path, "test", 0, columns, args.answer_format)
    except (FileNotFoundError, ValueError) as error:
        sys.exit(f"error: --eval_only evaluates on the test split: {error}")
    return models
