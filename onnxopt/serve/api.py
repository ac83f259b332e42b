"""The HTTP API: the OpenAI images request shape checked against the service's limits.

    POST /v1/images/generations
    {"prompt": str, "negative_prompt"?: str, "n"?: int, "size"?: "WxH", "steps"?: int,
     "guidance"?: float, "seed"?: int, "scheduler"?: str, "response_format"?: "b64_json"}
    -> {"created": unix seconds, "data": [{"b64_json": PNG, "seed": int}, ...]}

A request is refused whole, before any work, with a 4xx and ``{"error": {"message": ...}}``. A field
that is null is a field left out (as OpenAI's API reads it); a field given twice is refused; a size is
ASCII digits.
Seeds: image ``i`` (0-based) of a request with seed ``s`` is made with seed ``s + i``, so
``onnxopt generate --seed s+i`` with the same settings makes the same image. Without a seed the
service draws ``s`` at random and returns every image's seed. Nothing here needs Ray.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections import Counter
from dataclasses import dataclass

# one seed range for the request and for the images it expands to (s + n - 1 must fit too);
# torch.Generator.manual_seed takes it, and JSON clients keep it exact below 2**53
SEED_MAX = 2**53 - 1
FIELDS = {"prompt", "negative_prompt", "n", "size", "steps", "guidance", "seed", "scheduler", "response_format",
          "model", "user"}  # model and user: OpenAI clients send them; one folder is served, so they are ignored


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; over a limit it is refused at once (400)."""
    max_n: int = 4
    max_side: int = 1024  # pixels, each of width and height
    max_steps: int = 100
    max_prompt_chars: int = 1000


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a field out gets: the defaults of ``onnxopt generate``."""
    steps: int = 50
    guidance: float = 7.5
    scheduler: str | None = None  # None: the pipeline's own default (what generate runs without --scheduler)
    height: int | None = None  # None: the folder's own size
    width: int | None = None


@dataclass(frozen=True)
class ImageRequest:
    """One image to make: the settings ``onnxopt generate`` takes."""
    prompt: str
    negative_prompt: str | None
    seed: int
    steps: int
    guidance: float
    scheduler: str | None
    height: int | None
    width: int | None

    def compatible_key(self) -> tuple:
        """Images with equal keys can share one batched denoising run: same latent shape, same
        schedule, and the same guidance applied by the step (the step graph takes one guidance
        scale), which is none for every image with classifier-free guidance off (guidance <= 1):
        onnxopt.pipeline.batch.run_key, kept here without importing the pipeline."""
        return (self.height, self.width, self.steps, self.scheduler, self.guidance if self.guidance > 1 else None)


class RequestError(ValueError):
    """A request the service refuses: its HTTP status and one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_body(message: str) -> dict:
    return {"error": {"message": message}}


def parse_generation(raw: bytes, limits: Limits, defaults: Defaults, schedulers, size_factor: int = 8
                     ) -> list[ImageRequest]:
    """The images a request body asks for (n of them, seeds s..s+n-1), or a RequestError."""
    try:
        body = json.loads(raw, object_pairs_hook=_object_without_duplicates)
    except RequestError:  # a repeated key: a ValueError too, said as itself
        raise
    except (ValueError, UnicodeDecodeError):
        raise RequestError("the body is not JSON") from None
    except RecursionError:  # the C decoder recurses per nesting level: [[[[... was a 500 with a traceback
        raise RequestError("the body is not JSON (nested too deeply)") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    body = {name: value for name, value in body.items() if value is not None}  # null: the field left out, as OpenAI's
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    prompt = _text(body, "prompt", limits, required=True)
    negative = _text(body, "negative_prompt", limits)
    n = _integer(body, "n", 1, 1, limits.max_n)
    steps = _integer(body, "steps", defaults.steps, 1, limits.max_steps)
    guidance = body.get("guidance", defaults.guidance)
    # the bound before isfinite: math.isfinite(10**400) raises OverflowError (a JSON integer has no bound)
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or abs(guidance) > 1e4 \
            or not math.isfinite(guidance):
        raise RequestError(f"guidance must be a finite number (|guidance| <= 10000), got {_shown(guidance)}")
    scheduler = body.get("scheduler", defaults.scheduler)
    if scheduler is not None and scheduler not in schedulers:
        raise RequestError(f"unknown scheduler {_shown(scheduler)} (choose from {', '.join(schedulers)})")
    if body.get("response_format", "b64_json") != "b64_json":
        raise RequestError("response_format must be b64_json (the service returns images inline)")
    height, width = _size(body.get("size"), limits, defaults, size_factor)
    seed = _integer(body, "seed", None, 0, SEED_MAX - (n - 1))
    if seed is None:
        seed = secrets.randbelow(2**31)
    return [ImageRequest(prompt, negative, seed + i, steps, float(guidance), scheduler, height, width) for i in range(n)]


def _text(body: dict, name: str, limits: Limits, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(f"{name} is required")
        return None
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string")
    if required and not value.strip():
        raise RequestError(f"{name} is empty")
    if len(value) > limits.max_prompt_chars:
        raise RequestError(f"{name} has {len(value)} characters; the limit is {limits.max_prompt_chars}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates from "\ud800" in the JSON
        raise RequestError(f"{name} is not valid Unicode text") from None
    return value


def _integer(body: dict, name: str, default, low: int, high: int):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise RequestError(f"{name} must be in {low}..{high}, got {_shown(value)}")
    return value


def _size(size, limits: Limits, defaults: Defaults, factor: int) -> tuple[int | None, int | None]:
    if size is None:
        return defaults.height, defaults.width
    # ASCII digits only: str.isdigit takes '²' (int() refuses it: a 500) and '５１２' (a size no client means)
    parts = re.fullmatch(r"([0-9]+)x([0-9]+)", size) if isinstance(size, str) else None
    if parts is None:
        raise RequestError(f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '512x512', got {_shown(size)}")
    # a side of thousands of digits is out of range before int() (which refuses over 4300 digits)
    width, height = (int(p) if len(p) <= 9 else limits.max_side + 1 for p in parts.groups())
    for side in (width, height):
        if not factor <= side <= limits.max_side or side % factor:
            raise RequestError(f"size {_shown(size)}: each side must be a multiple of {factor} in "
                               f"{factor}..{limits.max_side}")
    return height, width


def _object_without_duplicates(pairs: list) -> dict:
    """A JSON object, refused when a key repeats: json.loads keeps the last value, another reader (a proxy
    that checked the request) the first, so the two would disagree on what was asked."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        counts = Counter(key for key, _ in pairs)  # linear: an object of 10**5 keys is one pass, not 10**10
        repeated = sorted(key for key, count in counts.items() if count > 1)[:5]
        raise RequestError(f"the body repeats field{'s' if len(repeated) > 1 else ''} {', '.join(map(repr, repeated))}")
    return obj


def _shown(value, limit: int = 40) -> str:
    """``value`` as a message shows it: its repr, cut to ``limit`` characters (a JSON integer of
    4000 digits, echoed whole, made a 4 KB message)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
