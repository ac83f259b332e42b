import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Let the tests import the in-tree packages (models/, tests/) without installing them.
sys.path.insert(0, str(ROOT))

FIXTURES = ROOT / "models" / "fixtures"


def fixture_models() -> list[Path]:
    return sorted(FIXTURES.glob("*.onnx"))


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


class ExportedModel:
    """A tiny model exported for a test: the ONNX file, the torch-side facts, and input dims."""

    def __init__(self, path: Path, built, exporter: str, shapes: str):
        self.path, self.built, self.exporter, self.shapes = path, built, exporter, shapes

    @property
    def sites(self) -> dict:
        return self.built.sites

    def input_spec(self):
        """Concrete input shapes for onnxopt.verify (the dims the model was exported with)."""
        from onnxopt.verify import InputSpec

        return InputSpec(shapes={name: tuple(shape) for name, shape in self.built.input_shapes().items()})

    def __repr__(self):
        return f"<{self.path.name}>"


@pytest.fixture(scope="session")
def export_tiny(tmp_path_factory):
    """export_tiny(family, exporter="torchscript", shapes="dynamic", attention="sdpa", opset=None, dtype=None) -> ExportedModel.

    Exports a tiny model from models/ once per test session (several test files share them);
    ``opset`` None is the exporter's default (models.OPSET_VARIANTS name others).
    Skips when torch/diffusers/transformers are not installed.
    """
    cache: dict[tuple, ExportedModel] = {}
    root = tmp_path_factory.mktemp("exports")

    def get(family: str, exporter: str = "torchscript", shapes: str = "dynamic", attention: str = "sdpa",
            opset: int | None = None, dtype: str | None = None) -> ExportedModel:
        key = (family, exporter, shapes, attention) + ((f"opset{opset}",) if opset else ()) + ((dtype,) if dtype else ())
        if key not in cache:
            pytest.importorskip("torch", reason="exporting models needs torch (pip install -e '.[models]')")
            pytest.importorskip("diffusers", reason="exporting models needs diffusers")
            pytest.importorskip("transformers", reason="exporting models needs transformers")
            from models import build
            from models.export import export

            import torch

            built = build(family, size="tiny", attention=attention, **({"dtype": getattr(torch, dtype)} if dtype else {}))
            folder = root / "-".join(key)
            path = folder / f"{family}.onnx"
            export(built, path, exporter=exporter, shapes=shapes, opset=opset)
            cache[key] = ExportedModel(path, built, exporter, shapes)
        return cache[key]

    return get


from models import EXPORT_VARIANTS  # noqa: E402  (re-exported for the test modules)


# ---------------------------------------------------------------- helpers shared by the test modules


def run_passes(source, names):
    """Load ``source`` and run ``names`` (passes and presets) through the pass manager: (model, report)."""
    from onnxopt import registry
    from onnxopt.loading import load_model
    from onnxopt.manager import PassManager

    model = load_model(source)
    report = PassManager(registry.expand(names)).run(model)
    return model, report


def result_of(report, pass_name):
    """The PassResult of the first run of ``pass_name`` in ``report``."""
    return next(p.result for p in report.passes if p.name == pass_name)


def op_counts(model):
    """Op type -> how many nodes of it the model's graph has."""
    from collections import Counter

    return Counter(n.op for n in model.graph.nodes)


def export_cases(families, fast, prefix: str = "") -> list:
    """pytest params ``(family, variant)`` for every family x EXPORT_VARIANTS, each marked
    ``models``; those ``fast(family, variant)`` refuses are marked ``slow`` too (the default run
    skips them). Ids read ``{prefix}{family}-{exporter}-{shapes}-{attention}``."""
    cases = []
    for family in families:
        for variant in EXPORT_VARIANTS:
            marks = [pytest.mark.models] + ([] if fast(family, variant) else [pytest.mark.slow])
            cases.append(pytest.param(family, variant, marks=marks, id=f"{prefix}{family}-{'-'.join(variant)}"))
    return cases


def nodes_of(model, op_type):
    return [n for n in model.graph.nodes if n.op == op_type]
