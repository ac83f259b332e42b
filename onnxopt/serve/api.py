"""The HTTP API: the OpenAI images request shape checked against the service's limits.

    POST /v1/images/generations
    {"prompt": str, "negative_prompt"?: str, "n"?: int, "size"?: "WxH", "steps"?: int,
     "guidance"?: float, "seed"?: int, "scheduler"?: str, "response_format"?: "b64_json"}
    -> {"created": unix seconds, "data": [{"b64_json": PNG, "seed": int}, ...]}

A request is refused whole, before any work, with a 4xx and ``{"error": {"message": ...}}``.
Seeds: image ``i`` (0-based) of a request with seed ``s`` is made with seed ``s + i``, so
``onnxopt generate --seed s+i`` with the same settings makes the same image. Without a seed the
service draws ``s`` at random and returns every image's seed. Nothing here needs Ray.
"""

from __future__ import annotations

import json
import math
import secrets
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
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RequestError("the body is not JSON") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise RequestError(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}")
    prompt = _text(body, "prompt", limits, required=True)
    negative = _text(body, "negative_prompt", limits)
    n = _integer(body, "n", 1, 1, limits.max_n)
    steps = _integer(body, "steps", defaults.steps, 1, limits.max_steps)
    guidance = body.get("guidance", defaults.guidance)
    if isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not math.isfinite(guidance) \
            or abs(guidance) > 1e4:
        raise RequestError(f"guidance must be a finite number (|guidance| <= 10000), got {guidance!r}")
    scheduler = body.get("scheduler", defaults.scheduler)
    if scheduler is not None and scheduler not in schedulers:
        raise RequestError(f"unknown scheduler {scheduler!r} (choose from {', '.join(schedulers)})")
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
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise RequestError(f"{name} must be in {low}..{high}, got {value}")
    return value


def _size(size, limits: Limits, defaults: Defaults, factor: int) -> tuple[int | None, int | None]:
    if size is None:
        return defaults.height, defaults.width
    if not isinstance(size, str) or size.count("x") != 1 or not all(p.isdigit() for p in size.split("x")):
        raise RequestError(f"size must be 'WIDTHxHEIGHT' in pixels, e.g. '512x512', got {size!r}")
    width, height = (int(p) for p in size.split("x"))
    for side in (width, height):
        if not factor <= side <= limits.max_side or side % factor:
            raise RequestError(f"size {size}: each side must be a multiple of {factor} in {factor}..{limits.max_side}")
    return height, width
