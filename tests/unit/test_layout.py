"""The layout the architecture promises, checked from the source:

- the agent imports ``remote_tpu`` only through the shared core ``remote_tpu._core``;
- the shared core imports nothing of the client's own modules;
- no import circle in either package (imports inside functions count too).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = {"remote_tpu": ROOT / "remote_tpu", "remote_tpu_agent": ROOT / "agent"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> set[str]:
    """Every module of ours that ``name`` imports, anywhere in its body."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = name.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            bases = [base]
            names = [alias.name for alias in node.names]
        else:
            continue
        for base in bases:
            for candidate in [f"{base}.{n}" for n in names] + [base]:
                if candidate in MODULES:
                    out.add(candidate)
                    break
    out.discard(name)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_agent_imports_remote_tpu_only_through_the_shared_core():
    wrong = sorted(f"{name} imports {target}" for name, targets in GRAPH.items()
                   if name.startswith("remote_tpu_agent") for target in targets
                   if target.startswith("remote_tpu.") and
                   not target.startswith("remote_tpu._core"))
    assert not wrong, "\n".join(wrong)


def test_the_shared_core_imports_nothing_of_the_client_or_the_agent():
    wrong = sorted(f"{name} imports {target}" for name, targets in GRAPH.items()
                   if name.startswith("remote_tpu._core") for target in targets
                   if not target.startswith("remote_tpu._core"))
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    # A package's __init__ importing its own modules is not a circle of theirs.
    graph = {name: {t for t in targets if not name.startswith(t + ".")}
             for name, targets in GRAPH.items()}
    assert _cycles(graph) == []


def test_the_circle_finder_finds_circles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The agent's wings, top down (``agent/__init__.py``): each imports only the
# wings below it, and its own modules.
WINGS = ["server", "gateway", "peer", "host", "jobs", "worker", "wire"]


def _wing(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[0] == "remote_tpu_agent" else None


def test_every_agent_module_lives_in_a_wing():
    loose = sorted(name for name in MODULES if name.startswith("remote_tpu_agent.")
                   and _wing(name) is None and name not in WINGS_PACKAGES
                   and name != "remote_tpu_agent.__main__")
    assert not loose, f"agent modules outside a wing ({', '.join(WINGS)}): {loose}"
    unknown = sorted({_wing(n) for n in MODULES if _wing(n)} - set(WINGS))
    assert not unknown, f"wings not on the plan (add them to WINGS in order): {unknown}"


WINGS_PACKAGES = {f"remote_tpu_agent.{w}" for w in WINGS}


def test_the_agents_wings_import_only_downwards():
    rank = {w: i for i, w in enumerate(WINGS)}
    wrong = sorted(f"{name} ({_wing(name)}) imports {target} ({_wing(target)})"
                   for name, targets in GRAPH.items() if _wing(name)
                   for target in targets if _wing(target)
                   and rank[_wing(target)] < rank[_wing(name)])
    assert not wrong, ("a wing imports one above it (the plan is "
                       + " > ".join(WINGS) + "):\n" + "\n".join(wrong))


CLASS_LINES = 220      # "about 200": a class past it says why at its top


def _long_classes_without_a_reason() -> list[str]:
    found = []
    for package in ("agent", "remote_tpu"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if "proto" in path.parts:          # generated by protoc
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > CLASS_LINES and "Why over" not in (ast.get_docstring(node) or ""):
                        found.append(f"{path.relative_to(ROOT)}::{node.name} ({lines} lines)")
    return found


def test_a_class_over_about_200_lines_says_why_at_its_top():
    """Classes are sized by what they do: one that grows past about 200
    lines is split, or its docstring says "Why over 200 lines: ..."."""
    assert _long_classes_without_a_reason() == []
