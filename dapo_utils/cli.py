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
import sys
import time
import typing

import torch

from dapo_utils.checkpoints import (
    ADAPTER_CONFIG,
    checkpoint_arguments,
    checkpoint_damage,
    checkpoint_path,
    find_checkpoint,
    find_checkpoints,
)
from dapo_utils.data import load_split
from dapo_utils.options import Field, print_help, python_command, sections_of
from dapo_utils.options import parser as options_parser


DEBUG = "DAPO_DEBUG"  # the environment variable that does what --debug does


def debugging(cli):
    """--debug, or DAPO_DEBUG set to anything but 0: errors keep their traceback."""
    return cli.debug or os.environ.get(DEBUG, "0") not in ("", "0")


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
    launched = "WORLD_SIZE" in os.environ  # by torchrun or accelerate launch, of any number of processes
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
            not args.fsdp or launched,
            "fsdp shards over the processes torchrun starts: torchrun --nproc_per_node=N train.py --fsdp=true",
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


def parse_cli(arguments_class, argv=None):
    """Returns (namespace with the modes (--demo, --eval_only, ...), `started`, the command's start for its wall
    time, and `argv`, the arguments as given; {field: value} of the fields given).

    Fields that are not given stay out of the overrides, so that presets and checkpoints can fill them. --help
    (options.print_help) shows the modes first, then the fields in the sections of arguments_class's source.
    """
    script = inspect.getsourcefile(arguments_class)
    given_argv = list(sys.argv[1:] if argv is None else argv)  # as typed: dapo_args.json records it
    argv = list(given_argv)
    if {"-h", "--help"} & set(argv):  # the one text that `python train.py --help` prints before torch loads
        print_help(script)
        sys.exit(0)
    fields = [Field(f.name, f.type, f.metadata["help"], f.default) for f in dataclasses.fields(arguments_class)]
    parser = options_parser(fields, sections_of(inspect.getsource(arguments_class), [f.name for f in fields]))
    for i, token in enumerate(argv):
        name, equals, value = token.partition("=")
        if name.startswith("--") and "-" in name[2:]:  # --max-steps: --max_steps
            argv[i] = token = "--" + name[2:].replace("-", "_") + equals + value
        if token.startswith("--reward_weights="):  # `--reward_weights=1,0.5` -> `--reward_weights 1 0.5`
            argv[i : i + 1] = ["--reward_weights", *value.split(",")]
    if any(token.split("=")[0] == "--vllm_tensor_parallel_size" for token in argv):  # TRL's name, not offered here
        parser.error(
            "vllm_tensor_parallel_size is not offered: each process's vLLM engine holds the whole model on its "
            "own GPU (one engine per rank, tensor parallel size 1); to shard training use --fsdp=true"
        )
    unset = argparse.Namespace(started=time.perf_counter(), argv=given_argv)
    vars(unset).update(dict.fromkeys([f.name for f in fields], dataclasses.MISSING))
    namespace = parser.parse_args(argv, namespace=unset)
    if namespace.compare and not namespace.eval_only:
        parser.error("--compare=MODEL compares two models without training: add --eval_only")
    flags, ladder = {token.split("=")[0] for token in argv}, {"--seeds", "--variants", "--jobs"}
    if flags & ladder and not namespace.ablation:
        parser.error(f"{min(flags & ladder)} sets up the ablation ladder: add --ablation")
    clash = flags & {"--resume", "--eval_only", "--compare", "--plot", "--check_rewards", "--preset", "--seed"}
    if clash and namespace.ablation:
        parser.error(f"--ablation runs each rung's preset with each of --seeds: it takes no {min(clash)}")
    given = {f.name: getattr(namespace, f.name) for f in fields}
    return namespace, {name: value for name, value in given.items() if value is not dataclasses.MISSING}


def command_settings(cli, given):
    """What was given on the command line, over the demo's settings (--demo): a run's settings but a checkpoint's."""
    if not cli.demo:
        return dict(given)
    from dapo_utils.tiny_world import DEMO_ARGS  # --preset paper too: the same world and steps

    return DEMO_ARGS | given


def run_settings(cli, given, arguments_class, world):
    """(overrides, checkpoint or None): what was given on the command line, over the checkpoint's settings
    (--resume; under torchrun rank 0 picks the checkpoint and reads its settings, and every rank follows: world),
    over the demo's (--demo). --resume=auto with no checkpoint in output_dir: none, a fresh run."""
    settings = command_settings(cli, given)
    if not cli.resume:
        return settings, None
    output_dir = settings.get("output_dir", arguments_class.output_dir)

    def resumed():
        checkpoint = find_checkpoint(cli.resume, output_dir)
        return checkpoint, checkpoint_arguments(checkpoint, arguments_class) if checkpoint else {}

    checkpoint, saved = world.on_rank_0(resumed)
    return {**settings, **saved, **given}, checkpoint


SEED_MODEL = ("./Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "--model", "about 3 GB")  # default path, repo
SEED_DATA = ("./gsm8k_chinese", "swulling/gsm8k_chinese", "--dataset", "5 MB; 7,473 train and 1,319 test rows")


def download_help(path, seed_thing, flag):
    """How to get what path should hold: at the default path, its download commands (`hf`, ModelScope); elsewhere,
    where the seed's one comes from and to point flag at one that exists."""
    default, repo, kind, size = seed_thing
    hub_kind = " --repo-type dataset" if kind == "--dataset" else ""
    commands = (
        f"  hf download {repo}{hub_kind} --local-dir {path}\n  modelscope download {kind} {repo} --local_dir {path}\n"
    )
    if os.path.normpath(path) == os.path.normpath(default):
        return f"Download it ({size}; `hf` comes with huggingface_hub), or point {flag} at a copy:\n{commands}"
    return f"Point {flag} at an existing one (the seed's is {repo}: `hf download {repo}{hub_kind} --local-dir {default}`).\n"


def check_before_loading(args, num_reward_funcs):
    """The model and data folders exist and reward_weights fit the reward functions; else exit with one line
    naming what is missing (only that) and how to get it."""
    missing = [
        (what, path, seed_thing, flag)
        for what, path, seed_thing, flag in (
            ("model folder", args.model_path, SEED_MODEL, "--model_path"),
            ("data set folder", args.data_path, SEED_DATA, "--data_path"),
        )
        if not os.path.exists(path)
    ]
    if missing:
        lines = [
            f"error: {what} {path!r} not found. " + download_help(path, seed, flag)
            for what, path, seed, flag in missing
        ]
        sys.exit("".join(lines) + f"To see the trainer work without any download: {python_command()} --demo")
    if os.path.isdir(args.model_path) and not os.path.isfile(os.path.join(args.model_path, "config.json")):
        sys.exit(
            f"error: model folder {args.model_path!r} has no config.json (an interrupted download?) "
            + download_help(args.model_path, SEED_MODEL, "--model_path")
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
