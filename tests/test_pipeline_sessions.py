"""ONNX Runtime sessions the package makes: one place (onnxopt.runtime), quiet unless asked.

ORT's own log lines ([E:onnxruntime:...] from cuDNN's frontend discarding plans, [W:onnxruntime:...]
about initializers or node placement) reached the user's screen through the Python API and some
command paths. Every session is now made by :func:`onnxopt.runtime.inference_session` at severity 4
(fatal) with ORT's default logger set the same, unless ``set_ort_logging(True)`` (the CLI's --debug).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

pytest.importorskip("onnxruntime")

from onnxopt import runtime  # noqa: E402
from onnxopt.errors import OnnxoptError  # noqa: E402
from onnxopt.pipeline.sessions import create_session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def unused_initializer_model() -> bytes:
    """y = x + 1, with an initializer no node reads: ORT logs a [W:onnxruntime:...] line removing it."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0]), helper.make_tensor("unused", TensorProto.FLOAT, [1], [2.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_a_session_the_package_makes_logs_nothing_below_fatal():
    session = create_session(unused_initializer_model(), "cpu", name="tiny")
    assert session.get_session_options().log_severity_level == runtime.ORT_QUIET == 4
    assert session.run(None, {"x": np.zeros(2, np.float32)})[0].tolist() == [1.0, 1.0]
    with runtime.ort_logging(True):
        loud = create_session(unused_initializer_model(), "cpu", name="tiny")
    assert loud.get_session_options().log_severity_level == runtime.ORT_VERBOSE
    assert runtime.inference_session(unused_initializer_model(), ["CPUExecutionProvider"]).get_session_options() \
        .log_severity_level == runtime.ORT_QUIET


@pytest.mark.parametrize("verbose", [False, True])
def test_ort_log_lines_reach_the_screen_only_when_asked(tmp_path, verbose):
    """Through the Python API, in a fresh process (ORT's default logger is per process): ORT's own
    warning line is on stderr only after set_ort_logging(True)."""
    model = tmp_path / "m.onnx"
    model.write_bytes(unused_initializer_model())
    script = textwrap.dedent(f"""
        from onnxopt import runtime
        runtime.set_ort_logging({verbose})
        runtime.inference_session({str(model)!r}, ["CPUExecutionProvider"])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert ("onnxruntime" in done.stderr) == verbose, done.stderr


def test_every_session_is_made_in_one_place():
    """No module but onnxopt/runtime.py calls InferenceSession (or polygraphy's SessionFromOnnx, which
    makes one without options): a new call site would bypass the quiet severity."""
    offenders = []
    for path in (ROOT / "onnxopt").rglob("*.py"):
        if path.name == "runtime.py" and path.parent.name == "onnxopt":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if re.search(r"\bInferenceSession\(|\bSessionFromOnnx\(|\bSessionOptions\(", code):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, offenders


def test_a_cuda_ep_graph_on_the_cpu_says_how_to_get_a_portable_folder():
    """A folder optimized for ort-cuda holds com.microsoft ops the CPU EP lacks (NhwcConv): the error
    names --provider cuda, and --target tensorrt, which writes standard ONNX every provider runs."""
    node = helper.make_node("NhwcConv", ["x", "w"], ["y"], domain="com.microsoft", kernel_shape=[1, 1])
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 2, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 2, 1])],
        [helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 1, 1], [1.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    with pytest.raises(OnnxoptError) as caught:
        create_session(model.SerializeToString(), "cpu", name="unet")
    message = str(caught.value)
    assert "\n" not in message and "--provider cuda" in message and "--target tensorrt" in message, message
    onnx.checker.check_model(model)  # a valid graph: only the provider lacks the kernel
