"""Claims about fuse-group-norm and fuse-skip-group-norm.

* On real tiny exports (``@pytest.mark.models``): every nn.GroupNorm of the torch model becomes one
  com.microsoft GroupNorm or SkipGroupNorm, every GroupNorm that feeds an nn.SiLU absorbs it, and the
  fused graph computes what the export computes.
* On hand-built graphs: the forms that must fuse do, in exactly the NHWC form the NHWC pass expects,
  and the lookalikes that must not fuse are refused with a reason.

Fused graphs run on onnx.reference with onnxopt's NumPy kernels (ORT's CPU EP has no GroupNorm).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import reference
from onnxopt.verify import assert_same_computation
from tests.conftest import EXPORT_VARIANTS, nodes_of, op_counts, result_of, run_passes


# ---------------------------------------------------------------- helpers


class ProtoBuilder:
    """Builds small ModelProtos: ``y = b.node("Add", x, b.const(...))``; names are generated."""

    def __init__(self, seed: int = 0):
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self.rng = np.random.default_rng(seed)
        self._k = 0

    def _name(self, prefix):
        self._k += 1
        return f"{prefix}{self._k}"

    def input(self, name, shape, dtype=TensorProto.FLOAT):
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def const(self, value, dtype=None):
        array = np.asarray(value)
        array = array.astype(dtype or (np.float32 if array.dtype.kind == "f" else np.int64))
        name = self._name("c")
        self.inits.append(numpy_helper.from_array(array, name))
        return name

    def random(self, shape):
        return self.const(self.rng.standard_normal(shape).astype(np.float32))

    def node(self, op_type, *inputs, outputs=1, domain=None, **attrs):
        outs = [self._name(f"{op_type.lower()}_out") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self._name(op_type), domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def output(self, name, shape=None):
        self.outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None if shape is None else list(shape)))

    def model(self, opset=17) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "g", self.inputs, self.outputs, self.inits)
        imports = [helper.make_opsetid("", opset)]
        if any(n.domain == "com.microsoft" for n in self.nodes):
            imports.append(helper.make_opsetid("com.microsoft", 1))
        model = helper.make_model(graph, opset_imports=imports)
        model.ir_version = 8
        return model


def exported_group_norm(b, x, channels, groups, *, rank=4, restore="shape", in_scale=None, gamma_shape=None, eps=1e-5,
                        affine=("gamma", "beta"), gamma=None, beta=None):
    """nn.GroupNorm as the exporters write it: Reshape, InstanceNormalization, Reshape, Mul, Add
    (``affine`` names the ones written: without "gamma" no Mul, without "beta" no Add)."""
    grouped = b.node("Reshape", x, b.const([0, groups, -1]))
    scale = b.const(np.ones(groups) if in_scale is None else in_scale)
    normed = b.node("InstanceNormalization", grouped, scale, b.const(np.zeros(groups)), epsilon=eps)
    shape = b.node("Shape", x) if restore == "shape" else b.const(restore)
    restored = b.node("Reshape", normed, shape)
    gamma_shape = gamma_shape or (channels,) + (1,) * (rank - 2)
    y = restored
    if "gamma" in affine:
        y = b.node("Mul", y, b.random(gamma_shape) if gamma is None else b.const(gamma))
    if "beta" in affine:
        y = b.node("Add", y, b.random(gamma_shape) if beta is None else b.const(beta))
    return y


def silu(b, y, *, sigmoid_first=False):
    sig = b.node("Sigmoid", y)
    return b.node("Mul", sig, y) if sigmoid_first else b.node("Mul", y, sig)


X_SHAPE = ["batch", 8, 4, 3]
FEED = {"x": (2, 8, 4, 3)}


def group_norm_model(**kwargs):
    b = ProtoBuilder()
    x = b.input("x", kwargs.pop("x_shape", X_SHAPE))
    with_silu = kwargs.pop("with_silu", False)
    y = exported_group_norm(b, x, 8, 4, **kwargs)
    b.output(silu(b, y) if with_silu else y)
    return b.model()


def assert_refused(report, pass_name, reason_part):
    result = result_of(report, pass_name)
    assert result.sites_matched == 1 and result.sites_rewritten == 0
    assert len(result.refused) == 1
    assert reason_part in result.refused[0][1], result.refused[0][1]


def assert_nhwc_group_norm(node, *, groups, activation, channels):
    """The exact form the NHWC pass expects: Transpose(0,2,3,1) -> GroupNorm(NHWC) -> Transpose(0,3,1,2)."""
    before = node.inputs[0].inputs[0]
    after = node.outputs[0].outputs
    assert before.op == "Transpose" and before.attrs["perm"] == [0, 2, 3, 1]
    assert [c.op for c in after] == ["Transpose"] and after[0].attrs["perm"] == [0, 3, 1, 2]
    assert node.domain == "com.microsoft"
    assert node.attrs["channels_last"] == 1 and node.attrs["groups"] == groups and node.attrs["activation"] == activation
    for const in node.inputs[1:3]:
        assert const.values.dtype == np.float32 and const.values.shape == (channels,)


# ---------------------------------------------------------------- hand-built: what fuses


@pytest.mark.parametrize("restore", ["shape", [2, 8, 4, 3]], ids=["Shape(x)", "constant"])
def test_the_exported_group_norm_becomes_an_nhwc_group_norm_between_two_transposes(restore):
    x_shape = X_SHAPE if restore == "shape" else [2, 8, 4, 3]
    proto = group_norm_model(restore=restore, x_shape=x_shape)
    model, report = run_passes(proto, ["fuse-group-norm"])

    result = result_of(report, "fuse-group-norm")
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (1, 1, [])
    assert result.details["with_silu"] == 0
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=0, channels=8)
    assert gn.attrs["epsilon"] == pytest.approx(1e-5)
    assert sorted(op_counts(model)) == ["GroupNorm", "Transpose"]
    assert_same_computation(proto, model, inputs=None if restore != "shape" else _spec(FEED))


@pytest.mark.parametrize("sigmoid_first", [False, True], ids=["Mul(y,Sigmoid(y))", "Mul(Sigmoid(y),y)"])
def test_a_following_silu_in_either_operand_order_becomes_activation_1(sigmoid_first):
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    b.output(silu(b, exported_group_norm(b, x, 8, 4), sigmoid_first=sigmoid_first))
    proto = b.model()

    model, report = run_passes(proto, ["fuse-group-norm"])

    assert result_of(report, "fuse-group-norm").details["with_silu"] == 1
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=1, channels=8)
    assert not nodes_of(model, "Sigmoid") and not nodes_of(model, "Mul")
    assert_same_computation(proto, model, inputs=_spec(FEED))


def test_a_silu_whose_input_has_another_consumer_stays_and_the_group_norm_fuses_without_it():
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    y = exported_group_norm(b, x, 8, 4)
    b.output(silu(b, y))
    b.output(b.node("Neg", y))  # the pre-SiLU value is used elsewhere too
    proto = b.model()

    model, report = run_passes(proto, ["fuse-group-norm"])

    result = result_of(report, "fuse-group-norm")
    assert (result.sites_matched, result.sites_rewritten, result.details["with_silu"]) == (1, 1, 0)
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=0, channels=8)
    sigmoid = nodes_of(model, "Sigmoid")[0]
    assert sigmoid.inputs[0].inputs[0].op == "Transpose"  # the SiLU reads the GroupNorm's (NCHW) output
    assert_same_computation(proto, model, inputs=_spec(FEED))


def test_the_standard_group_normalization_op_of_opset_21_fuses():
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    y = b.node("GroupNormalization", x, b.random((8,)), b.random((8,)), num_groups=4, epsilon=1e-4)
    b.output(silu(b, y))
    proto = b.model(opset=21)

    model, report = run_passes(proto, ["fuse-group-norm"])

    result = result_of(report, "fuse-group-norm")
    assert (result.sites_rewritten, result.details) == (1, {"with_silu": 1, "forms": {"group_normalization": 1}})
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=1, channels=8)
    assert gn.attrs["epsilon"] == pytest.approx(1e-4)
    assert_same_computation(proto, model, inputs=_spec(FEED))


def test_an_fp16_group_norm_keeps_fp16_activations_and_gets_float32_gamma_and_beta():
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE, TensorProto.FLOAT16)
    grouped = b.node("Reshape", x, b.const([0, 4, -1]))
    normed = b.node("InstanceNormalization", grouped, b.const(np.ones(4), np.float16), b.const(np.zeros(4), np.float16))
    restored = b.node("Reshape", normed, b.node("Shape", x))
    gamma, beta = (b.const(b.rng.standard_normal((8, 1, 1)), np.float16) for _ in range(2))
    y = silu(b, b.node("Add", b.node("Mul", restored, gamma), beta))
    b.outputs.append(helper.make_tensor_value_info(y, TensorProto.FLOAT16, None))
    proto = b.model()

    model, _ = run_passes(proto, ["fuse-group-norm"])

    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=1, channels=8)  # gamma, beta: float32 (C,)
    assert gn.inputs[0].dtype == np.float16 and gn.outputs[0].dtype == np.float16
    assert_same_computation(proto, model, atol=1e-2, rtol=1e-2, inputs=_spec(FEED))


@pytest.mark.parametrize("alpha, folded", [(1.0, True), (2.0, False)])
def test_an_opset_24_swish_is_folded_only_when_it_is_silu(alpha, folded):
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    y = b.node("GroupNormalization", x, b.random((8,)), b.random((8,)), num_groups=4)
    b.output(b.node("Swish", y, alpha=alpha))
    proto = b.model(opset=24)

    model, report = run_passes(proto, ["fuse-group-norm"])

    assert result_of(report, "fuse-group-norm").details["with_silu"] == int(folded)
    (gn,) = nodes_of(model, "GroupNorm")
    assert gn.attrs["activation"] == int(folded)
    assert len(nodes_of(model, "Swish")) == int(not folded)
    assert_same_computation(proto, model, inputs=_spec(FEED))


def test_a_vae_attention_group_norm_of_a_flattened_4d_tensor_normalizes_the_4d_tensor():
    """diffusers' Attention normalizes x4.view(N, C, H*W): the GroupNorm reads x4, a Reshape follows."""
    b = ProtoBuilder()
    x4 = b.input("x4", X_SHAPE)
    x3 = b.node("Reshape", x4, b.const([0, 8, -1]))
    y = exported_group_norm(b, x3, 8, 4, rank=3)  # γ, β of shape (C, 1)
    b.output(b.node("Transpose", y, perm=[0, 2, 1]))
    proto = b.model()

    model, report = run_passes(proto, ["fuse-group-norm"])

    assert result_of(report, "fuse-group-norm").details["forms"] == {"instance_norm, 3-D input": 1}
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=0, channels=8)
    assert gn.inputs[0].inputs[0].inputs[0].name == "x4"
    assert [c.op for c in gn.outputs[0].outputs[0].outputs[0].outputs] == ["Reshape"]
    assert_same_computation(proto, model, inputs=_spec({"x4": (2, 8, 4, 3)}))


def test_any_other_3d_input_is_unsqueezed_to_4d_and_squeezed_back():
    b = ProtoBuilder()
    x = b.input("x", ["batch", 8, 12])
    b.output(exported_group_norm(b, x, 8, 4, rank=3))
    proto = b.model()

    model, _ = run_passes(proto, ["fuse-group-norm"])

    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=0, channels=8)
    assert gn.inputs[0].inputs[0].inputs[0].inputs[0].op == "Unsqueeze"
    assert [c.op for c in gn.outputs[0].outputs[0].outputs[0].outputs] == ["Squeeze"]
    assert_same_computation(proto, model, inputs=_spec({"x": (2, 8, 12)}))


@pytest.mark.parametrize("with_silu", [False, True], ids=["alone", "+SiLU"])
@pytest.mark.parametrize("affine", [("gamma",), ("beta",), ()], ids=["no-Add(β=0)", "no-Mul(γ=1)", "neither"])
def test_a_group_norm_without_its_add_or_mul_is_still_a_group_norm_with_zero_beta_or_unit_gamma(affine, with_silu):
    proto = group_norm_model(affine=affine, with_silu=with_silu)
    model, report = run_passes(proto, ["fuse-group-norm"])

    result = result_of(report, "fuse-group-norm")
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (1, 1, [])
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=int(with_silu), channels=8)
    if "gamma" not in affine:
        assert np.all(gn.inputs[1].values == 1)
    if "beta" not in affine:
        assert np.all(gn.inputs[2].values == 0)
    assert sorted(op_counts(model)) == ["GroupNorm", "Transpose"]
    assert_same_computation(proto, model, inputs=_spec(FEED))


@pytest.mark.parametrize("restore", ["shape", [2, 8, 4, 3]], ids=["Shape(x)", "constant"])
def test_a_zero_beta_and_unit_gamma_removed_by_cleanup_still_fuse_under_ort_cuda(restore):
    # nn.GroupNorm as initialized (γ = 1, β = 0): cleanup and canonicalize-attention drop the `+ 0`
    # (and a scalar `* 1`) before fuse-group-norm runs.
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE if restore == "shape" else [2, 8, 4, 3])
    y = exported_group_norm(b, x, 8, 4, restore=restore, gamma=np.ones(1), beta=np.zeros((8, 1, 1)))
    b.output(silu(b, y))
    proto = b.model()

    model, report = run_passes(proto, ["ort-cuda"])

    result = result_of(report, "fuse-group-norm")
    assert (result.sites_rewritten, result.refused) == (1, [])
    assert not nodes_of(model, "InstanceNormalization") and not nodes_of(model, "Add")
    (gn,) = nodes_of(model, "GroupNorm")
    assert gn.attrs["activation"] == 1
    assert_same_computation(proto, model, inputs=_spec(FEED))


def test_a_group_norm_with_both_affine_ops_is_taken_whole_not_without_its_add():
    proto = group_norm_model()
    model, report = run_passes(proto, ["fuse-group-norm"])
    assert not nodes_of(model, "Add") and not nodes_of(model, "Mul")
    (gn,) = nodes_of(model, "GroupNorm")
    assert not np.all(gn.inputs[2].values == 0)
    assert_same_computation(proto, model, inputs=_spec(FEED))


# ---------------------------------------------------------------- hand-built: lookalikes that must not fuse


def test_a_non_unit_instance_norm_scale_is_refused():
    proto = group_norm_model(in_scale=np.array([1.0, 2.0, 1.0, 1.0]))
    model, report = run_passes(proto, ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "InstanceNormalization scale is not all ones")
    assert not nodes_of(model, "GroupNorm") and nodes_of(model, "InstanceNormalization")


def test_a_bare_grouped_instance_norm_with_a_per_group_scale_is_refused():
    proto = group_norm_model(in_scale=np.array([1.0, 2.0, 1.0, 1.0]), affine=())
    model, report = run_passes(proto, ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "InstanceNormalization scale is not all ones")
    assert not nodes_of(model, "GroupNorm") and nodes_of(model, "InstanceNormalization")


@pytest.mark.parametrize("affine", [("gamma",), ("beta",)], ids=["Mul", "Add"])
def test_a_lone_mul_or_add_that_is_not_per_channel_is_refused(affine):
    # (C,) broadcasts along W (here W == C == 8), not along the channels
    proto = group_norm_model(affine=affine, gamma_shape=(8,), x_shape=["batch", 8, 4, 8])
    model, report = run_passes(proto, ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "not per channel for a 4-D input (want (8, 1, 1))")
    assert not nodes_of(model, "GroupNorm")


def test_a_gamma_that_is_not_per_channel_is_refused():
    # γ of shape (C,) broadcasts along W (here W == C == 8), not along the channels
    proto = group_norm_model(gamma_shape=(8,), x_shape=["batch", 8, 4, 8])
    model, report = run_passes(proto, ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "not per channel for a 4-D input (want (8, 1, 1))")
    assert not nodes_of(model, "GroupNorm")


def test_a_second_reshape_that_does_not_restore_the_input_shape_is_refused():
    proto = group_norm_model(restore=[2, 8, 3, 4], x_shape=[2, 8, 4, 3])  # H and W swapped: same size
    model, report = run_passes(proto, ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "does not provably restore the input's shape [2, 8, 4, 3]")
    assert not nodes_of(model, "GroupNorm")


def test_a_group_count_that_does_not_divide_the_channels_is_refused():
    b = ProtoBuilder()
    x = b.input("x", ["batch", 6, 4, 4])
    b.output(exported_group_norm(b, x, 6, 4))  # (N, 4, 24): groups straddle channels
    model, report = run_passes(b.model(), ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "group count 4 does not divide the channel count 6")


def test_an_odd_channel_count_per_group_is_refused_because_the_cuda_kernel_rejects_it():
    b = ProtoBuilder()
    x = b.input("x", ["batch", 6, 4, 4])
    b.output(exported_group_norm(b, x, 6, 2))
    model, report = run_passes(b.model(), ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "3 channels per group: ORT's CUDA GroupNorm kernel needs an even number")


def test_an_opset_18_group_normalization_fuses_with_its_per_group_scale_repeated_over_each_group():
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    scale, bias = b.rng.standard_normal((2, 4)).astype(np.float32)  # one value per group: 8 channels, 4 groups
    b.output(b.node("GroupNormalization", x, b.const(scale), b.const(bias), num_groups=4, epsilon=1e-5))
    proto = b.model(opset=18)

    model, report = run_passes(proto, ["fuse-group-norm"])

    assert result_of(report, "fuse-group-norm").sites_rewritten == 1
    (gn,) = nodes_of(model, "GroupNorm")
    assert_nhwc_group_norm(gn, groups=4, activation=0, channels=8)
    np.testing.assert_array_equal(gn.inputs[1].values, np.repeat(scale, 2))
    np.testing.assert_array_equal(gn.inputs[2].values, np.repeat(bias, 2))
    # GroupNormalization-18 as its spec defines it, in NumPy: the fused graph computes exactly that
    feed = np.random.default_rng(1).standard_normal(FEED["x"]).astype(np.float32)
    grouped = feed.reshape(2, 4, -1)
    normed = (grouped - grouped.mean(-1, keepdims=True)) / np.sqrt(grouped.var(-1, keepdims=True) + 1e-5)
    expected = normed * scale[:, None] + bias[:, None]
    (got,) = reference.run(model.to_onnx(), {"x": feed}).values()
    np.testing.assert_allclose(got.reshape(2, 4, -1), expected, atol=1e-5, rtol=1e-4)


def test_a_group_normalization_scale_of_the_wrong_size_for_its_opset_is_refused():
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    b.output(b.node("GroupNormalization", x, b.random((8,)), b.random((8,)), num_groups=4))  # per channel in opset 18
    model, report = run_passes(b.model(opset=18), ["fuse-group-norm"])
    assert_refused(report, "fuse-group-norm", "expected (4,): per group (opset < 21)")
    assert nodes_of(model, "GroupNormalization") and not nodes_of(model, "GroupNorm")


def test_the_refusals_are_in_the_report_table():
    _, report = run_passes(group_norm_model(in_scale=np.full(4, 3.0)), ["fuse-group-norm"])
    assert "fuse-group-norm: refused 1 site(s): InstanceNormalization scale is not all ones" in report.table()


# ---------------------------------------------------------------- hand-built: SkipGroupNorm


def test_a_residual_sum_in_front_of_a_group_norm_becomes_skip_group_norm_with_the_sum_output():
    b = ProtoBuilder()
    a, c = b.input("a", X_SHAPE), b.input("c", X_SHAPE)
    s = b.node("Add", a, c)
    b.output(silu(b, exported_group_norm(b, s, 8, 4)))
    b.output(b.node("Neg", s))  # the residual path reads the sum
    proto = b.model()

    model, report = run_passes(proto, ["fuse-group-norm", "fuse-skip-group-norm"])

    result = result_of(report, "fuse-skip-group-norm")
    assert (result.sites_matched, result.sites_rewritten) == (1, 1)
    assert result.details == {"full skip": 1, "with S output": 1}
    (sgn,) = nodes_of(model, "SkipGroupNorm")
    assert not nodes_of(model, "GroupNorm") and not nodes_of(model, "Add")
    assert sgn.attrs["activation"] == 1 and sgn.attrs["channels_last"] == 1 and sgn.attrs["groups"] == 4
    assert [t.inputs[0].attrs["perm"] for t in (sgn.inputs[0], sgn.inputs[3])] == [[0, 2, 3, 1]] * 2
    s_out = sgn.outputs[1].outputs
    assert [n.op for n in s_out] == ["Transpose"] and s_out[0].attrs["perm"] == [0, 3, 1, 2]
    assert [n.op for n in s_out[0].outputs[0].outputs] == ["Neg"]
    assert_same_computation(proto, model, inputs=_spec({"a": (2, 8, 4, 3), "c": (2, 8, 4, 3)}))


@pytest.mark.parametrize("affine", [("gamma",), ()], ids=["β=0", "γ=1,β=0"])
def test_a_residual_sum_in_front_of_a_group_norm_without_its_add_becomes_skip_group_norm(affine):
    b = ProtoBuilder()
    a, c = b.input("a", X_SHAPE), b.input("c", X_SHAPE)
    b.output(silu(b, exported_group_norm(b, b.node("Add", a, c), 8, 4, affine=affine)))
    proto = b.model()

    model, report = run_passes(proto, ["fuse-group-norm", "fuse-skip-group-norm"])

    assert result_of(report, "fuse-skip-group-norm").sites_rewritten == 1
    (sgn,) = nodes_of(model, "SkipGroupNorm")
    assert not nodes_of(model, "Add") and np.all(sgn.inputs[2].values == 0)
    assert_same_computation(proto, model, inputs=_spec({"a": (2, 8, 4, 3), "c": (2, 8, 4, 3)}))


def test_a_broadcast_time_embedding_becomes_an_nc_skip_without_a_sum_output():
    b = ProtoBuilder()
    h, temb = b.input("h", X_SHAPE), b.input("temb", ["batch", 8])
    s = b.node("Add", h, b.node("Unsqueeze", temb, b.const([2, 3])))  # (N, C, 1, 1)
    b.output(silu(b, exported_group_norm(b, s, 8, 4)))
    proto = b.model()

    model, report = run_passes(proto, ["fuse-group-norm", "fuse-skip-group-norm"])

    assert result_of(report, "fuse-skip-group-norm").details == {"broadcast skip": 1, "without S output": 1}
    (sgn,) = nodes_of(model, "SkipGroupNorm")
    assert len(sgn.outputs) == 1
    flatten = sgn.inputs[3].inputs[0]
    assert flatten.op == "Flatten" and flatten.attrs["axis"] == 1  # (N, C, 1, 1) -> (N, C)
    assert sgn.inputs[0].inputs[0].inputs[0].name == "h"
    assert_same_computation(proto, model, inputs=_spec({"h": (2, 8, 4, 3), "temb": (2, 8)}))


def test_an_operand_that_comes_from_nhwc_is_read_without_a_transpose_pair():
    b = ProtoBuilder()
    q, c = b.input("q", ["batch", 4, 3, 8]), b.input("c", X_SHAPE)
    s = b.node("Add", b.node("Transpose", q, perm=[0, 3, 1, 2]), c)
    b.output(exported_group_norm(b, s, 8, 4))
    proto = b.model()

    model, _ = run_passes(proto, ["fuse-group-norm", "fuse-skip-group-norm"])

    (sgn,) = nodes_of(model, "SkipGroupNorm")
    assert "q" in {t.name for t in sgn.inputs}
    assert len(nodes_of(model, "Transpose")) == 2  # c's to NHWC, Y's back to NCHW
    assert_same_computation(proto, model, inputs=_spec({"q": (2, 4, 3, 8), "c": (2, 8, 4, 3)}))


def test_a_sum_in_front_of_an_nhwc_group_norm_fuses_as_it_is():
    b = ProtoBuilder()
    a, c = b.input("a", ["batch", 4, 3, 8]), b.input("c", ["batch", 1, 1, 8])
    s = b.node("Add", a, c)
    y = b.node("GroupNorm", s, b.random((8,)), b.random((8,)), domain="com.microsoft",
               groups=4, activation=0, epsilon=1e-5, channels_last=1)
    b.output(y)
    b.output(s)  # the sum is a graph output: S provides it, under its name
    proto = b.model()

    model, report = run_passes(proto, ["fuse-skip-group-norm"])

    assert result_of(report, "fuse-skip-group-norm").details == {"broadcast skip": 1, "with S output": 1}
    (sgn,) = nodes_of(model, "SkipGroupNorm")
    assert [t.name for t in sgn.inputs[::3]] == ["a", "c"]
    assert [t.name for t in model.graph.outputs] == [proto.graph.output[0].name, s]
    assert sgn.outputs[1].name == s
    assert_same_computation(proto, model, inputs=_spec({"a": (2, 4, 3, 8), "c": (2, 1, 1, 8)}))


def test_a_sum_with_a_constant_is_a_bias_not_a_skip_and_is_refused():
    b = ProtoBuilder()
    x = b.input("x", X_SHAPE)
    s = b.node("Add", x, b.random((8, 1, 1)))
    b.output(exported_group_norm(b, s, 8, 4))
    model, report = run_passes(b.model(), ["fuse-group-norm", "fuse-skip-group-norm"])
    assert_refused(report, "fuse-skip-group-norm", "constant (a bias, not a skip)")
    assert nodes_of(model, "GroupNorm") and nodes_of(model, "Add")


def test_a_skip_that_broadcasts_over_the_batch_is_refused():
    b = ProtoBuilder()
    h, temb = b.input("h", [2, 8, 4, 3]), b.input("temb", [1, 8, 1, 1])
    b.output(exported_group_norm(b, b.node("Add", h, temb), 8, 4))
    model, report = run_passes(b.model(), ["fuse-group-norm", "fuse-skip-group-norm"])
    assert_refused(report, "fuse-skip-group-norm", "batch 1")
    assert nodes_of(model, "GroupNorm")


def _spec(shapes):
    from onnxopt.verify import InputSpec

    return InputSpec(shapes={k: tuple(v) for k, v in shapes.items()})


# ---------------------------------------------------------------- real exports


def group_norms_feeding_silu(built) -> int:
    """How many nn.GroupNorm outputs the torch model feeds straight into an nn.SiLU."""
    import torch
    import torch.nn as nn

    outputs, fed = {}, 0

    def after_norm(module, args, out):
        outputs[id(out)] = out  # keep it alive: ids must not be reused during the forward

    def before_silu(module, args):
        nonlocal fed
        fed += id(args[0]) in outputs

    modules = list(built.module.modules())
    handles = [m.register_forward_hook(after_norm) for m in modules if isinstance(m, nn.GroupNorm)]
    handles += [m.register_forward_pre_hook(before_silu) for m in modules if isinstance(m, nn.SiLU)]
    try:
        with torch.no_grad():
            built.module(*built.example_inputs)
    finally:
        for h in handles:
            h.remove()
    return fed


_SILU_CACHE: dict[str, int] = {}

# Every exporter x shapes combination for unet-sd15 and vae-decoder; one each for the other families
# (exports dominate the run time: about 10-60 s each on 2 cores).
_SDPA_VARIANTS = [v for v in EXPORT_VARIANTS if v[2] == "sdpa"]
_OTHER_FAMILIES = {
    "unet-sd21": ("dynamo", "static", "sdpa"),
    "unet-sdxl": ("torchscript", "dynamic", "sdpa"),
    "vae-encoder": ("dynamo", "dynamic", "sdpa"),
    "controlnet": ("torchscript", "static", "sdpa"),
}
EXPORT_CASES = [(f, *v) for f in ("unet-sd15", "vae-decoder") for v in _SDPA_VARIANTS]
EXPORT_CASES += [(f, *v) for f, v in _OTHER_FAMILIES.items()]
RAW_CASES = [
    ("unet-sd15", "torchscript", "dynamic", "sdpa"),
    ("unet-sd15", "dynamo", "dynamic", "sdpa"),
    ("vae-decoder", "dynamo", "dynamic", "sdpa"),
]


def _case_id(case):
    return "-".join(case)


def _check_fused_export(exported, model, report):
    expected = exported.sites["group_norm"]
    gn = result_of(report, "fuse-group-norm")
    assert (gn.sites_matched, gn.sites_rewritten, gn.refused) == (expected, expected, [])
    family = exported.built.family
    if family not in _SILU_CACHE:
        _SILU_CACHE[family] = group_norms_feeding_silu(exported.built)
    assert gn.details["with_silu"] == _SILU_CACHE[family]
    skip = result_of(report, "fuse-skip-group-norm")
    assert skip.refused == []
    ops = op_counts(model)
    assert ops["SkipGroupNorm"] == skip.sites_rewritten
    assert ops["GroupNorm"] + ops["SkipGroupNorm"] == expected
    assert ops["InstanceNormalization"] == 0 and ops["GroupNormalization"] == 0
    return ops


@pytest.mark.models
@pytest.mark.parametrize("family, exporter, shapes, attention", EXPORT_CASES, ids=map(_case_id, EXPORT_CASES))
def test_every_group_norm_of_the_cleaned_export_fuses_and_the_model_computes_the_same(
    export_tiny, family, exporter, shapes, attention
):
    exported = export_tiny(family, exporter, shapes, attention)

    model, report = run_passes(exported.path, ["cleanup", "fuse-group-norm", "fuse-skip-group-norm"])

    _check_fused_export(exported, model, report)
    assert_same_computation(exported.path, model, inputs=exported.input_spec())


@pytest.mark.models
@pytest.mark.parametrize("family, exporter, shapes, attention", RAW_CASES, ids=map(_case_id, RAW_CASES))
def test_the_raw_dynamic_export_fuses_without_cleanup(export_tiny, family, exporter, shapes, attention):
    """Shape-derived restore shapes, Constant nodes, no folding: infer-shapes is all the passes need."""
    exported = export_tiny(family, exporter, shapes, attention)

    model, report = run_passes(exported.path, ["fuse-group-norm", "fuse-skip-group-norm"])

    assert [p.name for p in report.passes][0] == "infer-shapes"  # inserted for the requirement
    _check_fused_export(exported, model, report)
    assert_same_computation(exported.path, model, inputs=exported.input_spec())
