"""The CLI against odd graphs and misused flags: every case gets its documented exit code (never 3),
one line on stderr and no traceback, leaves the input's bytes and the folder as they were, and
writes nothing after a failure.

Hostile *files* (symlinks, external data, collisions) are tests/test_adversarial_files.py.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxopt.cli import main
from tests.graphs import linear_model, make_model
from tests.test_pass_manager import plugins  # noqa: F401  (fixture)


def tensor(name, shape, dtype=T.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def relu_model(shape=(2, 3), dtype=T.FLOAT):
    return make_model([helper.make_node("Relu", ["x"], ["out"], name="relu")], [tensor("x", list(shape), dtype)],
                      [tensor("out", list(shape), dtype)])


def snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def run_cli(capsys, args):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def assert_refused(code, out, err, *, exit_code, message, before, folder):
    """The contract for a refused run: the exit code, one line, no traceback, nothing written."""
    assert code == exit_code, f"exit {code}, stderr: {err}"
    assert "Traceback" not in out + err and "internal error" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("onnxopt"), f"expected one line on stderr, got: {err!r}"
    for fragment in (message,) if isinstance(message, str) else message:
        assert fragment in lines[0], lines[0]
    assert snapshot(folder) == before, "a file in the folder changed, appeared or disappeared"


def optimize_refused(tmp_path, capsys, proto_or_bytes, extra, *, exit_code=2, message=""):
    src = tmp_path / "in.onnx"
    if isinstance(proto_or_bytes, bytes):
        src.write_bytes(proto_or_bytes)
    else:
        onnx.save(proto_or_bytes, src)
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, ["optimize", "-q", "-i", str(src), "-o", str(tmp_path / "out.onnx"), *extra])
    assert_refused(code, out, err, exit_code=exit_code, message=message, before=before, folder=tmp_path)


# ------------------------------------------------------------------------ invalid graphs


def _duplicate_producer():
    return make_model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["x"], ["y"]),
                       helper.make_node("Identity", ["y"], ["out"])], [tensor("x", [2])], [tensor("out", [2])])


def _dangling_input():
    return make_model([helper.make_node("Add", ["x", "ghost"], ["out"], name="add")], [tensor("x", [2])], [tensor("out", [2])])


def _duplicate_output():
    return make_model([helper.make_node("Relu", ["x"], ["out"])], [tensor("x", [2])], [tensor("out", [2]), tensor("out", [2])])


def _unproduced_output():
    return make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor("x", [2])], [tensor("out", [2])])


def _cycle():
    return make_model([helper.make_node("Add", ["x", "b"], ["a"], name="n1"), helper.make_node("Relu", ["a"], ["b"], name="n2"),
                       helper.make_node("Identity", ["a"], ["out"])], [tensor("x", [2])], [tensor("out", [2])])


def _node_output_shadows_input():
    return make_model([helper.make_node("Relu", ["x"], ["x"]), helper.make_node("Identity", ["x"], ["out"])],
                      [tensor("x", [2])], [tensor("out", [2])])


def _subgraph_reads_nothing():
    branch = helper.make_graph([helper.make_node("Relu", ["nowhere"], ["o"])], "then", [], [tensor("o", [2])])
    return make_model([helper.make_node("If", ["c"], ["out"], then_branch=branch, else_branch=branch)],
                      [tensor("c", [], T.BOOL)], [tensor("out", [2])])


def _non_utf8(marker: bytes):
    proto = make_model([helper.make_node("Relu", ["xQQQ"], ["out"], name="NAMEX")], [tensor("xQQQ", [2])], [tensor("out", [2])])
    return proto.SerializeToString().replace(marker, marker[:-2] + b"\xff\xfe")


@pytest.mark.parametrize("build, message", [
    (_duplicate_producer, "tensor 'y' has two producers"),
    (_dangling_input, "node 'add' (Add) reads 'ghost', which no node, initializer or graph input produces"),
    (_duplicate_output, "graph output 'out' is listed twice"),
    (_unproduced_output, "graph output 'out' is produced by nothing"),
    (_cycle, "the graph has a cycle"),
    (_node_output_shadows_input, "tensor 'x' has two producers: graph input and"),
    (_subgraph_reads_nothing, "reads 'nowhere'"),
    (lambda: _non_utf8(b"NAMEX"), "NodeProto.name b'NAM\\xff\\xfe' is not UTF-8"),
    (lambda: _non_utf8(b"xQQQ"), "is not UTF-8"),
], ids=["two-producers", "dangling-input", "duplicate-output", "unproduced-output", "cycle", "output-shadows-input",
        "subgraph-dangling", "non-utf8-node-name", "non-utf8-tensor-name"])
def test_an_invalid_graph_is_refused_as_invalid(tmp_path, capsys, build, message):
    optimize_refused(tmp_path, capsys, build(), ["--passes", "cleanup"], message=("invalid model", message))


def test_a_valid_graph_listed_out_of_order_is_accepted(tmp_path, capsys):
    """Order is not validity: graphsurgeon sorts the nodes (only a cycle is refused)."""
    proto = make_model([helper.make_node("Identity", ["y"], ["out"]), helper.make_node("Relu", ["x"], ["y"])],
                       [tensor("x", [2])], [tensor("out", [2])])
    onnx.save(proto, tmp_path / "in.onnx")
    assert main(["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--verify"]) == 0


@pytest.mark.parametrize("where", ["input", "output"])
@pytest.mark.parametrize("kind", ["optional", "sequence"])
def test_non_tensor_graph_inputs_and_outputs_are_refused_without_verify(tmp_path, capsys, kind, where):
    elem = helper.make_tensor_type_proto(T.FLOAT, [2, 3])
    odd = helper.make_optional_type_proto(elem) if kind == "optional" else helper.make_sequence_type_proto(elem)
    if where == "input":
        op = "OptionalHasElement" if kind == "optional" else "SequenceLength"
        proto = make_model([helper.make_node(op, ["x"], ["out"])], [helper.make_value_info("x", odd)], [tensor("out", [], T.BOOL)])
    else:
        op = "Optional" if kind == "optional" else "SequenceConstruct"
        proto = make_model([helper.make_node(op, ["x"], ["out"])], [tensor("x", [2, 3])], [helper.make_value_info("out", odd)])
    optimize_refused(tmp_path, capsys, proto, [], message=f"graph {where} '{'x' if where == 'input' else 'out'}' is not a tensor ({kind} type)")


@pytest.mark.parametrize("passes", ["cleanup", "ort-cuda"])
def test_an_optional_value_inside_the_graph_goes_through(tmp_path, capsys, passes):
    """Its value_info annotation (an optional type) crashed graphsurgeon's export (exit 3)."""
    proto = make_model([helper.make_node("Optional", ["x"], ["o"]), helper.make_node("OptionalGetElement", ["o"], ["out"])],
                       [tensor("x", [2, 3])], [tensor("out", [2, 3])])
    proto.graph.value_info.append(helper.make_value_info("o", helper.make_optional_type_proto(helper.make_tensor_type_proto(T.FLOAT, [2, 3]))))
    onnx.save(proto, tmp_path / "in.onnx")
    assert main(["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--passes", passes, "--verify"]) == 0


def test_a_sequence_inside_the_graph_verifies(tmp_path, capsys):
    proto = make_model([helper.make_node("SequenceConstruct", ["x", "x"], ["s"]),
                        helper.make_node("ConcatFromSequence", ["s"], ["c"], axis=0), helper.make_node("Identity", ["c"], ["out"])],
                       [tensor("x", [2, 3])], [tensor("out", [4, 3])])
    onnx.save(proto, tmp_path / "in.onnx")
    assert main(["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--verify"]) == 0


# ------------------------------------------------------------------------ input defaults


def _input_with_default(fold_chain: bool):
    """out = x + (b * 2 if fold_chain else b); b is a graph input whose initializer is its default."""
    nodes = [helper.make_node("Mul", ["b", "two"], ["c"]), helper.make_node("Add", ["x", "c"], ["out"])] if fold_chain else \
        [helper.make_node("Add", ["x", "b"], ["out"])]
    inits = [numpy_helper.from_array(np.ones((2, 3), np.float32), "b"), numpy_helper.from_array(np.array(2, np.float32), "two")]
    return make_model(nodes, [tensor("x", [2, 3]), tensor("b", [2, 3])], [tensor("out", [2, 3])], inits[: 2 if fold_chain else 1])


@pytest.mark.parametrize("fold_chain", [False, True], ids=["add", "mul-add"])
@pytest.mark.parametrize("passes", ["cleanup", "ort-cuda"])
def test_an_input_with_a_default_stays_an_input_the_caller_may_override(tmp_path, capsys, fold_chain, passes):
    import onnxruntime as ort

    src, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(_input_with_default(fold_chain), src)
    assert main(["optimize", "-q", "-i", str(src), "-o", str(out), "--passes", passes, "--verify"]) == 0
    result = onnx.load(out)
    assert [i.name for i in result.graph.input] == ["x", "b"]
    assert "b" in {t.name for t in result.graph.initializer}
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    for feeds in ({"x": x}, {"x": x, "b": 3 * x}):  # the default, then an override
        expected = ort.InferenceSession(str(src)).run(None, feeds)[0]
        np.testing.assert_allclose(ort.InferenceSession(str(out)).run(None, feeds)[0], expected, rtol=1e-6)


# ------------------------------------------------------------------------ misused flags


def _linear(tmp_path):
    """out = x @ W, x: [batch, 16]."""
    proto = make_model([helper.make_node("MatMul", ["x", "W"], ["out"])], [tensor("x", ["batch", 16])], [tensor("out", ["batch", 4])],
                       [numpy_helper.from_array(np.ones((16, 4), np.float32), "W")])
    return proto


def _write_npz(tmp_path, kind):
    path = tmp_path / f"calib-{kind}.npz"
    if kind == "wrong-keys":
        np.savez(path, y=np.zeros((2, 16), np.float32))
    elif kind == "not-npz":
        path.write_text("hello\n")
    elif kind == "npy":
        np.save(tmp_path / "calib.npy", np.zeros(3))
        (tmp_path / "calib.npy").rename(path)
    return path


@pytest.mark.parametrize("flags, message", [
    (["--verify", "--atol", "nan"], "argument --atol: expected a finite number of 0 or more, got 'nan'"),
    (["--verify", "--atol", "-1e-3"], "argument --atol"),
    (["--verify", "--rtol", "inf"], "argument --rtol"),
    (["--verify", "--shape", "x=2,3,16"], "input 'x' has rank 2"),
    (["--verify", "--shape", "x=-3,16"], "dims of 0 or more, got 'x=-3,16'"),
    (["--verify", "--shape", "x=2,15"], "dim 1 of input 'x' is fixed at 16"),
    (["--verify", "--shape", "y=2,16"], "the model has no input 'y' (its inputs: x)"),
    (["--verify", "--shape", "=2,16"], "argument --shape"),
    (["--verify", "--dim", "batch=-1"], "argument --dim"),
    (["--low-precision", "bfloat16"], "--low-precision is an option of the fp16 pass, which --passes does not run"),
    (["--passes", "cleanup", "--fp32-ops", "Resize", "--fp32-auto"], "--fp32-ops, --fp32-auto are options of the fp16 pass"),
    (["--passes", "fp16", "--calibration", "CALIB:missing"], "--calibration goes with --fp32-auto"),
    (["--passes", "fp16", "--fp32-auto", "--calibration", "CALIB:missing"], "cannot read inputs: No such file or directory"),
    (["--passes", "fp16", "--fp32-auto", "--calibration", "CALIB:not-npz"], "not an .npz of arrays keyed by input name"),
    (["--passes", "fp16", "--fp32-auto", "--calibration", "CALIB:npy"], "not an .npz of arrays keyed by input name"),
    (["--passes", "fp16", "--fp32-auto", "--calibration", "CALIB:wrong-keys"], "no array for input(s) x (it holds: y)"),
    (["--low-precision", "float8"], "argument --low-precision: invalid choice"),
    (["--external-data", "--no-external-data"], "not allowed with argument"),
    (["--fp16", "--bf16"], "argument --bf16: not allowed with argument --fp16"),
    (["--bf16", "--low-precision", "float16"], "give --bf16 or --low-precision float16, not both"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
], ids=lambda v: " ".join(a.split("/")[-1] for a in v) if isinstance(v, list) else "")
def test_a_misused_flag_is_a_one_line_usage_error(tmp_path, capsys, flags, message):
    flags = [str(_write_npz(tmp_path, f[6:])) if f.startswith("CALIB:") else f for f in flags]
    optimize_refused(tmp_path, capsys, _linear(tmp_path), flags, message=message)


def test_diff_refuses_a_nan_tolerance(tmp_path, capsys):
    onnx.save(_linear(tmp_path), tmp_path / "a.onnx")
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, ["diff", str(tmp_path / "a.onnx"), str(tmp_path / "a.onnx"), "--atol", "nan"])
    assert_refused(code, out, err, exit_code=2, message="argument --atol", before=before, folder=tmp_path)


def test_a_valid_calibration_file_still_calibrates(tmp_path, capsys):
    onnx.save(_linear(tmp_path), tmp_path / "in.onnx")
    np.savez(tmp_path / "calib.npz", x=np.ones((2, 16), np.float64))  # cast to the input's float32
    args = ["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--passes", "fp16",
            "--fp32-auto", "--calibration", str(tmp_path / "calib.npz"), "--verify"]
    assert main(args) == 0


# ------------------------------------------------------------------------ what --verify cannot run


def _unknown_domain_op():
    proto = make_model([helper.make_node("Frobnicate", ["x"], ["out"], domain="example.custom")], [tensor("x", [2, 3])], [tensor("out", [2, 3])])
    proto.opset_import.append(helper.make_opsetid("example.custom", 1))
    return proto


def _rank16_symbolic():
    dims = [f"d{i}" for i in range(16)]
    return make_model([helper.make_node("Relu", ["x"], ["out"])], [tensor("x", dims)], [tensor("out", dims)])


@pytest.mark.parametrize("build, message", [
    (_unknown_domain_op, "cannot verify: the source model does not run"),
    (lambda: relu_model(dtype=T.STRING), "input 'x' of type string"),
    (lambda: make_model([helper.make_node("Cast", ["x"], ["out"], to=T.FLOAT)], [tensor("x", [2, 3], T.FLOAT8E4M3FN)], [tensor("out", [2, 3])]),
     "input 'x' of type float8e4m3fn"),
    (_rank16_symbolic, "over the 1.0 GiB limit (dims set by default: d0=8, d1=8"),
], ids=["unknown-domain", "string", "float8-input", "rank16-symbolic"])
def test_verify_says_what_it_cannot_run(tmp_path, capsys, build, message):
    optimize_refused(tmp_path, capsys, build(), ["--verify"], message=message)


def test_the_feed_limit_names_the_dims_to_set_and_setting_them_works(tmp_path, capsys):
    onnx.save(_rank16_symbolic(), tmp_path / "in.onnx")
    dims = [a for i in range(16) for a in ("--dim", f"d{i}=2")]
    assert main(["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--verify", *dims]) == 0


def test_unknown_domain_ops_pass_through_without_verify(tmp_path, capsys):
    onnx.save(_unknown_domain_op(), tmp_path / "in.onnx")
    assert main(["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx")]) == 0
    assert onnx.load(tmp_path / "out.onnx").graph.node[0].op_type == "Frobnicate"


# ------------------------------------------------------------------------ non-finite sources


def _sqrt_model(abs_first: bool):
    nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Sqrt", ["a"], ["out"])] if abs_first else \
        [helper.make_node("Sqrt", ["x"], ["s"]), helper.make_node("Identity", ["s"], ["out"])]
    return make_model(nodes, [tensor("x", [4, 8])], [tensor("out", [4, 8])])


def test_verify_says_when_the_source_itself_is_not_finite(tmp_path, capsys):
    """sqrt of random inputs in [-1, 1] is NaN for half of them in the source: the same NaN in the
    candidate is the same computation (exit 0), and the report says the source is non-finite."""
    onnx.save(_sqrt_model(abs_first=False), tmp_path / "in.onnx")
    code, out, err = run_cli(capsys, ["optimize", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"), "--verify"])
    assert code == 0, err
    assert "the source itself computes NaN or inf on these inputs: 'out'" in out
    assert "final model equal to the source" in out and "DIFFERS" not in out


def test_a_candidate_that_differs_where_the_source_is_nan_fails():
    from onnxopt.loading import load_model
    from onnxopt.verify import Verifier

    verifier = Verifier(load_model(_sqrt_model(abs_first=False)))
    try:
        assert verifier(load_model(_sqrt_model(abs_first=False))).ok
        assert not verifier(load_model(_sqrt_model(abs_first=True))).ok  # finite where the source is NaN
    finally:
        verifier.close()
    assert any("NaN or inf" in note for note in verifier.notes)


# ------------------------------------------------------------------------ library log lines


def test_no_library_log_lines_reach_the_user(tmp_path, capsys, plugins):  # noqa: F811
    """Polygraphy's [E] lines (and graphsurgeon's [W]/[C]) stayed on screen above onnxopt's own line."""
    onnx.save(linear_model()[0], tmp_path / "in.onnx")  # test-add-to-sub: its Add becomes a Sub
    code, out, err = run_cli(capsys, ["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"),
                                      "--passes", "test-add-to-sub", "--verify"])
    assert code == 1
    for line in (out + err).splitlines():
        assert not line.lstrip().startswith(("[W]", "[E]", "[C]", "[I]")), line
    assert err.strip().count("\n") == 0 and "verification failed at pass 'test-add-to-sub'" in err


def test_debug_still_shows_the_library_lines(tmp_path, capsys, plugins):  # noqa: F811
    onnx.save(linear_model()[0], tmp_path / "in.onnx")
    code, out, err = run_cli(capsys, ["--debug", "optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"),
                                      "--passes", "test-add-to-sub", "--verify"])
    assert code == 1 and "[E]" in out + err


def test_a_candidate_whose_output_changed_shape_fails_verification():
    """Polygraphy answers a shape mismatch with a bare False: the summary crashed on it (exit 3)."""
    from onnxopt.loading import load_model
    from onnxopt.verify import Verifier

    source = make_model([helper.make_node("Identity", ["x"], ["out"])], [tensor("x", [2, 3])], [tensor("out", [2, 3])])
    doubled = make_model([helper.make_node("Concat", ["x", "x"], ["out"], axis=0)], [tensor("x", [2, 3])], [tensor("out", [4, 3])])
    verifier = Verifier(load_model(source))
    try:
        outcome = verifier(load_model(doubled))
    finally:
        verifier.close()
    assert not outcome.ok and "output 'out' has another shape than the source's" in outcome.message


@pytest.mark.parametrize("low", [T.BFLOAT16, T.FLOAT16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("passes", ["cleanup", "ort-cuda"])
def test_low_precision_arithmetic_inside_a_float32_graph_verifies(tmp_path, capsys, low, passes):
    """ORT CPU has no bfloat16 Add: the source crashed verification (exit 3); both now run on the reference kernels."""
    proto = make_model([helper.make_node("Cast", ["x"], ["low"], to=low), helper.make_node("Add", ["low", "low"], ["sum"]),
                        helper.make_node("Cast", ["sum"], ["wide"], to=T.FLOAT), helper.make_node("Identity", ["wide"], ["out"])],
                       [tensor("x", [2, 3])], [tensor("out", [2, 3])])
    onnx.save(proto, tmp_path / "in.onnx")
    code, out, err = run_cli(capsys, ["optimize", "-q", "-i", str(tmp_path / "in.onnx"), "-o", str(tmp_path / "out.onnx"),
                                      "--passes", passes, "--verify"])
    assert code == 0, err


def test_a_dim_no_input_has_is_refused_not_ignored(tmp_path, capsys):
    """--dim batchh=4 (a typo of batch) used to be ignored: verify ran at the default batch."""
    from tests.conftest import FIXTURES

    fixture = FIXTURES / "unet-sd15.tiny.torchscript.dynamic.sdpa.onnx"
    out = tmp_path / "o.onnx"
    code = main(["optimize", "-i", str(fixture), "-o", str(out), "--verify", "--dim", "batchh=4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "no input of the model has a dim named 'batchh'" in err
    assert not out.exists()
    assert main(["optimize", "-i", str(fixture), "-o", str(out), "-q", "--dim", "batch=1"]) == 0  # a real dim: fine
