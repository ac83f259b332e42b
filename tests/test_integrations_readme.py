"""The README's "Use from other tools" snippets are the ones the tests run: the torch snippet is
executed here as written; the Olive and Polygraphy commands are the ones
test_integrations_olive.py and test_integrations_polygraphy.py run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def section_blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use from other tools\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.mark.models
def test_readme_torch_dynamo_snippet_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    (snippet,) = section_blocks("python")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    import onnxopt
    import torch

    assert isinstance(namespace["program"], torch.onnx.ONNXProgram)
    assert namespace["report"].final_verification.ok
    assert "verify: final model equal to the source" in capsys.readouterr().out
    with torch.no_grad():
        expected = namespace["built"].module(*namespace["built"].example_inputs)
    expected = expected[0] if isinstance(expected, (tuple, list)) else expected
    torch.testing.assert_close(namespace["out_sample"], expected, atol=1e-4, rtol=1e-3)
    saved = onnxopt.load_model(tmp_path / "unet.trt.onnx")
    assert "GroupNormalization" in {n.op for n in saved.graph.nodes}  # the tensorrt preset's form


def test_readme_olive_and_polygraphy_commands_are_the_tested_ones():
    (olive,) = [b for b in section_blocks("bash") if "olive run" in b]
    assert "python3 -m onnxopt.integrations.olive_config olive_packages.json" in olive
    assert "olive run --config examples/olive/unet_sd15_tiny_cpu.json --package-config olive_packages.json" in olive
    (poly,) = [b for b in section_blocks("bash") if "polygraphy run" in b]
    from tests.test_integrations_polygraphy import README_COMMAND

    assert README_COMMAND in poly.splitlines()
