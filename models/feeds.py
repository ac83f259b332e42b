"""Deterministic example inputs, in numpy (no torch needed).

The builders make their torch example inputs with :func:`make_feeds`, and the
fixture tests make the same feeds from ``manifest.json`` alone (each input
there has a ``kind`` and concrete ``example_shape`` / ``alt_shape``), so a test
without torch runs a fixture on exactly the inputs its reference values in
the manifest were computed from.

Kinds:
  ``latent``      standard normal (UNet / ControlNet sample, VAE decoder latent)
  ``image``       uniform in [-1, 1] (VAE encoder input)
  ``cond_image``  uniform in [0, 1) (ControlNet conditioning image)
  ``timestep``    float32, ``linspace(999, 1, batch)`` (500 for batch 1)
  ``hidden``      standard normal (encoder_hidden_states, text_embeds)
  ``time_ids``    SDXL micro-conditioning: [8h, 8w, 0, 0, 8h, 8w] per row, h/w from ``sample``
  ``input_ids``   int64 token ids: BOS 0, random ids in [3, vocab-1), the EOT id
                  (vocab-1, the highest) at a different position per row, padding after it
  ``sigma``       float32 flow-matching time in (0, 1]: ``linspace(1, 1/batch, batch)`` (Flux's
                  ``timestep``, which the model multiplies by 1000)
  ``guidance``    float32 distilled guidance scale: ``linspace(3.5, 5.0, batch)`` (Flux-dev)
  ``img_ids``     Flux's image position ids ``[(h/2)*(w/2), 3]``: (0, row, column) of each packed
                  2x2 latent patch, row-major, as the Flux pipeline makes them (needs the latent
                  ``height`` / ``width`` dims)
  ``txt_ids``     Flux's text position ids: zeros ``[sequence, 3]``
"""
from __future__ import annotations

import zlib

import numpy as np

KINDS = ("latent", "image", "cond_image", "timestep", "hidden", "time_ids", "input_ids", "sigma", "guidance",
         "img_ids", "txt_ids")


def _rng(seed: int, name: str, shape) -> np.random.Generator:
    return np.random.default_rng([int(seed), zlib.crc32(name.encode()), *[int(s) for s in shape]])


def make_feeds(specs, seed: int = 0, *, vocab: int | None = None, pad_id: int = 1,
               dims: dict | None = None) -> dict[str, np.ndarray]:
    """``specs``: iterable of dicts with ``name``, ``shape`` (concrete ints), ``dtype`` and ``kind``;
    ``dims`` the model's dims (``img_ids`` reads the latent ``height`` and ``width``)."""
    specs = list(specs)
    out: dict[str, np.ndarray] = {}
    shapes = {s["name"]: [int(d) for d in s["shape"]] for s in specs}
    for s in specs:
        name, shape, kind = s["name"], shapes[s["name"]], s["kind"]
        # numpy has no bfloat16: such inputs are made in float32 (BuiltModel.make_inputs casts in torch)
        dtype = np.dtype("float32" if s.get("dtype") == "bfloat16" else s.get("dtype", "float32"))
        rng = _rng(seed, name, shape)
        if kind in ("latent", "hidden"):
            a = rng.standard_normal(shape, dtype=np.float32)
        elif kind == "image":
            a = rng.uniform(-1.0, 1.0, shape).astype(np.float32)
        elif kind == "cond_image":
            a = rng.random(shape, dtype=np.float32)
        elif kind == "timestep":
            b = shape[0]
            a = np.linspace(999.0, 1.0, b, dtype=np.float32) if b > 1 else np.full((b,), 500.0, np.float32)
        elif kind == "time_ids":
            h, w = shapes["sample"][2:4]
            row = np.array([8.0 * h, 8.0 * w, 0.0, 0.0, 8.0 * h, 8.0 * w], np.float32)
            a = np.tile(row[: shape[1]], (shape[0], 1))  # the SDXL refiner's 5: the fifth its aesthetic score
        elif kind == "input_ids":
            if vocab is None:
                raise ValueError("input_ids need vocab")
            b, n = shape
            eot = vocab - 1
            a = rng.integers(3, eot, size=shape, dtype=np.int64)
            a[:, 0] = 0
            for i in range(b):
                pos = max(1, n - 1 - 3 * i) if n > 2 else n - 1
                a[i, pos] = eot
                a[i, pos + 1:] = pad_id
        elif kind == "sigma":
            b = shape[0]
            a = np.linspace(1.0, 1.0 / b, b, dtype=np.float32)
        elif kind == "guidance":
            a = np.linspace(3.5, 5.0, shape[0], dtype=np.float32)
        elif kind == "img_ids":
            if not dims or "height" not in dims or "width" not in dims:
                raise ValueError("img_ids need the latent height and width dims")
            rows, cols = int(dims["height"]) // 2, int(dims["width"]) // 2
            if rows * cols != shape[0]:
                raise ValueError(f"img_ids: {shape[0]} positions for a {rows}x{cols} patch grid")
            a = np.zeros((rows, cols, 3), np.float32)
            a[..., 1] = np.arange(rows, dtype=np.float32)[:, None]
            a[..., 2] = np.arange(cols, dtype=np.float32)[None, :]
            a = a.reshape(rows * cols, 3)
        elif kind == "txt_ids":
            a = np.zeros(shape, np.float32)
        else:
            raise ValueError(f"unknown input kind {kind!r}")
        out[name] = a.astype(dtype, copy=False)
    return out


def resolve_shape(shape, dims: dict) -> list[int]:
    """Resolve a shape whose entries are ints, names of ``dims`` or products of both with an
    optional exact divisor: ``"8*height"``, ``"height*width/4"`` (Flux's packed image sequence)."""
    return [resolve_dim(d, dims) if isinstance(d, str) else int(d) for d in shape]


def resolve_dim(expr: str, dims: dict) -> int:
    product, _, divisor = expr.partition("/")
    value = 1
    for factor in product.split("*"):
        factor = factor.strip()
        value *= int(factor) if factor.isdigit() else int(dims[factor])
    if divisor:
        if value % int(divisor):
            raise ValueError(f"{expr}: {value} is not a multiple of {divisor}")
        value //= int(divisor)
    return value


def feeds_from_manifest(entry: dict, which: str = "example") -> dict[str, np.ndarray]:
    """Feeds for a manifest fixture entry; ``which`` is ``"example"`` or ``"alt"``."""
    key = f"{which}_shape"
    specs = []
    for i in entry["inputs"]:
        if i.get(key) is None:
            raise ValueError(f"{entry['file']}: no {key} for {i['name']}")
        specs.append({"name": i["name"], "shape": i[key], "dtype": i["dtype"], "kind": i["kind"]})
    fo = entry.get("feed_options", {})
    return make_feeds(specs, entry.get("seed", 0), dims=entry.get(f"{which}_dims"), **fo)
