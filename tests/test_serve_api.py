"""The service's request checks and batch grouping, without Ray or a pipeline."""

from __future__ import annotations

import json

import pytest

from onnxopt.serve.api import SEED_MAX, Defaults, Limits, RequestError, parse_generation
from onnxopt.serve.batching import compatible_groups, run_grouped

SCHEDULERS = ("ddim", "euler")


def parse(body, limits=Limits()):
    return parse_generation(json.dumps(body).encode(), limits, Defaults(), SCHEDULERS, size_factor=8)


def test_n_images_get_consecutive_seeds_and_the_request_settings():
    images = parse({"prompt": "a cat", "n": 3, "seed": 40, "size": "96x64", "steps": 7, "guidance": 3})
    assert [i.seed for i in images] == [40, 41, 42]
    assert {(i.width, i.height, i.steps, i.guidance, i.scheduler) for i in images} == {(96, 64, 7, 3.0, None)}


def test_a_request_without_seed_gets_one_and_defaults():
    images = parse({"prompt": "a cat", "n": 2})
    assert images[1].seed == images[0].seed + 1 and images[0].steps == Defaults().steps


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "seed": SEED_MAX, "n": 2}, "seed must be in"),
    ({"prompt": "x", "n": True}, "n must be an integer"),
    ({"prompt": "x", "guidance": float("nan")}, "finite"),
    ({"prompt": "x", "size": "512"}, "WIDTHxHEIGHT"),
    ({"prompt": "x", "size": "+8x8"}, "WIDTHxHEIGHT"),
    ({"prompt": "  "}, "empty"),
    ({"prompt": "x", "steps": 0}, "steps must be in"),
])
def test_refusals(body, needle):
    with pytest.raises(RequestError, match=needle):
        parse(body)


def test_limits_are_the_configured_ones():
    tight = Limits(max_n=1, max_side=64, max_steps=5, max_prompt_chars=3)
    for body in ({"prompt": "x", "n": 2}, {"prompt": "x", "size": "72x64"}, {"prompt": "x", "steps": 6},
                 {"prompt": "abcd"}):
        with pytest.raises(RequestError):
            parse(body, tight)
    assert parse({"prompt": "abc", "size": "64x64", "steps": 5}, tight)


def test_compatible_requests_share_a_group_up_to_the_batch_size():
    a = parse({"prompt": "a", "n": 3, "seed": 0, "size": "64x64", "steps": 4})
    b = parse({"prompt": "b", "seed": 9, "size": "64x64", "steps": 4})
    other_size = parse({"prompt": "c", "seed": 0, "size": "128x64", "steps": 4})
    no_cfg = parse({"prompt": "d", "seed": 0, "size": "64x64", "steps": 4, "guidance": 1})
    groups = compatible_groups([a, other_size, b, no_cfg], max_images=2)
    assert groups == [[(0, 0), (0, 1)], [(0, 2), (2, 0)], [(1, 0)], [(3, 0)]]  # in order of each group's first image


def test_results_go_back_to_their_requests_in_order():
    a = parse({"prompt": "a", "n": 2, "seed": 0, "steps": 4})
    b = parse({"prompt": "b", "seed": 5, "steps": 4})
    out = run_grouped([a, b], 4, lambda group: [(r.prompt, r.seed) for r in group])
    assert out == [[("a", 0), ("a", 1)], [("b", 5)]]
