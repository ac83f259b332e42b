"""Each extra installs what the code it exists for imports, alone in a fresh venv beside the runtime.

The code of the project belongs to one extra each (``OWNERS``: ``onnxopt/pipeline`` to ``pipeline``,
``models/`` to ``models``, ``tests/`` to ``test``, the rest of ``onnxopt/`` and ``passes/`` to the
base dependencies). ONNX Runtime is the installer's choice, ``cpu`` or ``gpu`` (both install the
same ``onnxruntime`` module, so no other extra may name either): what both of them bring is there
for every extra. Read statically, from the files' import statements, so that a missing
requirement fails here in a second instead of on a newcomer's fresh machine:

* every third-party module a file imports, unguarded (a ``try`` whose handler catches ImportError
  is a fallback), through ``require("module", ...)`` (onnxopt.integrations: a one-line error when
  missing) or, in the tests, ``pytest.importorskip`` (a test that skips on a fresh install hides
  the missing requirement), is required by the file's extra (with the extras it names, such as
  ``onnxopt[pipeline]``), by the base dependencies or by both runtimes;
* a file that imports the project's code of another extra names that extra (serve runs pipelines);
* every package folder is in ``[tool.setuptools] packages`` (a wheel has only those);
* every install command of the README names ``cpu`` or ``gpu``.

The analysis is a function of the pyproject text, so the tests also show it failing on broken
copies of it.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
RUNTIMES = ("cpu", "gpu")

# Which extra each file of the project belongs to: the first pattern that matches ("" is the base).
OWNERS = [
    ("onnxopt/pipeline/*", "pipeline"),
    ("onnxopt/lora/*", "pipeline"),  # generate --lora
    ("onnxopt/serve/*", "serve"),
    ("onnxopt/runners/tensorrt.py", "trt"),
    ("onnxopt/integrations/olive_*.py", "olive"),
    # the bridges take the objects of torch's exporter and onnx-ir; the hint they print names models
    ("onnxopt/integrations/torch_export.py", "models"),
    ("onnxopt/integrations/ir_models.py", "models"),
    ("models/*", "models"),
    ("tests/*", "test"),
    ("benchmarks/*", "test"),  # the suite runs every benchmark's dry run (matplotlib's plot is guarded: bench)
    ("onnxopt/*", ""),
    ("passes/*", ""),
]
PROJECT_PACKAGES = {"onnxopt", "passes", "models", "tests", "benchmarks"}

# Modules named only as strings: the TensorRT module is chosen at import (tensorrt_rtx, or the full
# tensorrt where NVIDIA's index installed it).
IMPORTED_BY_NAME = {"onnxopt/runners/tensorrt.py": {"tensorrt_rtx"}}

# Where a module's name is not its distribution's (any other: the module's name, '-' for '_').
DISTRIBUTION_OF = {"PIL": "pillow", "google": "protobuf", "onnx_graphsurgeon": "onnx-graphsurgeon", "olive": "olive-ai",
                   "ml_dtypes": "ml-dtypes", "pynvml": "nvidia-ml-py", "yaml": "pyyaml", "onnx_ir": "onnx-ir"}
MODULE_OF = {"onnxruntime-gpu": "onnxruntime"}  # a distribution that installs a module of another name


def distribution(module: str) -> str:
    return DISTRIBUTION_OF.get(module, module.lower().replace("_", "-"))


def owner(relative: str) -> str:
    return next(extra for pattern, extra in OWNERS if fnmatch.fnmatch(relative, pattern))


def project_files() -> list[Path]:
    return sorted(p for folder in PROJECT_PACKAGES for p in (ROOT / folder).rglob("*.py"))


# ----------------------------------------------------------------------------------- what pyproject declares

def extras_of(pyproject_text: str) -> dict[str, set[str]]:
    """Distributions each extra installs, the extras it names expanded ("" for the base dependencies;
    a distribution installing a module of another name counts as that module's: onnxruntime-gpu)."""
    project = tomllib.loads(pyproject_text)["project"]
    raw = {"": project["dependencies"], **project["optional-dependencies"]}

    def own(extra: str, seen: frozenset = frozenset()) -> set[str]:
        names = set()
        for text in raw[extra]:
            requirement = Requirement(text)
            name = requirement.name.lower().replace("_", "-")
            if name == project["name"]:
                for other in requirement.extras - seen:
                    names |= own(other, seen | {extra})
            else:
                names.add(MODULE_OF.get(name, name))
        return names

    base = own("")
    runtime = set.intersection(*(own(r) for r in RUNTIMES))
    return {extra: own(extra) | base | (runtime if extra not in RUNTIMES else set()) for extra in raw}


def extras_named(pyproject_text: str) -> dict[str, set[str]]:
    """The extras each extra names through the project's own name (onnxopt[pipeline]), expanded."""
    project = tomllib.loads(pyproject_text)["project"]
    raw = project["optional-dependencies"]
    named = {extra: {e for t in reqs if Requirement(t).name == project["name"] for e in Requirement(t).extras}
             for extra, reqs in raw.items()}
    changed = True
    while changed:
        changed = False
        for extra, others in named.items():
            wider = others.union(*(named.get(o, set()) for o in others))
            changed |= wider != others
            named[extra] = wider
    return named


# ----------------------------------------------------------------------------------- what the code imports

@functools.cache
def imported_names(path: Path, skip_guarded: bool = True) -> frozenset[str]:
    """Modules ``path`` imports: import statements (outside a try that catches ImportError, with
    ``skip_guarded``), ``require("m", ...)`` outside the tests, ``importorskip("m")`` in them, and
    IMPORTED_BY_NAME."""
    tree = ast.parse(path.read_text())
    guarded = set()
    for node in ast.walk(tree):
        if skip_guarded and isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    relative = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else ""
    names = set(IMPORTED_BY_NAME.get(relative, ()))
    by_name = "importorskip" if relative.startswith("tests/") else "require"
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and _called(node) == by_name and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return frozenset(names)


def imports_of(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(third-party top-level modules, the project's modules) that ``path`` needs."""
    names = imported_names(path)
    third_party = {n.split(".")[0] for n in names} - PROJECT_PACKAGES - set(sys.stdlib_module_names) - {"__future__"}
    return frozenset(third_party), frozenset(n for n in names if n.split(".")[0] in PROJECT_PACKAGES)


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    caught = ast.unparse(handler.type) if handler.type is not None else "BaseException"
    return any(name in caught for name in ("ImportError", "ModuleNotFoundError", "BaseException"))


def _called(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)


def _owner_of_module(module: str) -> str | None:
    """The extra of the project's file (or package) ``module`` names; None where no such file exists."""
    parts = module.split(".")
    if parts[:2] == ["onnxopt", "passes"]:
        parts = parts[1:]
    for relative in ("/".join(parts) + ".py", "/".join(parts) + "/__init__.py"):
        if (ROOT / relative).is_file():
            return owner(relative)
    return None


def undeclared(pyproject_text: str) -> dict[str, dict[str, str]]:
    """Per extra, each module its code imports that it does not install, with the first file importing it;
    and ``extra -> {"onnxopt[other]": file}`` where its code imports another extra's code it does not name."""
    declared = extras_of(pyproject_text)
    named = extras_named(pyproject_text)
    missing: dict[str, dict[str, str]] = {}
    for path in project_files():
        relative = str(path.relative_to(ROOT))
        extra = owner(relative)
        third_party, own = imports_of(path)
        for module in sorted(third_party):
            if distribution(module) not in declared[extra]:
                missing.setdefault(extra, {}).setdefault(module, relative)
        for module in sorted(own):
            other = _owner_of_module(module)
            # the base hands a command over to its extra's code (generate, serve, build), which guards its own imports
            if extra and other and other != extra and other not in named.get(extra, set()):
                missing.setdefault(extra, {}).setdefault(f"onnxopt[{other}]", relative)
    return missing


PYPROJECT = (ROOT / "pyproject.toml").read_text()


# ----------------------------------------------------------------------------------- the claims

def test_every_extra_installs_what_its_code_imports():
    missing = undeclared(PYPROJECT)
    assert not missing, f"imported by an extra's code (the base: '') that the extra does not install: {missing}"


@pytest.mark.parametrize("extra, requirement, module", [
    ("serve", '"ray[serve]>=2.60", ', "ray"),             # onnxopt/serve/deployment.py imports ray
    ("pipeline", '"diffusers>=0.30", ', "diffusers"),     # the schedulers
    ("olive", '"olive-ai>=0.13,<0.14", ', "olive"),       # onnxopt/integrations/olive_pass.py requires olive
    ("pipeline", '"tokenizers>=0.20", ', "tokenizers"),   # onnxopt/pipeline/folder.py reads a tokenizer.json's kind
])
def test_the_check_fails_when_an_extra_loses_a_requirement(extra, requirement, module):
    text = PYPROJECT
    line = next(line for line in text.splitlines() if line.startswith(f"{extra} = ["))
    assert requirement in line, line
    broken = text.replace(line, line.replace(requirement, ""))
    assert module in undeclared(broken).get(extra, {}), undeclared(broken)


def test_the_check_fails_when_an_extra_relies_on_another_extra():
    """serve's code runs pipelines: without onnxopt[pipeline] serve would install no diffusers."""
    line = next(line for line in PYPROJECT.splitlines() if line.startswith("serve = ["))
    broken = PYPROJECT.replace(line, line.replace('"onnxopt[pipeline]", ', ""))
    assert "onnxopt[pipeline]" in undeclared(broken).get("serve", {}), undeclared(broken)


def test_what_onnx_runtimes_tools_import_comes_with_both_runtimes():
    """onnxopt imports onnxruntime.tools.symbolic_shape_infer; what that imports and neither onnxruntime
    nor onnxopt's base requires (sympy, since onnxruntime 1.32) must come with cpu and with gpu."""
    import importlib.util
    from importlib.metadata import requires

    used = {m for p in project_files() if owner(str(p.relative_to(ROOT))) != "test"
            for m in imported_names(p) if m.startswith("onnxruntime.tools.")}
    assert used, "onnxopt no longer imports onnxruntime's tools: drop this test"
    always = [Requirement(r) for r in requires("onnxruntime") or []]  # not those of its own extras ("symbolic": sympy)
    declared = extras_of(PYPROJECT)
    base = {Requirement(r).name.lower() for r in tomllib.loads(PYPROJECT)["project"]["dependencies"]}
    provided = {r.name.lower() for r in always if r.marker is None or r.marker.evaluate({"extra": ""})} | base
    package = Path(importlib.util.find_spec("onnxruntime").submodule_search_locations[0])  # not imported
    needed = set()
    for module in used:
        source = package.joinpath(*module.split(".")[1:]).with_suffix(".py")
        # its "try: import sympy / except ImportError: raise ImportError(...)" is a requirement, not a fallback
        for top in {m.split(".")[0] for m in imported_names(source, skip_guarded=False)}:
            if top not in sys.stdlib_module_names and top != "onnxruntime" and distribution(top) not in provided:
                needed.add(distribution(top))
    assert needed, "onnxruntime's tools import nothing it lacks: drop this test"
    for runtime in RUNTIMES:
        assert needed <= declared[runtime], f"'{runtime}' installs onnxruntime without {needed - declared[runtime]}"


def test_no_extra_but_the_runtimes_installs_onnx_runtime():
    """onnxruntime and onnxruntime-gpu install one module: an extra naming one would overwrite the other's."""
    project = tomllib.loads(PYPROJECT)["project"]
    for extra, requirements in {"": project["dependencies"], **project["optional-dependencies"]}.items():
        names = {Requirement(r).name.lower() for r in requirements}
        if extra not in RUNTIMES:
            assert not names & {"onnxruntime", "onnxruntime-gpu"}, extra


def test_torch_is_pinned_wherever_an_extra_installs_it():
    """A torch range takes the registry's newest build, with its CUDA libraries (GBs), not the CPU build."""
    declared_torch = {}
    for extra, requirements in tomllib.loads(PYPROJECT)["project"]["optional-dependencies"].items():
        for text in requirements:
            requirement = Requirement(text)
            if requirement.name == "torch":
                declared_torch[extra] = str(requirement.specifier)
    # olive-ai requires torch (no version): olive must pin it too
    assert "olive" in declared_torch
    assert set(declared_torch.values()) == {"==2.13.0"}, declared_torch


def test_every_package_folder_is_packaged():
    """A wheel holds only the packages pyproject lists (an editable install finds any folder)."""
    tool = tomllib.loads(PYPROJECT)["tool"]["setuptools"]
    listed = set(tool["packages"])
    folders = {"onnxopt." + ".".join(p.parent.relative_to(ROOT / "onnxopt").parts) for p in (ROOT / "onnxopt").rglob("__init__.py")}
    folders = {f.rstrip(".") for f in folders} | {"onnxopt.passes." + ".".join(p.parent.relative_to(ROOT / "passes").parts)
                                                for p in (ROOT / "passes").rglob("__init__.py")}
    folders = {f.rstrip(".") for f in folders}
    assert folders <= listed, f"package folders missing from [tool.setuptools] packages: {sorted(folders - listed)}"


INSTALL = re.compile(r"pip install[^\n`]*?(?:\.|onnxopt)\[([a-z0-9,]+)\]")


def test_every_install_command_of_the_readme_names_a_runtime():
    readme = (ROOT / "README.md").read_text()
    commands = INSTALL.findall(readme)
    assert len(commands) >= 4, commands
    extras = set(tomllib.loads(PYPROJECT)["project"]["optional-dependencies"])
    for named in commands:
        names = set(named.split(","))
        assert names <= extras, named
        assert names & set(RUNTIMES), f"'{named}': optimizing needs ONNX Runtime, cpu or gpu"


# ----------------------------------------------------------------------------------- a missing runtime is one line

def test_optimize_without_onnx_runtime_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """graphsurgeon's folder, without ORT, recursed until Python's limit (an internal error)."""
    from onnxopt.cli import main

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    source = ROOT / "models" / "fixtures" / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
    assert main(["optimize", "-i", str(source), "-o", str(tmp_path / "o.onnx"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onnxopt: error: ONNX Runtime is not installed") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_serve_without_onnx_runtime_is_one_line_before_ray_starts(monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    from onnxopt.cli import main

    def ray_started(*args, **kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "init", ray_started)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    assert main(["serve", str(ROOT / "models" / "pipelines" / "sd15-tiny"), "--provider", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("onnxopt: error: ONNX Runtime is not installed") and err.count("\n") == 1, err


def test_a_tool_that_is_installed_but_does_not_import_says_what_it_lacks(tmp_path, monkeypatch):
    """olive-ai 0.13 imports requests without requiring it: 'olive is not installed' was wrong."""
    from onnxopt.errors import MissingDependencyError
    from onnxopt.integrations import require

    (tmp_path / "tool_with_a_gap").mkdir()
    (tmp_path / "tool_with_a_gap" / "__init__.py").write_text("import a_module_nobody_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(MissingDependencyError, match=r"tool_with_a_gap does not import \(No module named "
                                                     r"'a_module_nobody_installed'\): pip install X"):
        require("tool_with_a_gap", "X")
    with pytest.raises(MissingDependencyError, match="no_such_tool is not installed: pip install X"):
        require("no_such_tool", "X")
