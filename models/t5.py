"""T5 v1.1 XXL encoder builder (transformers ``T5EncoderModel``): the text encoder of SD3 / SD3.5
(``text_encoder_3``) and Flux.1 (``text_encoder_2``).

``t5-xxl`` full: google/t5-v1_1-xxl ``config.json`` (d_model 4096, d_ff 10240, 24 layers, 64 heads
of d_kv 64, ``feed_forward_proj="gated-gelu"`` = gelu_new(wi_0 x) * wi_1 x, 32 relative-position
buckets up to distance 128, vocabulary 32128, RMS layer norm eps 1e-6), 4.76 B parameters.
Tiny: 2 layers, d_model 32, 4 heads of d_kv 8, d_ff 48, vocabulary 512; the same relative-position
buckets (the bias table is 32 x heads).

T5's attention is unscaled (no 1/sqrt(d_kv)) and adds the relative-position bias, computed once
in the first layer and reused by the others; its layer norm is an RMSNorm without bias
(``T5LayerNorm``, written out in torch: pow-mean-rsqrt-mul). ``attention``: ``sdpa`` ->
``attn_implementation="sdpa"`` (the bias is the SDPA mask), ``classic`` -> ``"eager"``.

Input ``input_ids`` int64 ``[batch, sequence]``; output ``last_hidden_state``
``[batch, sequence, d_model]``. No attention mask: SD3 and Flux pad the prompt to a fixed
length (256 / 512) and encode every token.
"""
from __future__ import annotations

import torch

from .base import BuiltModel, check_choice, count_sites, default_dtype, SIZES
from .seeding import init_module, seed_everything

_T5_COMMON = dict(
    feed_forward_proj="gated-gelu", dense_act_fn="gelu_new", is_gated_act=True, relative_attention_num_buckets=32,
    relative_attention_max_distance=128, layer_norm_epsilon=1e-6, dropout_rate=0.1, tie_word_embeddings=False,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=True, use_cache=False,
)

CONFIGS = {
    # google/t5-v1_1-xxl config.json
    "full": dict(_T5_COMMON, vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                 num_decoder_layers=24, num_heads=64),
    "tiny": dict(_T5_COMMON, vocab_size=512, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
                 num_heads=4),
}

FAMILIES = ("t5-xxl",)

# Full: Flux-dev's 512 tokens (SD3 uses 256); tiny: short, and another length for dynamic exports.
EXAMPLE_DIMS = {"full": dict(batch=1, sequence=512), "tiny": dict(batch=2, sequence=20)}
ALT_DIMS = {"full": dict(batch=2, sequence=256), "tiny": dict(batch=3, sequence=13)}


class T5EncoderWrapper(torch.nn.Module):
    """(input_ids,) -> (last_hidden_state,)"""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return (self.model(input_ids=input_ids, return_dict=True).last_hidden_state,)


def make_t5(size: str, attention: str = "sdpa", seed: int = 0, dtype=None, overrides: dict | None = None):
    from transformers import T5Config, T5EncoderModel

    impl = {"sdpa": "sdpa", "classic": "eager"}[attention]
    cfg = T5Config(**dict(CONFIGS[size], **(overrides or {})))
    cfg._attn_implementation = impl
    seed_everything(seed)
    with default_dtype(dtype):
        model = T5EncoderModel(cfg)
    model.set_attn_implementation(impl)
    return init_module(model, seed)


def build(family: str, size: str = "tiny", attention: str = "sdpa", seed: int = 0, dtype=None,
          overrides: dict | None = None) -> BuiltModel:
    check_choice("family", family, FAMILIES)
    check_choice("size", size, SIZES)
    check_choice("attention", attention, ("sdpa", "classic"))
    cfg = dict(CONFIGS[size], **(overrides or {}))
    model = make_t5(size, attention, seed, dtype, overrides)
    return BuiltModel(
        family=family,
        size=size,
        attention=attention,
        module=T5EncoderWrapper(model).eval(),
        input_specs=[dict(name="input_ids", shape=["batch", "sequence"], dtype="int64", kind="input_ids")],
        output_names=["last_hidden_state"],
        dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "last_hidden_state": {0: "batch", 1: "sequence"}},
        example_dims=dict(EXAMPLE_DIMS[size]),
        alt_dims=dict(ALT_DIMS[size]),
        dim_multiples={},
        sites=count_sites(model),
        config=dict(cfg),
        seed=seed,
        feed_options={"vocab": cfg["vocab_size"], "pad_id": cfg["pad_token_id"]},
    )
