"""Without torch, onnx-ir or olive-ai the integrations say what to install in one line (exit 2)."""

from __future__ import annotations

import importlib
import sys

import pytest

from onnxopt.errors import MissingDependencyError


def test_olive_pass_without_olive(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "olive", None)  # import olive -> ImportError
    monkeypatch.delitem(sys.modules, "onnxopt.integrations.olive_pass", raising=False)
    with pytest.raises(MissingDependencyError, match=r"olive is not installed: pip install 'onnxopt\[olive\]'") as info:
        importlib.import_module("onnxopt.integrations.olive_pass")
    assert info.value.exit_code == 2

    from onnxopt.integrations.olive_config import main

    assert main(["unused.json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install 'onnxopt[olive]'" in err


def test_onnx_program_out_without_torch(monkeypatch):
    from onnxopt.integrations import torch_export

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingDependencyError, match="torch is not installed"):
        torch_export.to_onnx_program(None, None)


def test_ir_model_out_without_onnx_ir(monkeypatch):
    from onnxopt.integrations import ir_models

    monkeypatch.setitem(sys.modules, "onnx_ir", None)
    with pytest.raises(MissingDependencyError, match="onnx_ir is not installed"):
        ir_models.to_ir_model(None)
