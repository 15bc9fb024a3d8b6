"""The packages import one way: no module reaches, directly or through others, back to
itself. A circle is how layers blur (a helper taken from the command above it, a loader that
builds what imports it), so the test walks every import statement, function-level and
TYPE_CHECKING ones too, and names each circle it finds."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("mlxspec", "tui")


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports; `from a import b` counts `a` and, where it is a
    module, `a.b`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_through_others():
    files = module_files()
    known = set(files)
    graph = {name: imported_modules(name, path, known) for name, path in files.items()}
    circles = import_circles(graph)
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


# A module past this reads as several jobs in one file (cli.py was 954 lines): split it by
# job, as mlxspec/cli/ is split by command.
MOST_LINES = 550


def test_no_module_grows_past_one_job():
    long = {
        name: n
        for name, path in module_files().items()
        if (n := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"modules over {MOST_LINES} lines: {long}"


def test_the_command_line_loads_without_mlx_lm():
    """`mlxspec --help`, a usage error, and the launcher of `--ranks`, which only parses
    its options and starts the ranks, never run a model: importing mlx-lm (it loads
    transformers, about 2 s here) made each rank launch 2 s slower. Each command imports
    what it runs when it runs it."""
    heavy = ("mlx_lm", "transformers", "fastapi", "textual")
    code = (
        "import sys, mlxspec.cli; "
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the command line imports {done.stdout.strip()}"
