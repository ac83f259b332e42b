"""Attention com.microsoft ops: MultiHeadAttention and the older fused-projection Attention."""

from __future__ import annotations

import math

import numpy as np

from ._common import ContribOp, compute_dtype, softmax


def _heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """(B, L, N*H) -> (B, N, L, H)."""
    b, length, hidden = x.shape
    return x.reshape(b, length, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)


def _keep_from_lengths(end, t: int, start=None) -> np.ndarray:
    """Per-batch valid key range [start, end) -> keep mask (B, 1, 1, T)."""
    j = np.arange(t)
    keep = j[None, :] < np.asarray(end).reshape(-1, 1)
    if start is not None:
        keep &= j[None, :] >= np.asarray(start).reshape(-1, 1)
    return keep[:, None, None, :]


class _AttentionOp(ContribOp):
    def _attend(self, q, k, v, *, scale, attention_bias, keep, causal, mask_filter_value) -> np.ndarray:
        """softmax(scale * Q K^T + attention_bias + mask) V for q (B,N,S,H), k (B,N,T,H), v (B,N,T,Hv).

        ``keep`` is a boolean array broadcastable to (B, 1, S, T) (False = masked) or None; masked
        scores get ``mask_filter_value`` added (finite, so a fully padded row still has a defined
        softmax). ``causal`` removes key j from query i when j > i (callers ensure S == T).
        ``scale`` None or 0 means 1/sqrt(H), as in ORT. Returns (B, S, N*Hv).
        """
        b, n, s, h = q.shape
        t = k.shape[2]
        scale = float(scale) if scale else 1.0 / math.sqrt(h)
        scores = (q @ k.transpose(0, 1, 3, 2)) * q.dtype.type(scale)
        if attention_bias is not None:
            ab = attention_bias
            if ab.ndim != 4 or ab.shape[0] not in (1, b) or ab.shape[1] not in (1, n) or ab.shape[2:] != (s, t):
                raise self._invalid(f"attention_bias must be ({b} or 1, {n} or 1, {s}, {t}), got {ab.shape}")
            scores = scores + ab.astype(scores.dtype)
        if keep is not None:
            scores = scores + np.where(keep, scores.dtype.type(0), scores.dtype.type(mask_filter_value))
        if causal:
            # Future keys are excluded outright, as ORT's CPU kernels do (-inf, not mask_filter_value).
            # This matters for a row whose visible keys are all padding: it still attends among them.
            scores = np.where(np.triu(np.ones((s, t), dtype=bool), k=1), -np.inf, scores)
        out = softmax(scores, axis=-1) @ v
        return out.transpose(0, 2, 1, 3).reshape(b, s, -1)


class MultiHeadAttention(_AttentionOp):
    """output = concat_heads(softmax(scale * Q K^T + attention_bias + mask) V), heads split from the hidden axis.

    Inputs (spec order):
      query: (B, S, D), or packed QKV (B, S, N, 3, H) with key and value absent;
      key: (B, L, D), packed KV (B, L, N, 2, H) with value absent, or (B, N, L, H) (already split);
      value: (B, L, D_v), or (B, N, L, H_v) together with a 4-D key;
      bias: (D + D + D_v), added to Q, K, V before the heads are split;
      key_padding_mask (int): (B) key lengths, or (B, L) / (B, S, L) with 0 = masked;
        (3B + 2) is not supported;
      attention_bias: (B or 1, N or 1, S, L), added to the scaled scores;
      past_key, past_value, past_sequence_length, cache_indirection: not supported.
    Attributes: num_heads (required), scale (default 1/sqrt(H)), mask_filter_value (default
    -10000, added to scores of padded keys), unidirectional (default 0; 1 = causal: key j is
    hidden from query i when j > i; supported only for L == S).
    Outputs: output (B, S, N*H_v); optional present_key (B, N, L, H) and present_value
    (B, N, L, H_v) -- without past state they are just K and V after bias; qk: not supported.
    """

    def _run(
        self,
        query,
        key=None,
        value=None,
        bias=None,
        key_padding_mask=None,
        attention_bias=None,
        past_key=None,
        past_value=None,
        past_sequence_length=None,
        cache_indirection=None,
        num_heads=None,
        scale=None,
        mask_filter_value=-10000.0,
        unidirectional=0,
    ):
        self._require(num_heads=num_heads)
        for name, tensor in (
            ("past_key", past_key),
            ("past_value", past_value),
            ("past_sequence_length", past_sequence_length),
            ("cache_indirection", cache_indirection),
        ):
            if tensor is not None:
                raise self._reject(f"input {name!r} (KV cache)")
        if self._wants_output(3):
            raise self._reject("output 'qk'")
        if unidirectional not in (0, 1):
            raise self._invalid(f"unidirectional must be 0 or 1, got {unidirectional}")

        ct = compute_dtype(query)
        q, k, v = self._split_qkv(query, key, value, bias, num_heads, ct)
        b, _, s, _ = q.shape
        t = k.shape[2]
        if unidirectional and s != t:
            # ORT's CPU kernel masks top-left aligned but leaves the last query row unmasked; no
            # single behaviour to follow, and our graphs only use causal self-attention.
            raise self._reject("unidirectional=1 with kv_sequence_length != sequence_length")
        keep = self._keep(key_padding_mask, b, s, t)
        out = self._attend(
            q, k, v,
            scale=scale, attention_bias=attention_bias, keep=keep,
            causal=bool(unidirectional), mask_filter_value=mask_filter_value,
        )  # fmt: skip
        return (out.astype(query.dtype), k.astype(query.dtype), v.astype(query.dtype))

    def _split_qkv(self, query, key, value, bias, n, ct):
        """Q (B,N,S,H), K (B,N,L,H), V (B,N,L,Hv) from any of the spec's input layouts."""
        query = query.astype(ct)
        if query.ndim == 5:  # packed QKV (B, S, N, 3, H)
            if key is not None or value is not None:
                raise self._invalid("key and value must be absent when query is packed QKV (B, S, N, 3, H)")
            if query.shape[2:4] != (n, 3):
                raise self._invalid(f"packed QKV query must be (B, S, {n}, 3, H), got {query.shape}")
            bq, bk, bv = self._bias_parts(bias, n, query.shape[4], query.shape[4], ct)
            q, k, v = (query[:, :, :, i, :] + bb for i, bb in enumerate((bq, bk, bv)))
            return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        if query.ndim != 3:
            raise self._invalid(f"query must be (B, S, D) or packed QKV (B, S, N, 3, H), got {query.shape}")
        if key is None:
            raise self._invalid("key is required unless query is packed QKV")
        d = query.shape[2]
        if d % n:
            raise self._invalid(f"hidden size {d} is not divisible by num_heads={n}")
        h = d // n
        key = key.astype(ct)

        if key.ndim == 5:  # packed KV (B, L, N, 2, H)
            if value is not None:
                raise self._invalid("value must be absent when key is packed KV (B, L, N, 2, H)")
            if key.shape[2:] != (n, 2, h):
                raise self._invalid(f"packed KV key must be (B, L, {n}, 2, {h}), got {key.shape}")
            bq, bk, bv = self._bias_parts(bias, n, h, h, ct)
            k = (key[:, :, :, 0, :] + bk).transpose(0, 2, 1, 3)
            v = (key[:, :, :, 1, :] + bv).transpose(0, 2, 1, 3)
            return _heads(query + bq.reshape(-1), n), k, v

        if value is None:
            raise self._invalid("value is required unless key is packed KV or query is packed QKV")
        value = value.astype(ct)

        if key.ndim == 4:  # K and V already split into heads: (B, N, L, H), (B, N, L, H_v)
            if value.ndim != 4 or key.shape[1] != n or value.shape[1] != n or key.shape[3] != h:
                raise self._invalid(
                    f"4-D key/value must be (B, {n}, L, {h}) and (B, {n}, L, H_v), got {key.shape}, {value.shape}"
                )
            if bias is not None:
                raise self._reject("bias together with 4-D (B, N, L, H) key/value")
            return _heads(query, n), key, value

        if key.ndim != 3 or value.ndim != 3 or key.shape[2] != d or value.shape[1] != key.shape[1]:
            raise self._invalid(f"expects key (B, L, {d}) and value (B, L, D_v), got {key.shape} and {value.shape}")
        if value.shape[2] % n:
            raise self._invalid(f"value hidden size {value.shape[2]} is not divisible by num_heads={n}")
        bq, bk, bv = self._bias_parts(bias, n, h, value.shape[2] // n, ct)
        return (
            _heads(query + bq.reshape(-1), n),
            _heads(key + bk.reshape(-1), n),
            _heads(value + bv.reshape(-1), n),
        )

    def _bias_parts(self, bias, n, h, hv, ct):
        """Split bias (N*H + N*H + N*H_v) into per-head (N, H) pieces for Q, K, V (zeros when absent)."""
        if bias is None:
            return np.zeros((n, h), ct), np.zeros((n, h), ct), np.zeros((n, hv), ct)
        if bias.shape != (n * (2 * h + hv),):
            raise self._invalid(f"bias must have shape ({n * (2 * h + hv)},) = (D + D + D_v), got {bias.shape}")
        bias = bias.astype(ct)
        d = n * h
        return bias[:d].reshape(n, h), bias[d : 2 * d].reshape(n, h), bias[2 * d :].reshape(n, hv)

    def _keep(self, mask, b, s, t):
        if mask is None:
            return None
        if mask.shape == (b,):
            return _keep_from_lengths(mask, t)
        if mask.shape == (b, t):
            return (mask > 0)[:, None, None, :]
        if mask.shape == (b, s, t):
            return (mask > 0)[:, None, :, :]
        if mask.shape == (3 * b + 2,):
            raise self._reject("key_padding_mask of shape (3 * batch_size + 2)")
        raise self._invalid(f"key_padding_mask must be ({b},), ({b}, {t}) or ({b}, {s}, {t}), got {mask.shape}")


class Attention(_AttentionOp):
    """Q, K, V = split(input @ weights + bias); output = MultiHeadAttention(Q, K, V) with mask_index.

    Inputs (spec order):
      input: (B, S, input_hidden); weights: (input_hidden, D + D + D_v); bias: optional (D + D + D_v);
      mask_index (int): (B) valid lengths (right padding), (2B) end positions then start positions
        (left padding), (B, T) or (B, S, T) raw 0/1 masks with 0 = masked;
        (B, 1, M, M) and (3B + 2) are not supported;
      past, past_sequence_length: not supported;
      attention_bias: (B or 1, N or 1, S, T), added to the scaled scores.
    Attributes: num_heads (required); qkv_hidden_sizes (default three equal thirds of the weight
    width); scale (default 1/sqrt(H)); mask_filter_value (default -10000); unidirectional
    (default 0; 1 = causal); do_rotary and past_present_share_buffer: only 0 is supported;
    rotary_embedding_dim: only meaningful with do_rotary, ignored.
    Outputs: output (B, S, D_v); optional present (2, B, N, T, H) = stacked K and V (no past state).
    """

    def _run(
        self,
        input,
        weights,
        bias=None,
        mask_index=None,
        past=None,
        attention_bias=None,
        past_sequence_length=None,
        num_heads=None,
        scale=None,
        mask_filter_value=-10000.0,
        unidirectional=0,
        qkv_hidden_sizes=None,
        do_rotary=0,
        rotary_embedding_dim=None,
        past_present_share_buffer=0,
    ):
        self._require(num_heads=num_heads)
        if do_rotary:
            raise self._reject(f"do_rotary={do_rotary}")
        if past_present_share_buffer:
            raise self._reject(f"past_present_share_buffer={past_present_share_buffer}")
        if past is not None or past_sequence_length is not None:
            raise self._reject("past state (inputs 'past' / 'past_sequence_length')")
        if unidirectional not in (0, 1):
            raise self._invalid(f"unidirectional must be 0 or 1, got {unidirectional}")
        if input.ndim != 3 or weights.ndim != 2 or weights.shape[0] != input.shape[2]:
            raise self._invalid(
                f"expects input (B, S, K) and weights (K, D + D + D_v), got {input.shape} and {weights.shape}"
            )

        n = num_heads
        dq, dk, dv = self._hidden_sizes(qkv_hidden_sizes, weights.shape[1], n)
        ct = compute_dtype(input)
        qkv = input.astype(ct) @ weights.astype(ct)
        if bias is not None:
            if bias.shape != (weights.shape[1],):
                raise self._invalid(f"bias must have shape ({weights.shape[1]},), got {bias.shape}")
            qkv = qkv + bias.astype(ct)
        q = _heads(qkv[..., :dq], n)
        k = _heads(qkv[..., dq : dq + dk], n)
        v = _heads(qkv[..., dq + dk :], n)

        b, _, s, _ = q.shape
        keep = self._keep(mask_index, b, s, k.shape[2])
        out = self._attend(
            q, k, v,
            scale=scale, attention_bias=attention_bias, keep=keep,
            causal=bool(unidirectional), mask_filter_value=mask_filter_value,
        )  # fmt: skip
        if not self._wants_output(1):
            return (out.astype(input.dtype),)
        if dk != dv:
            raise self._reject("output 'present' with different K and V hidden sizes")
        return (out.astype(input.dtype), np.stack([k, v]).astype(input.dtype))

    def _hidden_sizes(self, qkv_hidden_sizes, width, n):
        if qkv_hidden_sizes is None:
            if width % 3:
                raise self._invalid(f"weights width {width} is not divisible by 3 and qkv_hidden_sizes is absent")
            sizes = [width // 3] * 3
        else:
            sizes = [int(x) for x in qkv_hidden_sizes]
        if len(sizes) != 3 or sum(sizes) != width or sizes[0] != sizes[1] or any(x % n for x in sizes):
            raise self._invalid(
                f"qkv_hidden_sizes {sizes} must be 3 sizes summing to the weights width {width}, "
                f"with equal Q and K sizes, each divisible by num_heads={n}"
            )
        return sizes

    def _keep(self, mask, b, s, t):
        if mask is None:
            return None
        if mask.shape == (b,):
            return _keep_from_lengths(mask, t)
        if mask.shape == (2 * b,):
            return _keep_from_lengths(mask[:b], t, start=mask[b:])
        if mask.shape == (b, t):
            return (mask > 0)[:, None, None, :]
        if mask.shape == (b, s, t):
            return (mask > 0)[:, None, :, :]
        if mask.ndim == 4 or mask.shape == (3 * b + 2,):
            raise self._reject(f"mask_index of shape {mask.shape}")
        raise self._invalid(f"mask_index must be ({b},), ({2 * b},), ({b}, {t}) or ({b}, {s}, {t}), got {mask.shape}")


class RotaryEmbedding(ContribOp):
    """Rotary position embedding: pairs of channels rotated by an angle read from position-indexed tables.

    Inputs: input (B, S, N*H) with ``num_heads`` (or H from the tables when full rotation), or
    (B, N, S, H); position_ids: (1,) an offset (positions offset .. offset+S-1 for every batch) or
    (B, S); cos_cache, sin_cache: (P, R/2), R = rotary_embedding_dim (default H).
    Attributes: interleaved (1: the pairs are channels (2i, 2i+1); 0: (i, i + R/2)), num_heads,
    rotary_embedding_dim (default 0: H); is_packed_batching: only 0 is supported; scale: only 1.0.
    Per pair (x1, x2) at position p:  (x1 cos - x2 sin, x2 cos + x1 sin), cos = cos_cache[p, i];
    channels from R on pass unchanged.
    """

    def _run(self, input, position_ids, cos_cache, sin_cache, interleaved=0, num_heads=0, rotary_embedding_dim=0,
             is_packed_batching=0, scale=1.0):
        if is_packed_batching:
            raise self._reject(f"is_packed_batching={is_packed_batching}")
        if scale not in (None, 1.0):
            raise self._reject(f"scale={scale}")
        if cos_cache.ndim != 2 or cos_cache.shape != sin_cache.shape:
            raise self._invalid(f"cos_cache and sin_cache must be 2-D of one shape, got {cos_cache.shape}, {sin_cache.shape}")
        half = cos_cache.shape[1]
        if input.ndim == 4:  # (B, N, S, H)
            x = input.transpose(0, 2, 1, 3)
        elif input.ndim == 3:  # (B, S, N*H)
            heads = num_heads or input.shape[2] // (rotary_embedding_dim or 2 * half)
            if not heads or input.shape[2] % heads:
                raise self._invalid(f"hidden size {input.shape[2]} is not divisible by num_heads={heads}")
            x = input.reshape(*input.shape[:2], heads, input.shape[2] // heads)
        else:
            raise self._invalid(f"input must be (B, S, N*H) or (B, N, S, H), got {input.shape}")
        b, s, _, h = x.shape
        rotary = rotary_embedding_dim or h
        if rotary != 2 * half or rotary > h:
            raise self._invalid(f"tables of {half} angles for a rotary dim of {rotary} (head size {h})")
        if position_ids.shape == (1,):
            positions = np.broadcast_to(np.arange(s) + int(position_ids[0]), (b, s))
        elif position_ids.shape == (b, s):
            positions = position_ids
        else:
            raise self._invalid(f"position_ids must be (1,) or ({b}, {s}), got {position_ids.shape}")
        if positions.min() < 0 or positions.max() >= cos_cache.shape[0]:
            raise self._invalid(f"positions up to {positions.max()} outside tables of {cos_cache.shape[0]} rows")
        ct = compute_dtype(input)
        cos = cos_cache.astype(ct)[positions][:, :, None, :]  # (B, S, 1, R/2)
        sin = sin_cache.astype(ct)[positions][:, :, None, :]
        x = x.astype(ct)
        part = x[..., :rotary]
        x1, x2 = (part[..., 0::2], part[..., 1::2]) if interleaved else (part[..., :half], part[..., half:])
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rotated = np.stack([r1, r2], axis=-1).reshape(part.shape) if interleaved else np.concatenate([r1, r2], axis=-1)
        y = np.concatenate([rotated, x[..., rotary:]], axis=-1)
        y = y.transpose(0, 2, 1, 3) if input.ndim == 4 else y.reshape(input.shape)
        return (y.astype(input.dtype),)
