"""The command line of train.py: `--field=value` for every DapoArguments field, and the checks that can run
before a model loads (input folders, output_dir, reward weights), each failing with one line and its fix."""

import argparse
import dataclasses
import os
import sys

from transformers import HfArgumentParser


def parse_cli(arguments_class, argv=None):
    """Returns (namespace with --demo/--preset/--resume/--plot, {field: value} of the fields given).

    Fields that are not given stay out of the overrides, so that presets and checkpoints can fill them.
    """
    parser = HfArgumentParser(arguments_class, description="DAPO training on GSM8K (Chinese).", allow_abbrev=False)
    parser.add_argument("--demo", action="store_true", help="train a tiny built-in world on CPU (no download)")
    parser.add_argument("--preset", choices=["seed", "paper"], default="seed", help="seed's or the paper's settings")
    parser.add_argument("--resume", metavar="CHECKPOINT", help="continue from output_dir/checkpoint_N, or 'latest'")
    parser.add_argument("--plot", metavar="DIR", help="draw DIR/curves.png from an existing output folder, then exit")
    fields = [f.name for f in dataclasses.fields(arguments_class)]
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, token in enumerate(argv):  # `--reward_weights=1,0.5` -> `--reward_weights 1 0.5`
        if token.startswith("--reward_weights="):
            argv[i : i + 1] = ["--reward_weights", *token.split("=", 1)[1].split(",")]
    namespace = parser.parse_args(argv, namespace=argparse.Namespace(**dict.fromkeys(fields, dataclasses.MISSING)))
    given = {name: getattr(namespace, name) for name in fields}
    return namespace, {name: value for name, value in given.items() if value is not dataclasses.MISSING}


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


def check_before_loading(args, num_reward_funcs, checkpoints):
    """Exit with one line naming the problem and its fix. checkpoints: steps of output_dir's checkpoints
    that a fresh run would leave for --resume=latest to find (empty when resuming)."""
    if not os.path.exists(args.model_path) or not os.path.isdir(args.data_path):
        sys.exit(
            f"Model folder {args.model_path!r} or data set folder {args.data_path!r} not found.\n" + download_help(args)
        )
    if os.path.isdir(args.model_path) and not os.path.isfile(os.path.join(args.model_path, "config.json")):
        sys.exit(
            f"error: model folder {args.model_path!r} has no config.json (an interrupted download?)\n"
            + download_help(args)
        )
    if args.reward_weights is not None and len(args.reward_weights) != num_reward_funcs:
        sys.exit(
            f"error: reward_weights has {len(args.reward_weights)} entries for {num_reward_funcs} reward functions"
        )
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        probe = os.path.join(args.output_dir, ".write_test")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as error:
        sys.exit(
            f"error: cannot write to output_dir {args.output_dir!r} ({error.strerror}): choose another --output_dir"
        )
    if checkpoints:  # --resume=latest must never pick up another run's checkpoint
        sys.exit(
            f"error: {args.output_dir!r} holds checkpoints of an earlier run (checkpoint_{max(checkpoints)}): "
            "continue it with --resume=latest, or start this one in another --output_dir"
        )
