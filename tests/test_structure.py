"""The package's structure (docs/design.md, "The middle floor"): no import cycle, files cut by
responsibility, one home per name, one frame step. Read from the sources with `ast`, so imports
inside functions and under TYPE_CHECKING count as much as those at the top."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kazeia"
MAX_LINES = 400  # docs/design.md: files under ~400 lines, cut by responsibility
ENGINE_LINES = 300  # the facade


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file: `from . import x` counts as x."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in modules]
            out.update(subs if len(subs) == len(node.names) else [target, *subs])
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {target for target in out if target in modules and target != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, as the list of its modules, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_of_the_package_imports_itself_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # the finder finds one


def test_files_are_cut_by_responsibility_within_their_size():
    sizes = {path.relative_to(PACKAGE.parent).as_posix(): len(path.read_text().splitlines()) for path in
             PACKAGE.rglob("*.py")}  # fmt: skip
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
    assert sizes["kazeia/engine.py"] <= ENGINE_LINES


def test_each_class_name_names_one_thing():
    homes: dict[str, list[str]] = {}
    for name, path in _modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                homes.setdefault(node.name, []).append(name)
    assert {cls: where for cls, where in homes.items() if len(where) > 1} == {}


def test_sampling_is_called_from_the_frame_step_alone():
    callers = set()
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "sample",
                "sample_rows",
                "talker_scores",
            ):
                callers.add(name)
    assert callers - {"kazeia.sampling"} == {"kazeia.frame"}  # sampling's own sample_rows calls sample
