"""SD3 / SD3.5's prompt encoding, as diffusers' ``StableDiffusion3Pipeline.encode_prompt`` does it::

    CLIP-L (text_encoder)   ids padded to 77 ─ hidden_states[-2] [b, 77, 768]   , text_embeds [b, 768]
    CLIP-G (text_encoder_2) ids padded to 77 ─ hidden_states[-2] [b, 77, 1280]  , text_embeds [b, 1280]
    T5 (text_encoder_3)     ids padded to max_sequence_length (256) ─ last_hidden_state [b, 256, 4096]
                            (no text_encoder_3: zeros [b, max_sequence_length, joint_attention_dim])

    encoder_hidden_states = concat([pad(concat([L, G], -1), to T5's width), T5], axis 1)  [b, 77 + 256, 4096]
    pooled_projections    = concat([text_embeds L, text_embeds G], -1)                    [b, 2048]

Each tokenizer pads with its own pad token (SD3's CLIP-G tokenizer pads with "!"), and both CLIP
prompts are cut at the first tokenizer's model_max_length, as diffusers does. Rows are [negative,
prompt] (classifier-free guidance as batch 2); the negative prompt defaults to "". Without
classifier-free guidance (guidance <= 1), the prompt's row alone, the negative prompt unused.
"""

from __future__ import annotations

import numpy as np

from onnxopt.pipeline.text_outputs import penultimate_name, run_outputs

CLIP_ENCODERS = (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"))


def encode_sd3_prompt(pipe, prompt: str, negative_prompt: str | None, max_sequence_length: int,
                      classifier_free_guidance: bool = True) -> dict:
    """The transformer's conditioning for [negative, prompt] ([prompt] without
    ``classifier_free_guidance``; see the module docstring); ``pipe``: the
    :class:`~onnxopt.pipeline.runner.Pipeline` whose sessions and tokenizers run it."""
    texts = [negative_prompt or "", prompt] if classifier_free_guidance else [prompt]
    clip_length = pipe.tokenizers["tokenizer"].model_max_length
    hidden, pooled = [], []
    for encoder, tokenizer in CLIP_ENCODERS:
        session = pipe.text_session(encoder, len(texts))
        ids = pipe._token_ids(tokenizer, texts, clip_length)
        states, embeds = run_outputs(session, ids, [penultimate_name(session), "text_embeds"])
        hidden.append(states.astype(np.float32))
        pooled.append(embeds.astype(np.float32))
    t5 = _t5_states(pipe, texts, max_sequence_length)
    clip = np.concatenate(hidden, axis=-1)
    if clip.shape[-1] > t5.shape[-1]:  # torch's F.pad with a negative width cuts: diffusers' models never need it
        from onnxopt.pipeline.plan import GenerationError

        raise GenerationError(f"{pipe.folder.root}: the CLIP encoders' hidden states ({clip.shape[-1]} wide) are wider "
                              f"than T5's ({t5.shape[-1]}): not an SD3 pipeline's encoders")
    clip = np.pad(clip, [(0, 0), (0, 0), (0, t5.shape[-1] - clip.shape[-1])])
    return {"encoder_hidden_states": np.concatenate([clip, t5], axis=1),
            "pooled_projections": np.concatenate(pooled, axis=-1)}


def _t5_states(pipe, texts: list[str], max_sequence_length: int) -> np.ndarray:
    """T5's last hidden state at ``max_sequence_length`` tokens, or diffusers' zeros without T5."""
    folder = pipe.folder
    if not folder.has("text_encoder_3"):
        width = folder.config(folder.denoiser).get("joint_attention_dim")
        if not isinstance(width, int):
            width = _encoder_hidden_width(pipe)
        return np.zeros([len(texts), max_sequence_length, width], np.float32)
    tokenizer = pipe.tokenizers["tokenizer_3"]
    ids = tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
                    add_special_tokens=True, return_tensors="np").input_ids
    (states,) = run_outputs(pipe.text_session("text_encoder_3", len(texts)), ids, ["last_hidden_state"])
    return states.astype(np.float32)


def _encoder_hidden_width(pipe) -> int:
    """The transformer graph's encoder_hidden_states width (a folder without transformer/config.json)."""
    import onnx

    from onnxopt.pipeline.plan import GenerationError

    model = onnx.load(str(pipe.folder.component(pipe.folder.denoiser).model), load_external_data=False)
    for value in model.graph.input:
        if value.name == "encoder_hidden_states":
            dim = value.type.tensor_type.shape.dim[-1]
            if dim.HasField("dim_value"):
                return dim.dim_value
    raise GenerationError(f"{pipe.folder.root}: no text_encoder_3/ and no joint_attention_dim in "
                          "transformer/config.json: the width of T5's zeros is unknown")
