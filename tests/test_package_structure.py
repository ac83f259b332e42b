"""Claims about the package's shape, read from its source with ``ast`` (nothing is imported or run):

* no import cycle: the modules of ``onnxopt`` (with ``onnxopt.passes``, the repo's ``passes/``)
  import each other as a directed acyclic graph, counting imports inside functions too (a cycle
  deferred to call time is still two modules that each need the other);
* no function of 80 lines or more: a longer one does several things, each of which wants a name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"onnxopt": ROOT / "onnxopt", "onnxopt.passes": ROOT / "passes"}
MAX_FUNCTION_LINES = 80


def package_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports: ``from pkg import module`` names the module,
    ``from module import thing`` the module (relative imports resolved against ``name``)."""
    here = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    found.add(f"{base}.{alias.name}")
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(sorted(component))
    return cycles


def test_the_package_has_no_import_cycle():
    modules = package_modules()
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert {"onnxopt.registry", "onnxopt.pass_infra"} <= graph.keys() and graph["onnxopt.registry"]
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    """The check can fail: two modules that import each other, and a longer loop, are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}, "f": set()}
    assert sorted(import_cycles(graph)) == [["a", "b"], ["c", "d", "e"]]


def long_functions(folder: Path) -> list[str]:
    """``file:line name (n lines)`` for each function of ``folder`` at or over the limit."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines >= MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_under_onnxopt_has_80_lines_or_more():
    assert long_functions(ROOT / "onnxopt") == []


def test_a_long_function_is_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"m.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]
