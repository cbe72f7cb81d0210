"""The package's shape, read statically (nothing imported): no import cycles between its modules, memory/ free of
ComfyUI, every module under 400 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package `tightrope`
PACKAGE_DIRS = ("bench", "demo", "headless", "memory", "nodes", "training")
COMFYUI_MODULES = ("comfy", "comfy_extras", "comfy_api", "folder_paths", "nodes", "server", "execution")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted name (tightrope.x.y) -> file, for the package's own modules (not tests or scripts)."""
    files = [ROOT / "__init__.py", ROOT / "cli.py", ROOT / "__main__.py", ROOT / "versions.py"]
    for folder in PACKAGE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    names = {}
    for path in files:
        parts = path.relative_to(ROOT).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        names[".".join(("tightrope", *parts))] = path
    return names


MODULES = _modules()


def _imports(name: str, path: Path, *, top_level_only: bool) -> set[str]:
    """The package modules `name` imports: every import, or only those that run when it is imported (module level,
    not inside a function: a lazy import inside a function cannot close a cycle at import time)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    if top_level_only:  # imports under module-level if/try blocks still run at import time
        nodes = [n for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 for n in ast.walk(stmt)]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import module` imports the module
                candidate = f"{source}.{alias.name}"
                found.add(candidate if candidate in MODULES else source)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_layout_finds_the_modules():
    assert {"tightrope.training.trainer", "tightrope.training.lora.layers", "tightrope.memory.runtime",
            "tightrope.headless.executor", "tightrope.demo.model", "tightrope.nodes.host"} <= MODULES.keys()


@pytest.mark.parametrize("top_level_only", [True, False], ids=["at-import", "including-lazy"])
def test_no_import_cycles(top_level_only):
    """No cycle among module-level imports (which would fail at import time), and none even counting the imports
    done lazily inside functions (a lazy import that only hides a cycle is a design knot, not a fix). A package's
    __init__ importing its own modules is not a cycle of theirs, so __init__ modules are left out."""
    graph = {name: {m for m in _imports(name, path, top_level_only=top_level_only) if not _is_init(m)}
             for name, path in MODULES.items() if not _is_init(name)}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def _is_init(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_memory_never_imports_comfyui():
    for name, path in MODULES.items():
        if not name.startswith("tightrope.memory"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            roots = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [r for r in roots if r.split(".")[0] in COMFYUI_MODULES], f"{name} imports {roots}"
            if isinstance(node, ast.ImportFrom) and node.level >= 2:  # memory/ stays below training/ and nodes/
                assert node.module is None or not node.module.startswith(("training", "nodes")), name


def test_no_module_over_400_lines():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def _text_opens_without_encoding(tree: ast.AST) -> list[int]:
    """Lines of calls that open a file as text without naming its encoding: open(), Path.open / read_text /
    write_text, gzip.open in a text mode. Binary modes and os.open (a descriptor) are fine; a mode that is not a
    literal counts as text."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or any(k.arg == "encoding" for k in node.keywords):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
        if name in ("read_text", "write_text"):
            lines.append(node.lineno)
        elif name == "open" and owner not in ("os", "Image", "tarfile", "zipfile", "av"):  # av: a media container
            first = 0 if isinstance(func, ast.Attribute) and owner not in ("gzip", "io") else 1  # Path.open(mode)
            mode = node.args[first] if len(node.args) > first else next(
                (k.value for k in node.keywords if k.arg == "mode"), ast.Constant("rb" if owner == "gzip" else "r"))
            if not (isinstance(mode, ast.Constant) and "b" in str(mode.value)):
                lines.append(node.lineno)
    return lines


def test_every_text_file_is_opened_with_its_encoding():
    """Without encoding=, Python reads and writes text in the locale's encoding: cp1252 (or cp932, cp936...) on
    Windows, where a UTF-8 file (a caption, a workflow, pyproject.toml's version) reads as mojibake or fails to decode,
    and an en dash in a benchmark report fails to write."""
    found = {name: lines for name, path in MODULES.items()
             if (lines := _text_opens_without_encoding(ast.parse(path.read_text(encoding="utf-8"))))}
    assert found == {}


def test_the_encoding_check_finds_text_opens():
    code = ("open(p)\nopen(p, 'w')\nopen(p, 'rb')\nopen(p, encoding='utf-8')\np.read_text()\np.open()\np.open('rb')\n"
            "os.open(p, 0)\ngzip.open(p, 'rt')\ngzip.open(p)\nImage.open(p)\np.write_text(s, encoding='utf-8')\n")
    assert _text_opens_without_encoding(ast.parse(code)) == [1, 2, 5, 6, 9]
