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


# The layers of docs/architecture.md, top to bottom, as the folders hold them. A module may
# import its own layer and the layers below it, never one above. The most specific prefix
# names a module's layer.
LAYERS: dict[str, int] = {
    "mlxspec.cli": 9,
    "mlxspec.__main__": 9,
    "mlxspec.server.app": 8,
    "mlxspec.server": 8,  # the package's door: create_app and serve
    "tui": 8,
    "mlxspec.bench": 8,
    "mlxspec.server.openai": 7,
    "mlxspec.server.anthropic": 7,
    "mlxspec.server.responses": 7,
    "mlxspec.server.llamacpp": 7,
    "mlxspec.server.ollama": 7,
    "mlxspec.server.": 6,  # the core every dialect shares (the dot: not the door above)
    "mlxspec.distributed": 5,
    "mlxspec.registry": 4,
    # train-drafter's and `pull --mtp`'s bodies: they register what they made, and distill
    # builds a draft-model proposer; reached only from cli/.
    "mlxspec.drafter.command": 4,
    "mlxspec.drafter.distill": 4,
    "mlxspec.drafter.mtp_command": 4,
    "mlxspec.decoding": 3,
    "mlxspec.batch": 3,
    "mlxspec.proposers": 2,
    "mlxspec.suffix": 1,
    "mlxspec.drafter": 1,
    "mlxspec.structured": 1,
    "mlxspec.models": 0,
    "mlxspec.markup": 0,
    "mlxspec": -1,  # the leaves at the root (events, settings, sampling, paths, device, ...)
}
# (importer, imported): the one upward import, and why it is allowed.
UPWARD_ALLOWED = {
    # a maintainer's tool's main() (python -m mlxspec.drafter.answers) names a models.toml
    # entry; the library functions above it do not
    ("mlxspec.drafter.answers", "mlxspec.registry.models_toml"),
}


def layer_of(module: str) -> int:
    """The layer of the longest prefix in LAYERS that names `module` (a package prefix
    ending in a dot matches only modules inside it)."""
    best = ""
    for prefix in LAYERS:
        inside = (
            module.startswith(prefix)
            if prefix.endswith(".")
            else (module == prefix or module.startswith(prefix + "."))
        )
        if inside and len(prefix) > len(best):
            best = prefix
    assert best, f"{module} is in no layer: add its package to LAYERS"
    return LAYERS[best]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{name} (layer {layer_of(name)}) imports {used} (layer {layer_of(used)})"
        for name, imports in graph.items()
        for used in imports
        if layer_of(used) > layer_of(name) and (name, used) not in UPWARD_ALLOWED
    )


def test_the_layer_check_finds_an_upward_import():
    graph = {"mlxspec.models.target": {"mlxspec.decoding.engine"}, "mlxspec.cli": {"tui.app"}}
    assert upward_imports(graph) == [
        "mlxspec.models.target (layer 0) imports mlxspec.decoding.engine (layer 3)"
    ]
    assert layer_of("mlxspec.server.worker") < layer_of("mlxspec.server.openai.routes")
    assert layer_of("mlxspec.server") > layer_of("mlxspec.server.openai.routes")


def test_every_layer_imports_only_downward():
    """front ends -> server, tui, bench -> distributed -> registry -> decoding and batch ->
    proposers -> suffix, drafter, structured -> models, markup -> the root's leaves; inside
    the server, app -> each dialect -> the core."""
    files = module_files()
    known = set(files)
    graph = {name: imported_modules(name, path, known) for name, path in files.items()}
    upward = upward_imports(graph)
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


# The root keeps what many layers share; a module of one concern belongs in its package.
MOST_ROOT_MODULES = 10


def test_the_root_holds_only_the_shared_leaves():
    root = sorted(
        path.stem
        for path in (ROOT / "mlxspec").glob("*.py")
        if path.stem not in ("__init__", "__main__")
    )
    assert len(root) <= MOST_ROOT_MODULES, f"{len(root)} modules at the root: {root}"
