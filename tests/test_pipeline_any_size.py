"""Any size from one optimized folder: per-shape buffers and CUDA graphs in a bounded LRU cache.

The claims:
- sizes 64x64, 64x96 and 96x64 generated one after another from one optimized folder (dynamic
  shapes, one set of sessions) each give diffusers' image (fp32, CPU EP, the bound-buffer loop the
  CUDA EP runs; tolerances of test_pipeline_generate);
- with a recording stand-in for ORT's capture (each graph id's first run is its capture, as ORT's
  ``gpu_graph_id``), every new shape captures once, a cached shape never captures again, the least
  recently used shape is the one evicted past the cache's size, and an evicted shape that comes
  back gets new graph ids (an old id would replay into freed buffers).
"""

from __future__ import annotations

import pytest

from onnxopt.runners.capture_cache import CaptureCache


def test_the_cache_evicts_the_least_recently_used_and_never_reuses_an_id():
    cache = CaptureCache(2)
    cache.insert("a", cache.graph_ids(2))
    cache.insert("b", cache.graph_ids(2))
    assert cache.lookup("a") == (0, 1)  # a is now the most recently used
    cache.insert("c", cache.graph_ids(2))
    assert list(cache) == ["a", "c"] and cache.lookup("b") is None
    assert cache.insert("b", cache.graph_ids(2)) == (6, 7)
    assert list(cache) == ["c", "b"]
    assert cache.stats() == {"size": 2, "cached": 2, "captures": 4, "evictions": 2}
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError):
            CaptureCache(bad)


class RecordingCapture:
    """The step session with ORT's capture recorded: a graph id's first run is its capture."""

    def __init__(self, session):
        self.session, self.runs, self.captured = session, [], []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def run_with_iobinding(self, binding, options=None):
        graph = int(options.get_run_config_entry("gpu_graph_id")) if options is not None else -1
        if graph >= 0 and graph not in {g for g, _ in self.runs}:
            self.captured.append(graph)
        self.runs.append((graph, id(binding)))
        return self.session.run_with_iobinding(binding, options)


@pytest.mark.slow
def test_three_sizes_from_one_optimized_folder(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    pytest.importorskip("onnxruntime")
    from onnxopt.pipeline import Pipeline, optimize_folder
    from tests.test_pipeline_generate import THREADS, Built, assert_same_image

    b = Built("sd15", tmp_path_factory.mktemp("pipelines"))
    optimized = tmp_path_factory.mktemp("optimized") / "sd15"
    optimize_folder(b.folder, optimized, target="tensorrt")
    pipe = Pipeline.load(optimized, "cpu", io_binding=True, threads=THREADS, capture_cache=2)
    pipe.cuda_graph = True  # the step loop asks for graph ids as on the CUDA EP (the CPU EP ignores them)
    step = pipe.sessions["step"] = RecordingCapture(pipe.step_session())
    sizes = {"A": (64, 64), "B": (64, 96), "C": (96, 64)}
    captures = {}

    def generate(name: str, compare: bool = False):
        height, width = sizes[name]
        before = len(step.captured)
        result = pipe(scheduler="euler", progress=False, **b.request(steps=3, height=height, width=width))
        captures[name] = step.captured[before:]
        if compare:
            ref_latents, ref_pixels = b.reference("euler", steps=3, height=height, width=width)
            assert result.pixels.shape == (height, width, 3)
            assert_same_image(result.latents, result.pixels, ref_latents, ref_pixels)
        return result.timings["capture"]

    first = generate("A", compare=True)
    assert captures["A"] == [0, 1] and first["new_shape"] and first["capture_s"] is not None
    assert generate("B", compare=True)["new_shape"] and captures["B"] == [2, 3]
    again = generate("A")
    assert not again["new_shape"] and captures["A"] == [] and again["capture_s"] is None  # cached: replayed
    assert generate("C", compare=True)["evictions"] == 1 and captures["C"] == [4, 5]  # B was the least recent
    assert captures == {"A": [], "B": [2, 3], "C": [4, 5]} and not generate("A")["new_shape"]
    back = generate("B")
    assert back["new_shape"] and captures["B"] == [6, 7]  # evicted, so captured again on new ids
    assert back == dict(back, cached=2, captures=4, evictions=2, size=2)
    # the VAE decoder's bound buffers: one set per size, the same bound of two
    assert len(pipe.sessions["vae_decoder"].cache) == 2 and pipe.sessions["vae_decoder"].cache.evictions == 2
