"""Claims about fuse-parallel-gemm (Linears reading one tensor -> one Gemm + Split).

On the tiny SD 1.5 UNet, exported by TorchScript and dynamo with static and dynamic shapes
(``@pytest.mark.models``), after ``cleanup``:
* both exporters write every ResnetBlock2D's ``time_emb_proj`` as a Gemm(transB=1) reading one
  shared SiLU(temb) tensor, and the pass merges exactly those: as many members as the torch model
  has time_emb_proj Linears, one group, nothing refused; one Gemm is left for them, its weight the
  members' side by side, and a Split hands each member's tensor to its old consumers;
* the result computes what the source computes (ORT CPU), also at other dims for dynamic exports.

Hand-built graphs: transB=0 and 1 in one group (either majority), members without bias, the
MatMul(+Add) form, lookalikes that must not merge (different inputs, alpha/beta/transA, a
computed weight or bias, a C that is not per column, a 3-D MatMul), 3-D MatMuls that only
cross-attention reads as key/value (they merge; self-attention's and a query's do not), weights
derived lazily and saved, and the order the pass manager enforces (after fuse-attention) with
the reason for it.

After fuse-attention, on the same exports: every cross-attention's K and V projection of
encoder_hidden_states comes from one MatMul + Split.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxopt import load_model, optimize, save_model
from onnxopt.errors import PassOrderError
from onnxopt.manager import PassManager
from onnxopt.pass_infra import TARGETS
from onnxopt.registry import get_pass
from onnxopt.verify import InputSpec, assert_same_computation
from onnxopt.weights import DerivedValues, ExternalValues
from tests.conftest import EXPORT_VARIANTS, op_counts
from tests.graphs import make_model

F32 = TensorProto.FLOAT
PASS = "fuse-parallel-gemm"
RNG = np.random.default_rng(11)


def step(report, name: str = PASS):
    """The PassResult of ``name`` in a report."""
    return next(s.result for s in report.passes if s.name == name)


def merged_gemms(model) -> list[gs.Node]:
    """Gemms whose output only a Split reads: what the pass writes."""
    return [n for n in model.graph.nodes
            if n.op == "Gemm" and [c.op for c in n.outputs[0].outputs] == ["Split"]]


# ================================================================ real exports

UNET_VARIANTS = [pytest.param(v, id="-".join(v[:2])) for v in EXPORT_VARIANTS if v[2] == "sdpa"]


def time_emb_projections(built) -> list:
    """The torch model's ResnetBlock2D.time_emb_proj Linears, in module order."""
    import torch.nn as nn
    from diffusers.models.resnet import ResnetBlock2D

    return [m.time_emb_proj for m in built.module.modules()
            if isinstance(m, ResnetBlock2D) and isinstance(m.time_emb_proj, nn.Linear)]


_MERGED: dict[tuple, tuple] = {}


def merged_unet(export_tiny, variant):
    """(exported, cleaned-up source, merged model, report), once per variant."""
    if variant not in _MERGED:
        exported = export_tiny("unet-sd15", *variant)
        source, _ = optimize(exported.path, ["cleanup"])
        model, report = optimize(source, [PASS])
        _MERGED[variant] = (exported, source, model, report)
    return _MERGED[variant]


def projection_gemms(model) -> list[gs.Node]:
    """Gemms whose weight is a time_emb_proj parameter (the exporters keep parameter names)."""
    return [n for n in model.graph.nodes if n.op == "Gemm" and "time_emb_proj.weight" in n.inputs[1].name]


@pytest.mark.models
@pytest.mark.parametrize("variant", UNET_VARIANTS)
def test_every_time_embedding_projection_of_the_unet_merges_into_one_gemm(export_tiny, variant):
    exported, source, model, report = merged_unet(export_tiny, variant)
    projections = time_emb_projections(exported.built)
    n = len(projections)
    assert n == exported.sites["resnet"] and n > 1  # every ResnetBlock2D of SD 1.5 has one

    # What the exporter wrote: one Gemm(transB=1) per projection, all reading one tensor.
    written = projection_gemms(source)
    assert len(written) == n
    assert {g.attrs.get("transB") for g in written} == {1}
    assert len({id(g.inputs[0]) for g in written}) == 1

    result = step(report)
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (n, n, [])
    assert result.details == {"groups": 1, "members": n, "from_matmul": 0}

    ops_before, ops_after = op_counts(source), op_counts(model)
    assert ops_after["Gemm"] == ops_before["Gemm"] - n + 1
    assert ops_after["Split"] == ops_before["Split"] + 1
    assert projection_gemms(model) == []
    [gemm] = merged_gemms(model)
    assert gemm.inputs[0].name == written[0].inputs[0].name
    assert gemm.attrs["transB"] == 1
    out_features = [p.out_features for p in projections]
    assert tuple(gemm.inputs[1].shape) == (sum(out_features), projections[0].in_features)
    split = gemm.outputs[0].outputs[0]
    # Each member's tensor (same name) now comes out of the Split, in graph order.
    assert [t.name for t in split.outputs] == [g.outputs[0].name for g in written]
    assert split.inputs[1].values.tolist() == [g.inputs[1].shape[0] for g in written]
    assert sorted(split.inputs[1].values.tolist()) == sorted(out_features)
    # The members' initializers left the graph with them.
    assert [t.name for t in model.graph.tensors().values() if isinstance(t, gs.Constant) and "time_emb_proj" in t.name] == []

    assert_same_computation(source, model, atol=1e-5, rtol=1e-4, inputs=exported.input_spec())
    if variant[1] == "dynamic":
        built = exported.built
        other = InputSpec(shapes={k: tuple(v) for k, v in built.input_shapes(built.alt_dims).items()})
        assert_same_computation(source, model, atol=1e-5, rtol=1e-4, inputs=other)


@pytest.mark.models
def test_running_before_fuse_attention_costs_attention_fusions_so_the_manager_refuses_that_order(export_tiny):
    """The reason for runs_after: onnxopt's symbolic dims follow the batch through a Gemm, not a
    Split. On the TorchScript dynamic-axes export, fuse-attention run (separately) after this pass
    proves fewer Q Reshapes; run after fuse-attention, both fuse everything."""
    exported = export_tiny("unet-sd15", "torchscript", "dynamic", "sdpa")
    source, _ = optimize(exported.path, ["cleanup"])
    attentions = exported.sites["attention"]

    with pytest.raises(PassOrderError, match="must run after 'fuse-attention'"):
        PassManager([PASS, "fuse-attention"])

    right, report = optimize(source, ["fuse-attention", PASS])
    assert step(report, "fuse-attention").sites_rewritten == attentions
    cross_kv = 2 * exported.sites["attention_cross"]  # fuse-attention's default cross layout: K and V apart
    assert step(report).details["members"] == len(time_emb_projections(exported.built)) + cross_kv

    merged_first, _ = optimize(source, [PASS])
    _, report = optimize(merged_first, ["fuse-attention"])
    assert step(report, "fuse-attention").sites_rewritten < attentions
    assert_same_computation(source, right, atol=1e-4, rtol=1e-3, inputs=exported.input_spec())


@pytest.mark.models
@pytest.mark.parametrize("variant", UNET_VARIANTS)
def test_after_fuse_attention_every_cross_attention_k_and_v_comes_from_one_matmul(export_tiny, variant):
    """fuse-attention writes each cross-attention's K and V projection of encoder_hidden_states
    apart; all of them (2 per cross-attention of the torch model) become one MatMul and a Split
    whose outputs MultiHeadAttention reads as key and value. Self-attention's packed QKV and the
    image-token MatMuls stay as they were."""
    exported, source, _, _ = merged_unet(export_tiny, variant)
    fused, _ = optimize(source, ["fuse-attention"])
    model, report = optimize(fused, [PASS])
    cross, resnets = exported.sites["attention_cross"], exported.sites["resnet"]
    result = step(report)
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (resnets + 2 * cross,) * 2 + ([],)
    assert result.details == {"groups": 2, "members": resnets + 2 * cross, "from_matmul": 2 * cross}

    [matmul] = [n for n in model.graph.nodes if n.op == "MatMul" and [c.op for c in n.outputs[0].outputs] == ["Split"]]
    assert matmul.inputs[0].name == "encoder_hidden_states"
    split = matmul.outputs[0].outputs[0]
    assert len(split.outputs) == 2 * cross
    readers = [(c.op, list(c.inputs).index(t)) for t in split.outputs for c in t.outputs]
    assert readers == [("MultiHeadAttention", 1), ("MultiHeadAttention", 2)] * cross
    assert op_counts(model)["MatMul"] == op_counts(fused)["MatMul"] - 2 * cross + 1
    assert op_counts(model)["MultiHeadAttention"] == op_counts(fused)["MultiHeadAttention"] == exported.sites["attention"]
    assert_same_computation(source, model, atol=1e-5, rtol=1e-4, inputs=exported.input_spec())


def test_pass_is_registered_for_every_target():
    cls = get_pass(PASS)
    assert cls.targets == TARGETS and cls.is_fusion


# ================================================================ hand-built graphs

K = 6


class Linears:
    """A graph of Linears over graph inputs; every Linear's output is a graph output."""

    def __init__(self, x_shape=("batch", K)):
        self.nodes, self.initializers, self.outputs = [], [], []
        self.inputs = [helper.make_tensor_value_info("x", F32, list(x_shape))]
        self.values: dict[str, np.ndarray] = {}

    def const(self, name: str, value) -> str:
        value = np.asarray(value, dtype=np.float32)
        self.values[name] = value
        self.initializers.append(numpy_helper.from_array(value, name))
        return name

    def input(self, name: str, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, F32, list(shape)))
        return name

    def gemm(self, name: str, n: int, *, trans_b: int = 1, bias: bool | tuple = True, x: str = "x", w: str | None = None,
             **attrs) -> str:
        w = w or self.const(f"{name}.w", weights(n, K) if trans_b else weights(K, n))
        inputs = [x, w]
        if isinstance(bias, str):  # a tensor of the graph
            inputs.append(bias)
        elif bias:  # True: (n,); a tuple: that shape
            inputs.append(self.const(f"{name}.b", weights(*(bias if isinstance(bias, tuple) else (n,)))))
        self.nodes.append(helper.make_node("Gemm", inputs, [f"{name}.y"], name=name, transB=trans_b, **attrs))
        return self._out(f"{name}.y")

    def matmul(self, name: str, n: int, *, bias=True, x: str = "x") -> str:
        w = self.const(f"{name}.w", weights(K, n))
        if bias is False:
            self.nodes.append(helper.make_node("MatMul", [x, w], [f"{name}.y"], name=name))
            return self._out(f"{name}.y")
        b = self.const(f"{name}.b", weights(*(bias if isinstance(bias, tuple) else (n,))))
        self.nodes.append(helper.make_node("MatMul", [x, w], [f"{name}.p"], name=name))
        self.nodes.append(helper.make_node("Add", [f"{name}.p", b], [f"{name}.y"], name=f"{name}.add"))
        return self._out(f"{name}.y")

    def _out(self, name: str) -> str:
        self.outputs.append(helper.make_tensor_value_info(name, F32, None))
        return name

    def model(self) -> onnx.ModelProto:
        return make_model(self.nodes, self.inputs, self.outputs, self.initializers)


def weights(*shape) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


def merge(proto):
    model, report = optimize(proto, [PASS])
    return model, step(report)


def merged_values(model) -> tuple[gs.Node, np.ndarray, np.ndarray | None, list[int]]:
    [gemm] = merged_gemms(model)
    split = gemm.outputs[0].outputs[0]
    bias = np.asarray(gemm.inputs[2].values) if len(gemm.inputs) > 2 else None
    return gemm, np.asarray(gemm.inputs[1].values), bias, split.inputs[1].values.tolist()


@pytest.mark.parametrize("layouts, merged_trans_b", [((1, 0, 1), 1), ((0, 1, 0), 0), ((1, 0), 1)],
                         ids=["mostly-NK", "mostly-KN", "tie"])
def test_mixed_transb_members_merge_into_the_majority_layout(layouts, merged_trans_b):
    g = Linears()
    sizes = [4, 3, 5][: len(layouts)]
    biases = [True, False, (1, 5)][: len(layouts)]  # (N,), none, (1, N)
    for i, (trans_b, n, bias) in enumerate(zip(layouts, sizes, biases)):
        g.gemm(f"g{i}", n, trans_b=trans_b, bias=bias)
    proto = g.model()
    model, result = merge(proto)

    assert (result.sites_matched, result.sites_rewritten, result.refused) == (len(layouts), len(layouts), [])
    assert result.details == {"groups": 1, "members": len(layouts), "from_matmul": 0}
    assert op_counts(model) == Counter({"Gemm": 1, "Split": 1})
    gemm, w, b, split_sizes = merged_values(model)
    assert gemm.attrs["transB"] == merged_trans_b and split_sizes == sizes
    # The weight is every member's (N, K) block, in the merged layout.
    blocks = [g.values[f"g{i}.w"] if t else g.values[f"g{i}.w"].T for i, t in enumerate(layouts)]
    expected = np.concatenate(blocks, axis=0)
    np.testing.assert_array_equal(w, expected if merged_trans_b else expected.T)
    expected_bias = [g.values[f"g{i}.b"].reshape(-1) if bias else np.zeros(n, np.float32)
                     for i, (n, bias) in enumerate(zip(sizes, biases))]
    np.testing.assert_array_equal(b, np.concatenate(expected_bias))
    assert [t.name for t in gemm.outputs[0].outputs[0].outputs] == [f"g{i}.y" for i in range(len(layouts))]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


def test_members_without_any_bias_merge_into_a_gemm_without_c():
    g = Linears()
    g.gemm("a", 4, bias=False)
    g.gemm("b", 3, trans_b=0, bias=False)
    proto = g.model()
    model, result = merge(proto)
    assert (result.sites_matched, result.sites_rewritten) == (2, 2)
    gemm, _, b, sizes = merged_values(model)
    assert b is None and len(gemm.inputs) == 2 and sizes == [4, 3]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


def test_matmul_add_and_bare_matmul_members_merge_with_gemms():
    """MatMul + Add(bias (N,) or (1, N)) and a bare MatMul count as members; an Add whose constant is
    not one value per column is not a bias: its MatMul merges and the Add stays after the Split."""
    g = Linears()
    g.matmul("m0", 4)  # bias (4,)
    g.matmul("m1", 3, bias=False)
    g.matmul("m2", 2, bias=(1, 2))
    g.matmul("m3", 5, bias=(1,))  # a scalar-like constant broadcast over the columns: not a per-column bias
    g.gemm("g4", 3)  # transB=1
    proto = g.model()
    model, result = merge(proto)

    assert (result.sites_matched, result.sites_rewritten, result.refused) == (5, 5, [])
    assert result.details == {"groups": 1, "members": 5, "from_matmul": 4}
    assert op_counts(model) == Counter({"Gemm": 1, "Split": 1, "Add": 1})
    gemm, w, b, sizes = merged_values(model)
    assert gemm.attrs["transB"] == 0 and sizes == [4, 3, 2, 5, 3]  # four (K, N) members against one (N, K)
    np.testing.assert_array_equal(w, np.concatenate([g.values[f"m{i}.w"] for i in range(4)] + [g.values["g4.w"].T], axis=1))
    np.testing.assert_array_equal(b, np.concatenate([g.values["m0.b"], np.zeros(3), g.values["m2.b"].reshape(-1),
                                                     np.zeros(5), g.values["g4.b"]]).astype(np.float32))
    [add] = [n for n in model.graph.nodes if n.op == "Add"]
    assert add.inputs[0].inputs[0].op == "Split" and add.outputs[0].name == "m3.y"
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


def test_matmuls_of_a_3d_input_are_not_sites():
    """Attention's Q/K/V projections read one 3-D tensor: packing them is fuse-attention's job."""
    g = Linears(x_shape=("batch", 7, K))
    for i in range(3):
        g.matmul(f"qkv{i}", 4, bias=False)
    proto = g.model()
    model, result = merge(proto)
    assert (result.sites_matched, result.sites_rewritten) == (0, 0) and not result.modified
    assert "read the same tensor" in result.nothing_to_do
    assert op_counts(model) == Counter({"MatMul": 3})


C, HEADS = 4, 2  # attention width and heads of the hand-built cross-attentions


def attention_graph(blocks: int = 2, *, self_attention: bool = False, kv_bias: bool = False,
                    context_as_query: bool = False) -> onnx.ModelProto:
    """``blocks`` MultiHeadAttentions; each projects K and V of ``ctx`` (B, 5, K) by its own
    MatMuls [+ bias Add]. The query is an input of its own (cross-attention), MatMul(ctx, Wq)
    (``self_attention``), or MatMul(ctx, Wk) itself fed as query (``context_as_query``)."""
    nodes, inits, outputs = [], [], []
    inputs = [helper.make_tensor_value_info("ctx", F32, ["batch", 5, K])]

    def const(name, value):
        inits.append(numpy_helper.from_array(np.asarray(value, np.float32), name))
        return name

    for b in range(blocks):
        kv = {}
        for role in "kv":
            name = f"b{b}.{role}"
            nodes.append(helper.make_node("MatMul", ["ctx", const(f"{name}.w", weights(K, C))], [f"{name}.p" if kv_bias else name], name=name))
            if kv_bias:
                nodes.append(helper.make_node("Add", [f"{name}.p", const(f"{name}.b", weights(C))], [name], name=f"{name}.add"))
            kv[role] = name
        if self_attention:
            query = f"b{b}.q"
            nodes.append(helper.make_node("MatMul", ["ctx", const(f"{query}.w", weights(K, C))], [query], name=query))
        elif context_as_query:
            query = kv["k"]
        else:
            query = f"q{b}"
            inputs.append(helper.make_tensor_value_info(query, F32, ["batch", 3, C]))
        nodes.append(helper.make_node("MultiHeadAttention", [query, kv["k"], kv["v"]], [f"b{b}.out"], name=f"b{b}.mha",
                                      domain="com.microsoft", num_heads=HEADS))
        outputs.append(helper.make_tensor_value_info(f"b{b}.out", F32, None))
    return make_model(nodes, inputs, outputs, inits)


@pytest.mark.parametrize("kv_bias", [False, True], ids=["no-bias", "bias"])
def test_cross_attention_k_and_v_projections_of_one_context_merge_into_one_matmul(kv_bias):
    """3-D MatMuls are sites when only cross-attention reads them as key/value: a short text
    context read by every block. The merged form is MatMul [+ Add] + Split (Gemm is 2-D only)."""
    proto = attention_graph(3, kv_bias=kv_bias)
    model, result = merge(proto)
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (6, 6, [])
    assert result.details == {"groups": 1, "members": 6, "from_matmul": 6}
    [matmul] = [n for n in model.graph.nodes if n.op == "MatMul"]
    assert matmul.inputs[0].name == "ctx" and tuple(matmul.inputs[1].shape) == (K, 6 * C)
    assert op_counts(model) == Counter({"MatMul": 1, "Split": 1, "MultiHeadAttention": 3, **({"Add": 1} if kv_bias else {})})
    split = next(n for n in model.graph.nodes if n.op == "Split")
    assert [t.name for t in split.outputs] == [f"b{b}.{r}" for b in range(3) for r in "kv"]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("form", ["self_attention", "context_as_query"])
def test_3d_matmuls_that_self_attention_or_a_query_reads_are_not_sites(form):
    """Self-attention's K/V (its query is projected from the same tensor: thousands of image tokens
    in a UNet, where a Split copy costs more than the launches saved) and a product read as query
    are left to fuse-attention's layout."""
    proto = attention_graph(2, **{form: True})
    model, result = merge(proto)
    assert (result.sites_matched, result.sites_rewritten) == (0, 0) and not result.modified
    assert op_counts(model)["Split"] == 0


def test_gemms_reading_different_tensors_do_not_merge():
    g = Linears()
    g.input("x2", ["batch", K])
    g.gemm("a", 4)
    g.gemm("b", 4, x="x2")
    proto = g.model()
    model, result = merge(proto)
    assert (result.sites_matched, result.sites_rewritten, result.refused) == (0, 0, [])
    assert not result.modified and op_counts(model) == Counter({"Gemm": 2})
    assert_same_computation(proto, model, atol=0, rtol=0)


def _computed_weight(g: Linears) -> None:
    g.input("scale", [1])
    g.const("raw.w", weights(3, K))
    g.nodes.append(helper.make_node("Mul", ["raw.w", "scale"], ["computed.w"], name="scale_w"))
    g.gemm("bad", 3, w="computed.w")


def _computed_bias(g: Linears) -> None:
    g.input("bias_in", [3])
    g.gemm("bad", 3, bias="bias_in")


LOOKALIKES = {
    "alpha": (lambda g: g.gemm("bad", 3, alpha=0.5), "alpha=0.5", Counter({"Gemm": 2})),
    "beta": (lambda g: g.gemm("bad", 3, beta=2.0), "beta=2.0", Counter({"Gemm": 2})),
    "transA": (lambda g: g.gemm("bad", 3, transA=1), "transA=1", Counter({"Gemm": 2})),
    "computed-weight": (_computed_weight, "weight is not a constant", Counter({"Gemm": 2, "Mul": 1})),
    "computed-bias": (_computed_bias, "bias is not a constant", Counter({"Gemm": 2})),
    "C-per-row-and-column": (lambda g: g.gemm("bad", 3, bias=(K, 3)), "C has shape [6, 3]", Counter({"Gemm": 2})),
}


@pytest.mark.parametrize("name", list(LOOKALIKES))
def test_lookalike_next_to_a_mergeable_gemm_is_refused_and_nothing_merges(name):
    build, reason, ops = LOOKALIKES[name]
    g = Linears(x_shape=(K, K))  # square, static: transA and a (M, N) C are valid there
    g.gemm("good", 4)
    build(g)
    proto = g.model()
    model, result = merge(proto)

    assert (result.sites_matched, result.sites_rewritten) == (2, 0) and not result.modified
    refused = dict(result.refused)
    assert reason in refused["bad"]
    assert refused["good"].startswith("no other mergeable Linear reads x")
    assert op_counts(model) == ops
    assert_same_computation(proto, model, atol=0, rtol=0)


def test_a_refused_member_leaves_the_others_to_merge():
    g = Linears()
    g.gemm("a", 4)
    g.gemm("bad", 3, alpha=0.5)
    g.gemm("b", 2, trans_b=0)
    proto = g.model()
    model, result = merge(proto)
    assert (result.sites_matched, result.sites_rewritten) == (3, 2)
    assert [site for site, _ in result.refused] == ["bad"]
    assert op_counts(model) == Counter({"Gemm": 2, "Split": 1})
    gemm, _, _, sizes = merged_values(model)
    assert sizes == [4, 2] and [t.name for t in gemm.outputs[0].outputs[0].outputs] == ["a.y", "b.y"]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


def test_two_inputs_give_two_groups():
    g = Linears()
    g.input("x2", ["batch", K])
    g.gemm("a", 4)
    g.gemm("b", 3)
    g.gemm("c", 2, x="x2")
    g.matmul("d", 5, x="x2")
    proto = g.model()
    model, result = merge(proto)
    assert result.details == {"groups": 2, "members": 4, "from_matmul": 1}
    assert sorted(n.inputs[0].name for n in merged_gemms(model)) == ["x", "x2"]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- weights


def _external_model(tmp_path):
    g = Linears()
    g.gemm("a", 40)
    g.gemm("b", 30, trans_b=0, bias=False)
    g.matmul("c", 20)
    path = tmp_path / "linears.onnx"
    onnx.save_model(g.model(), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="linears.onnx.data", size_threshold=0)
    return path


def test_merged_weights_are_derived_without_loading_the_members_for_good(tmp_path):
    path = _external_model(tmp_path)
    model = load_model(path)
    members = {t.name: t for t in model.graph.tensors().values() if isinstance(t, gs.Constant)}
    assert members and all(isinstance(t._values, ExternalValues) for t in members.values())
    report = PassManager([PASS]).run(model)
    assert step(report).details["members"] == 3

    [gemm] = merged_gemms(model)
    assert isinstance(gemm.inputs[1]._values, DerivedValues) and isinstance(gemm.inputs[2]._values, DerivedValues)
    assert not set(members) & set(model.graph.tensors())  # the members' initializers are gone
    np.asarray(gemm.inputs[1].values), np.asarray(gemm.inputs[2].values)  # computed now...
    assert all(isinstance(t._values, ExternalValues) for t in members.values())  # ...without caching the members


@pytest.mark.parametrize("external", [False, True])
def test_saved_merged_model_is_valid_and_equal_to_the_source(tmp_path, external):
    path = _external_model(tmp_path)
    model, _ = optimize(path, [PASS])
    out = tmp_path / "merged.onnx"
    save_model(model, out, external_data=external)
    onnx.checker.check_model(str(out), full_check=True)
    assert_same_computation(path, out, atol=1e-5, rtol=1e-5)


def test_adaln_modulation_chunks_fold_into_the_merged_split():
    """AdaLN's ``linear(silu(temb)).chunk(k, dim=1)`` in every block: each member's own column Split
    (num_outputs, or sizes) becomes part of the merged Split, so one Split hands out every shift,
    scale and gate. A member whose output something else reads keeps its tensor."""
    g = Linears()
    g.gemm("zero", 6)
    g.nodes.append(helper.make_node("Split", ["zero.y"], ["shift", "scale", "gate"], axis=1, num_outputs=3))
    g.gemm("cont", 4)
    g.initializers.append(numpy_helper.from_array(np.array([1, 3], np.int64), "sizes"))
    g.nodes.append(helper.make_node("Split", ["cont.y", "sizes"], ["c0", "c1"], axis=-1))
    g.gemm("plain", 3)
    g.outputs = [helper.make_tensor_value_info(n, F32, None) for n in ("shift", "scale", "gate", "c0", "c1", "plain.y")]
    proto = make_model(g.nodes, g.inputs, g.outputs, g.initializers)
    proto.opset_import[0].version = 18  # Split's num_outputs
    model, result = merge(proto)
    assert result.details["splits_folded"] == 2 and result.details["members"] == 3
    assert op_counts(model) == Counter({"Gemm": 1, "Split": 1})
    _, _, _, sizes = merged_values(model)
    assert sizes == [2, 2, 2, 1, 3, 3]
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)


def test_a_group_over_the_weight_cap_merges_in_chunks():
    """Merged weights are computed whole when saved: a cap keeps each one bounded (Flux's AdaLN
    modulations together hold 13 GB in float32). Each chunk of consecutive members within the cap
    is one Gemm; a member alone in its chunk stays as it was, refused with the reason."""
    g = Linears()
    for i, n in enumerate([4, 4, 4, 4, 8]):
        g.gemm(f"g{i}", n)
    proto = g.model()
    cap = 8 * K * 4  # two 4-column members, or the 8-column one alone
    model, report = optimize(proto, [get_pass(PASS)(max_weight_bytes=cap)])
    result = step(report)
    assert result.details["groups"] == 2 and result.details["members"] == 4
    assert [name for name, _ in result.refused] == ["g4"] and "max_weight_bytes" in result.refused[0][1]
    assert op_counts(model)["Gemm"] == 3
    assert_same_computation(proto, model, atol=1e-5, rtol=1e-5)
