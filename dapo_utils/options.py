"""The options of `python train.py`: the modes, then one option per DapoArguments field, in the sections that the
class's `# --- title ---` comments make, and --help read from train.py's text rather than from the class, so that
it prints before torch loads (0.2 s, not the 5 s of importing train.py). It imports nothing heavy: train.py calls
print_help before its own imports.

    parser(fields, sections[, shown])   the argparse parser: one option per field, `--no_X` for a bool that is true
    source_fields(path)                 the fields, sections and defaults as train.py's text writes them
    print_help(path)                    --help from that text; cli.parse_cli sends --help here too (one text)
    python_command()                    the interpreter and script of this process, as a shell in the current folder
                                        runs them again (`.venv/bin/python train.py`): the commands a run prints
    run_command(processes, fsdp)        the same for a run of that many processes: torch's launcher run by this
                                        interpreter (`.venv/bin/python -m torch.distributed.run --nproc_per_node=2`)
"""

import argparse
import ast
import dataclasses
import os
import re
import shlex
import sys
import typing
from typing import List, Literal, Optional

from dapo_utils.presets import PRESETS

USAGE = (
    "train.py [--demo | --eval_only [--compare=MODEL] | --resume=CHECKPOINT | --plot DIR... | --check_rewards | "
    "--ablation] [--preset=NAME] [--field=value ...]"
)
# torchrun's processes per node, as torchrun set them when this process started: vLLM's CPU platform later sets
# LOCAL_WORLD_SIZE to its own tensor-parallel size in the process. None outside torchrun.
PER_NODE = os.environ.get("LOCAL_WORLD_SIZE") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
TRAIN_PY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")  # the root's
DESCRIPTION = "DAPO training on GSM8K (Chinese)."
EPILOG = (
    "Names in brackets say where an option and its value come from: the seed (the annotated DAPO notes that "
    "train.py reimplements), the paper (DAPO, arXiv 2503.14476, whose equations are numbered), verl (ByteDance's "
    "RL library and its DAPO recipe), TRL (Hugging Face's GRPOTrainer), peft (Hugging Face's LoRA library). A "
    "bool takes --X, --X=true or --X=false; --max-steps is read as --max_steps. The paper's symbols: G = "
    "num_generations (a group: G responses to one prompt), L_max = max_generate_length, L_cache = overlong_buffer_len; "
    "pi_old = the policy that sampled the responses, as the trainer computes it, pi_vLLM = the same as vLLM computes "
    "it. Every field and its source: docs/arguments.md."
)
MODES = "modes (none: train with the settings below)"
OPTIONS = [  # (section, flag, argparse keywords); a section named by a field: the section that holds that field
    (MODES, "--demo", dict(action="store_true", help="train a tiny built-in world on the CPU (no download)")),
    (MODES, "--eval_only", dict(action="store_true", help="evaluate model_path on the test split, no training")),
    (MODES, "--compare", dict(metavar="MODEL", help="with --eval_only: a second model, in a before/after table")),
    (
        MODES,
        "--resume",
        dict(
            metavar="CHECKPOINT",
            help="continue from output_dir/checkpoint_N, 'latest', or 'auto': the newest if any, else a fresh run",
        ),
    ),
    (MODES, "--plot", dict(metavar="DIR", nargs="+", help="draw DIR/curves.png; several DIRs: one overlay.png")),
    (MODES, "--check_rewards", dict(action="store_true", help="score each reference answer as a response, exit")),
    (MODES, "--ablation", dict(action="store_true", help="the paper's ladder, rung by rung: docs/ablation.md")),
    (MODES, "--seeds", dict(default="42,1,2", help="with --ablation: the seeds each rung runs with")),
    (MODES, "--variants", dict(action="store_true", help="with --ablation: also the GRPO family (dr_grpo, gspo)")),
    (MODES, "--jobs", dict(type=int, default=0, help="with --ablation: runs at a time (0: cores / num_threads)")),
    ("preset", "--preset", dict(choices=PRESETS, default="seed", help="named settings: docs/paper-options.md")),
    (
        "output_dir",
        "--take_over_lock",
        dict(action="store_true", help="take over output_dir's train.lock, left by a run that has ended"),
    ),
    (
        "report_to",
        "--debug",
        dict(action="store_true", help="errors end in their traceback, not one line (or DAPO_DEBUG=1)"),
    ),
]
TYPES = {"int": int, "float": float, "str": str, "bool": bool, "Optional": Optional, "List": List}


@dataclasses.dataclass
class Field:
    """One DapoArguments field as the command line sees it: kind is its type (Literal, Optional[List[float]], ...);
    default its value (a Computed one when the source computes it)."""

    name: str
    kind: typing.Any
    help: str
    default: typing.Any


@dataclasses.dataclass
class Computed:
    """A default that the source computes ("cuda" if torch.cuda.is_available() else "cpu"): its text, for --help."""

    text: str


def truth(text):
    """--bf16=false: true/false, yes/no, 1/0, in any case."""
    if text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a bool: write true or false")


def add_field(group, field):
    """The option of one field: `--name VALUE` (a Literal: its choices; a list: one or more values; a bool: `--name`,
    `--name=true|false`, and `--no_name` for one that is true by default, folded into --name's line)."""
    kind, help_text = field.kind, field.help
    if typing.get_origin(kind) is typing.Union:  # Optional[X]: X, None being the default
        kind = next(part for part in typing.get_args(kind) if part is not type(None))
    options = dict(help=help_text)
    if kind is bool:
        options.update(type=truth, nargs="?", const=True, metavar="true|false")
        if field.default is True:
            options["help"] += f"; --no_{field.name} = --{field.name}=false"
            group.add_argument(f"--no_{field.name}", action="store_false", dest=field.name, help=argparse.SUPPRESS)
    elif typing.get_origin(kind) is Literal:
        options.update(choices=list(typing.get_args(kind)), type=type(typing.get_args(kind)[0]))
    elif typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        options.update(type=item, nargs="+", metavar=item.__name__.upper())
    else:  # int, float, str; a type the source reader does not know: text
        kind = kind if kind in (int, float) else str
        options.update(type=kind, metavar=kind.__name__.upper())
    group.add_argument(f"--{field.name}", **options)


def parser(fields, sections, shown=None):
    """The parser of `python train.py`: the modes, then each section's fields (sections: {title: [names]}). shown:
    {name: default text} for --help (None: parsing only, no -h of its own: cli.parse_cli sends --help to
    print_help)."""
    result = argparse.ArgumentParser(
        "train.py", usage=USAGE, description=DESCRIPTION, epilog=EPILOG, add_help=False, allow_abbrev=False
    )
    if shown is not None:
        result.add_argument("-h", "--help", action="help", help="show this help and exit")
    groups = {title: result.add_argument_group(title) for title in (MODES, "preset", *sections)}
    by_name = {field.name: field for field in fields}
    for title, names in sections.items():
        for name in names:
            field = by_name[name]
            if shown is not None and name in shown:
                field = dataclasses.replace(field, help=f"{field.help} (default: {shown[name]})")
            add_field(groups[title], field)
            for place, flag, keywords in OPTIONS:
                if place == name:  # an option that belongs beside this field
                    groups[title].add_argument(flag, **keywords)
    for place, flag, keywords in OPTIONS:
        if place in groups:
            groups[place].add_argument(flag, **keywords)
        elif place not in by_name:
            raise ValueError(f"option {flag}'s place {place!r} is no section or field")
    return result


def sections_of(source, names):
    """{title: [field names]} in the order of a class's source, a section per `# --- title ---` comment (a field
    before the first comment, or not found in the source: "settings")."""
    names, sections, title = set(names), {}, "settings"
    for line in source.splitlines():
        heading, field = re.fullmatch(r"\s*# --- (.+) ---", line), re.match(r"    (\w+): ", line)
        if heading:
            title = heading.group(1)
        elif field and field.group(1) in names:
            sections.setdefault(title, []).append(field.group(1))
            names.remove(field.group(1))
    if names:
        sections.setdefault("settings", []).extend(sorted(names))
    return sections


# ============================================================
# --help from train.py's text: the fields without importing the class
# ============================================================
def source_fields(path, class_name="DapoArguments"):
    """(fields, sections) of the dataclass class_name in the script at path, read from its text: each field's type
    (train.py's Literal aliases resolved), help and default (a literal; a name of train.py or of a dapo_utils
    module it imports from; else Computed, its source text)."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    names = module_values(tree, os.path.dirname(os.path.abspath(path)), follow=True)
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == class_name)
    fields = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            call = node.value  # arg(default, help, at_least=...)
            default, help_text = call.args[0], ast.literal_eval(call.args[1])
            fields.append(Field(node.target.id, type_of(node.annotation, names), help_text, value_of(default, names)))
    return fields, sections_of(ast.get_source_segment(source, cls), [field.name for field in fields])


def module_values(tree, root, follow=False):
    """{name: value} of a module's module-level constants and Literal aliases; follow: also of the constants it
    imports from its own package (`from dapo_utils.data import QUESTION_COLUMN`: read from that module's text)."""
    values = {}
    for node in tree.body:
        if follow and isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dapo_utils."):
            module = os.path.join(root, *node.module.split(".")) + ".py"
            if os.path.isfile(module):
                with open(module, encoding="utf-8") as f:
                    imported = module_values(ast.parse(f.read()), root)
                values |= {alias.name: imported[alias.name] for alias in node.names if alias.name in imported}
        elif isinstance(node, ast.Assign):
            targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
            sources = node.value.elts if isinstance(node.value, ast.Tuple) and len(targets) > 1 else [node.value]
            for target, value in zip(targets, sources):
                if isinstance(target, ast.Name):
                    with_type = type_of(value, values) if isinstance(value, ast.Subscript) else None
                    literal = value_of(value, values)
                    values[target.id] = with_type if with_type is not None else literal
    return values


def type_of(node, names):
    """A type annotation's node as a type: int, Optional[List[float]], Literal["a", "b"], an alias of names. None:
    something else."""
    if isinstance(node, ast.Name):
        found = TYPES.get(node.id, names.get(node.id))
        return found if found is None or not isinstance(found, Computed) else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        if node.value.id == "Literal":
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return Literal[tuple(ast.literal_eval(item) for item in items)]
        outer, inner = TYPES.get(node.value.id), type_of(node.slice, names)
        return outer[inner] if outer is not None and inner is not None else None
    return None


def value_of(node, names):
    """A default's node as its value: a literal, or a name whose value names holds; else Computed(its text)."""
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError):
        return Computed(ast.unparse(node).replace("'", ""))


def shown_default(value):
    """A default as --help writes it: one line, a computed one as its source says it."""
    text = value.text if isinstance(value, Computed) else str(value)
    return " ".join(text.split()).replace("%", "%%")  # argparse formats help text with %


def print_help(path):
    """`python train.py --help`, from the text of the script at path (source_fields)."""
    fields, sections = source_fields(path)
    parser(fields, sections, {field.name: shown_default(field.default) for field in fields}).print_help()


def python_command(script=None, launcher=""):
    """How a shell in the current folder runs this interpreter (and script) again: paths under the current folder
    relative (`.venv/bin/python train.py`, whether or not the venv is activated), others absolute. script: a path
    (default: train.py beside this package); launcher: what goes between them (run_command's)."""
    python = shown_path(sys.executable)
    python = python if os.sep in python else f".{os.sep}{python}"  # a bare name would be looked up on PATH
    return f"{shlex.quote(python)} {launcher}{shlex.quote(shown_path(script or TRAIN_PY))}"


def run_command(processes=1, fsdp=False, script=None):
    """How a shell in the current folder starts train.py again as a run of `processes` processes (--fsdp: under the
    launcher, even for 1): python_command(), or torchrun run as this interpreter's module (`-m torch.distributed.run`:
    no torchrun on PATH needed, the venv's torch) with as many processes per node. On several nodes (this run's
    LOCAL_WORLD_SIZE is less) each node's own launcher command, whose rendezvous endpoint no process sees."""
    if processes == 1 and not fsdp:
        return python_command(script)
    per_node = int(PER_NODE or processes)
    if per_node >= processes:
        return python_command(script, f"-m torch.distributed.run --nproc_per_node={processes} ")
    return f"the same torchrun command on each of the {processes // per_node} nodes with"


def shown_path(path):
    """path as a command printed for this folder names it: relative under the current folder, else absolute."""
    path, here = os.path.abspath(path), os.getcwd()
    return os.path.relpath(path, here) if path == here or path.startswith(here + os.sep) else path
