"""Claims about the package's shape, read from its source with ``ast`` (nothing is imported or run):

* no import cycle: the modules of ``onnxopt`` (with ``onnxopt.passes``, the repo's ``passes/``)
  import each other as a directed acyclic graph, counting imports inside functions too (a cycle
  deferred to call time is still two modules that each need the other);
* no function of 80 lines or more: a longer one does several things, each of which wants a name;
* one module binds IO and names CUDA graph ids: only ``onnxopt.runners.captured_session`` calls
  ``io_binding()``, ``run_with_iobinding()`` or ``RunOptions()``, or writes the ``gpu_graph_id``
  run-config entry; every other session runs through its CapturedSession.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"onnxopt": ROOT / "onnxopt", "onnxopt.passes": ROOT / "passes"}
MAX_FUNCTION_LINES = 80
CAPTURED_SESSION = "onnxopt/runners/captured_session.py"
BINDING_CALLS = {"io_binding", "run_with_iobinding", "RunOptions"}


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


def binding_outside_the_captured_session(root: Path) -> list[str]:
    """``file:line what`` for each call of :data:`BINDING_CALLS` (as ``x.name(...)`` or ``name(...)``)
    and each ``"gpu_graph_id"`` string in the package's modules other than the captured session's."""
    found = []
    for path in sorted(p for folder in ("onnxopt", "passes") for p in (root / folder).rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where == CAPTURED_SESSION:
            continue
        hits = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                if name in BINDING_CALLS:
                    hits.append((node.lineno, f"{name}()"))
            elif isinstance(node, ast.Constant) and node.value == "gpu_graph_id":
                hits.append((node.lineno, "gpu_graph_id"))
        found += [f"{where}:{line} {what}" for line, what in sorted(hits)]
    return found


def test_only_the_captured_session_binds_io_and_names_graph_ids():
    assert (ROOT / CAPTURED_SESSION).is_file()
    assert binding_outside_the_captured_session(ROOT) == []


def test_a_binding_outside_the_captured_session_is_found(tmp_path):
    (tmp_path / "onnxopt" / "runners").mkdir(parents=True)
    (tmp_path / "passes").mkdir()
    (tmp_path / CAPTURED_SESSION).write_text("binding = session.io_binding()\n")
    (tmp_path / "onnxopt" / "loop.py").write_text(
        "binding = session.io_binding()\noptions = ort.RunOptions()\n"
        "options.add_run_config_entry('gpu_graph_id', '0')\nsession.run_with_iobinding(binding, options)\n"
        "text = 'io_binding() in a string is no call'\n")
    assert binding_outside_the_captured_session(tmp_path) == [
        "onnxopt/loop.py:1 io_binding()", "onnxopt/loop.py:2 RunOptions()", "onnxopt/loop.py:3 gpu_graph_id",
        "onnxopt/loop.py:4 run_with_iobinding()"]

