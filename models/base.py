"""Common pieces of the model builders: the BuiltModel record and site counting."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

SIZES = ("tiny", "full")
ATTENTIONS = ("sdpa", "classic")

# Keys of the ``sites`` dict, in a fixed order (the manifest writes them in this order).
SITE_KEYS = (
    "attention",          # all attention modules (diffusers Attention + transformers CLIPAttention)
    "attention_self",
    "attention_cross",
    "group_norm",         # nn.GroupNorm modules (includes the GroupNorm inside VAE attention)
    "layer_norm",         # nn.LayerNorm modules
    "geglu",              # diffusers GEGLU modules (proj Linear + chunk + gelu * gate)
    "gelu",               # standalone GELU activations (diffusers GELU, transformers GELUActivation)
    "quick_gelu",         # transformers QuickGELUActivation (x * sigmoid(1.702 x))
    "conv2d",             # nn.Conv2d modules
    "linear",             # nn.Linear modules
    "transformer_block",  # diffusers BasicTransformerBlock / transformers CLIPEncoderLayer
    "resnet",             # diffusers ResnetBlock2D
    "upsample",           # diffusers Upsample2D (one Resize each)
    "downsample",         # diffusers Downsample2D (a stride-2 conv each)
    # diffusion transformers and T5 (models/dit.py, models/t5.py); 0 in the SD-class families
    "attention_joint",    # attention over text and image streams concatenated (MMDiT: SD3 attn, Flux double blocks)
    "rms_norm",           # RMSNorm modules: torch.nn.RMSNorm, diffusers RMSNorm (QK norm), transformers T5LayerNorm
    "gelu_tanh",          # tanh-approximated GELUs: diffusers GELU(approximate="tanh"), nn.GELU("tanh"), T5's gelu_new
    "gated_gelu",         # T5's gated feed-forward: gelu_new(wi_0 x) * wi_1 x
    "ada_layer_norm",     # AdaLN modules: AdaLayerNormZero(-Single), SD35AdaLayerNormZeroX, AdaLayerNormContinuous
    "modulation",         # x * (1 + scale) + shift sites (in the AdaLN modules and after each block's norm2)
    "rotary",             # rotary embeddings applied (Flux: Q and K of every attention, 2 per attention)
)


@dataclass
class BuiltModel:
    """A model ready to export: a wrapper module with a plain-tensor signature.

    ``module.forward`` takes the inputs in ``input_names`` order, as positional
    tensors, and returns a tuple of tensors in ``output_names`` order.

    Dims: ``batch``, ``height``/``width`` (always the *latent* size, also for the
    VAE and ControlNet; pixel sizes are ``k*height``) and ``sequence`` (text tokens).
    """

    family: str
    size: str
    attention: str
    module: "object"                       # torch.nn.Module (wrapper)
    input_specs: list[dict]                # name, shape template (ints, dim names, "k*name"), dtype, kind
    output_names: list[str]
    dynamic_axes: dict[str, dict[int, str]]   # input and output names -> {axis: symbolic name}
    example_dims: dict                        # dims used for export (dynamic dims all >= 2)
    alt_dims: dict                            # another set of dims, to check dynamic exports
    dim_multiples: dict[str, int]             # dim -> the multiple it must be (latent spatial dims)
    sites: dict[str, int]
    config: dict = field(default_factory=dict)
    # site kind -> names of the torch modules that are those sites, relative to the diffusers model
    # (the ``sites`` counts, named): {"attention_cross": ["down_blocks.0.attentions.0.transformer_blocks.0.attn2", ...]}
    site_modules: dict[str, list[str]] = field(default_factory=dict)
    seed: int = 0
    feed_options: dict = field(default_factory=dict)   # extra make_feeds arguments (vocab, pad_id)
    # exporter -> a context manager factory entered around that exporter's call only: module swaps
    # for ops it cannot export (TorchScript lacks aten::rms_norm: models.dit writes Flux's RMSNorm out)
    export_patches: dict[str, Callable] = field(default_factory=dict)
    # a model built on the meta device: its seeded parameters, made one at a time (models.metaweights)
    weights: "object" = None

    @property
    def input_names(self) -> list[str]:
        return [s["name"] for s in self.input_specs]

    def input_shapes(self, dims: dict | None = None) -> dict[str, list[int]]:
        from .feeds import resolve_shape

        d = dict(self.example_dims)
        d.update(dims or {})
        return {s["name"]: resolve_shape(s["shape"], d) for s in self.input_specs}

    def make_feeds(self, dims: dict | None = None) -> dict:
        """numpy feeds (name -> array) at ``dims`` (example dims by default)."""
        from .feeds import make_feeds

        shapes = self.input_shapes(dims)
        specs = [dict(s, shape=shapes[s["name"]]) for s in self.input_specs]
        d = dict(self.example_dims)
        d.update(dims or {})
        return make_feeds(specs, self.seed, dims=d, **self.feed_options)

    def make_inputs(self, dims: dict | None = None) -> tuple:
        """torch inputs, in ``input_names`` order, at ``dims`` (example dims by default)."""
        import torch

        feeds = self.make_feeds(dims)
        out = []
        for spec in self.input_specs:
            t = torch.from_numpy(feeds[spec["name"]])
            if spec.get("dtype") == "bfloat16":  # numpy has no bfloat16: models.feeds makes float32
                t = t.to(torch.bfloat16)
            out.append(t)
        return tuple(out)

    @property
    def example_inputs(self) -> tuple:
        return self.make_inputs(self.example_dims)


def count_sites(module) -> dict[str, int]:
    """Count optimisation sites in a torch module tree."""
    import torch.nn as nn

    counts = {k: 0 for k in SITE_KEYS}

    diff_attn = diff_geglu = diff_gelu = diff_btb = diff_resnet = diff_up = diff_down = ()
    try:
        from diffusers.models.attention_processor import Attention as DiffAttention
        from diffusers.models.activations import GEGLU, GELU as DiffGELU
        from diffusers.models.attention import BasicTransformerBlock
        from diffusers.models.resnet import ResnetBlock2D
        from diffusers.models.upsampling import Upsample2D
        from diffusers.models.downsampling import Downsample2D

        diff_attn, diff_geglu, diff_gelu = (DiffAttention,), (GEGLU,), (DiffGELU,)
        diff_btb, diff_resnet = (BasicTransformerBlock,), (ResnetBlock2D,)
        diff_up, diff_down = (Upsample2D,), (Downsample2D,)
    except ImportError:  # pragma: no cover
        pass
    tf_attn = tf_layer = tf_gelu = tf_qgelu = ()
    try:
        from transformers.models.clip.modeling_clip import CLIPAttention, CLIPEncoderLayer
        from transformers.activations import GELUActivation, QuickGELUActivation

        tf_attn, tf_layer = (CLIPAttention,), (CLIPEncoderLayer,)
        tf_gelu, tf_qgelu = (GELUActivation,), (QuickGELUActivation,)
    except ImportError:  # pragma: no cover
        pass

    for m in module.modules():
        if diff_attn and isinstance(m, diff_attn):
            counts["attention"] += 1
            if getattr(m, "is_cross_attention", False):
                counts["attention_cross"] += 1
            else:
                counts["attention_self"] += 1
        elif tf_attn and isinstance(m, tf_attn):
            counts["attention"] += 1
            counts["attention_self"] += 1
        if isinstance(m, nn.GroupNorm):
            counts["group_norm"] += 1
        if isinstance(m, nn.LayerNorm):
            counts["layer_norm"] += 1
        if diff_geglu and isinstance(m, diff_geglu):
            counts["geglu"] += 1
        if diff_gelu and isinstance(m, diff_gelu):
            counts["gelu_tanh" if getattr(m, "approximate", "none") == "tanh" else "gelu"] += 1
        if tf_gelu and isinstance(m, tf_gelu):
            counts["gelu"] += 1
        if tf_qgelu and isinstance(m, tf_qgelu):
            counts["quick_gelu"] += 1
        if isinstance(m, nn.Conv2d):
            counts["conv2d"] += 1
        if isinstance(m, nn.Linear):
            counts["linear"] += 1
        if (diff_btb and isinstance(m, diff_btb)) or (tf_layer and isinstance(m, tf_layer)):
            counts["transformer_block"] += 1
        if diff_resnet and isinstance(m, diff_resnet):
            counts["resnet"] += 1
        if diff_up and isinstance(m, diff_up):
            counts["upsample"] += 1
        if diff_down and isinstance(m, diff_down):
            counts["downsample"] += 1
        if diff_attn and isinstance(m, diff_attn) and getattr(m, "added_kv_proj_dim", None) is not None:
            counts["attention_joint"] += 1
    _count_transformer_sites(module, counts)
    return counts


def _count_transformer_sites(module, counts: dict) -> None:
    """The diffusion-transformer and T5 sites (see SITE_KEYS); modules that are absent count nothing."""
    import torch.nn as nn

    kinds = _transformer_classes()
    for m in module.modules():
        name = type(m).__name__
        if name == "FluxAttention" or (kinds["t5_attention"] and isinstance(m, kinds["t5_attention"])):
            counts["attention"] += 1
            counts["attention_self"] += 1
            if getattr(m, "added_kv_proj_dim", None) is not None:
                counts["attention_joint"] += 1
        if name == "FluxAttention":
            counts["rotary"] += 2  # Q and K: every Flux attention gets the image+text rotary embedding
        if isinstance(m, nn.RMSNorm) or isinstance(m, kinds["rms_norm"]):
            counts["rms_norm"] += 1
        if isinstance(m, nn.GELU) and m.approximate == "tanh":
            counts["gelu_tanh"] += 1
        if kinds["tf_gelu_tanh"] and isinstance(m, kinds["tf_gelu_tanh"]):
            counts["gelu_tanh"] += 1
        if kinds["gated_gelu"] and isinstance(m, kinds["gated_gelu"]):
            counts["gated_gelu"] += 1
        if name in MODULATIONS:
            counts["ada_layer_norm"] += 1
            counts["modulation"] += MODULATIONS[name]
        elif name in BLOCK_MODULATIONS:
            # the block modulates its own norm2 (and norm2_context, unless the context stream ends here)
            counts["modulation"] += BLOCK_MODULATIONS[name] - (1 if getattr(m, "context_pre_only", False) else 0)
        if name in TRANSFORMER_BLOCKS or (kinds["t5_block"] and isinstance(m, kinds["t5_block"])):
            counts["transformer_block"] += 1


# AdaLN module -> how many x * (1 + scale) + shift it computes
MODULATIONS = {"AdaLayerNormZero": 1, "AdaLayerNormZeroSingle": 1, "AdaLayerNormContinuous": 1,
               "SD35AdaLayerNormZeroX": 2}
# block -> modulations written in the block itself (norm2 and norm2_context)
BLOCK_MODULATIONS = {"JointTransformerBlock": 2, "FluxTransformerBlock": 2}
TRANSFORMER_BLOCKS = ("JointTransformerBlock", "FluxTransformerBlock", "FluxSingleTransformerBlock")


def _transformer_classes() -> dict:
    kinds = {"rms_norm": (), "t5_attention": (), "t5_block": (), "gated_gelu": (), "tf_gelu_tanh": ()}
    try:
        from diffusers.models.normalization import RMSNorm

        kinds["rms_norm"] = (RMSNorm,)
    except ImportError:  # pragma: no cover
        pass
    try:
        from transformers.activations import GELUTanh, NewGELUActivation
        from transformers.models.t5.modeling_t5 import T5Attention, T5Block, T5DenseGatedActDense, T5LayerNorm

        kinds["rms_norm"] += (T5LayerNorm,)
        kinds.update(t5_attention=(T5Attention,), t5_block=(T5Block,), gated_gelu=(T5DenseGatedActDense,),
                     tf_gelu_tanh=(NewGELUActivation, GELUTanh))
    except ImportError:  # pragma: no cover
        pass
    return kinds


def site_module_names(module) -> dict[str, list[str]]:
    """Named sites: ``attention_cross`` lists the cross-attention modules, in module order."""
    try:
        from diffusers.models.attention_processor import Attention
    except ImportError:  # pragma: no cover
        return {}
    cross = [name for name, m in module.named_modules() if isinstance(m, Attention) and getattr(m, "is_cross_attention", False)]
    return {"attention_cross": cross}


def set_diffusers_attention(model, attention: str) -> None:
    """sdpa -> AttnProcessor2_0 (diffusers default); classic -> AttnProcessor (bmm + softmax)."""
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    if attention == "sdpa":
        model.set_attn_processor(AttnProcessor2_0())
    elif attention == "classic":
        model.set_attn_processor(AttnProcessor())
    else:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; None (torch's default) -> ``"float32"``."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


@contextlib.contextmanager
def default_dtype(dtype):
    """Construct modules in ``dtype`` (None: leave torch's default): a full-size model built in
    bfloat16 never exists in float32 (Flux-dev: 24 GB instead of 48 GB)."""
    import torch

    if dtype is None:
        yield
        return
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def check_choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
