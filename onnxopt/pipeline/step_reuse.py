"""Step reuse: chosen later steps reuse the previous step's guided model output.

At a reused step the UNet does not run; the scheduler update alone advances the latents with the
last computed guided output ``eps``::

    computed step k:  latents, state ─ step graph (UNet + guidance + update) ─ latents', state',
                                                                             guided_output ─┐
    reused step k+1:  latents', state', guided_output (step k's) ─ reuse graph ─ latents'', state''
    reuse graph:      step_index ─ Gather(schedule_coefficients) ─ c_x, c_eps, c_state, d_x, d_eps
                      latents_out = c_x * latents + c_eps * eps + c_state * state
                      state_out   = d_x * latents + d_eps * eps;  step_index_out = step_index + 1

That is diffusers' ``scheduler.step(eps_prev, t, latents)``, the same update the step graph
appends, read from the same schedule table; so the reused loop equals diffusers' loop fed the
cached prediction (``tests/test_pipeline_generate.py``). It is opt-in: an approximation whose
quality is measured against the full schedule and against fewer steps of the same compute
(``benchmarks/pipeline_gpu.py``), never a default.

Schedules (``--reuse``): comma-separated step indices (0-based) and ranges ``a-b`` (inclusive)
with an optional stride ``a-b:s``; ``"30-49:2"`` reuses steps 30, 32, ..., 48. Step 0 has no
previous prediction and cannot be reused.
"""

from __future__ import annotations

import numpy as np

from onnxopt.errors import OnnxoptError


class ReuseScheduleError(OnnxoptError):
    """A --reuse schedule that does not parse or does not fit the step count (exit code 2)."""


def parse_reuse(spec: str | None, steps: int) -> frozenset[int]:
    """The 0-based steps that reuse the previous prediction, from ``spec`` (see the module docstring)."""
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return frozenset()
    if not isinstance(spec, str):  # an iterable of step indices (Python API)
        chosen = {int(k) for k in spec}
    else:
        chosen = set()
        for part in spec.split(","):
            part = part.strip()
            try:
                if "-" in part:
                    bounds, _, stride = part.partition(":")
                    first, last = (int(x) for x in bounds.split("-"))
                    step = int(stride) if stride else 1
                    if step < 1 or last < first:
                        raise ValueError
                    outside = first if first >= steps else first + -(-(steps - first) // step) * step
                    if outside <= last:  # before the set is made: "1-99999999999999999999" filled the memory
                        raise ReuseScheduleError(f"--reuse: step {outside} is outside 0..{steps - 1}")
                    chosen.update(range(first, last + 1, step))
                else:
                    chosen.add(int(part))
            except ValueError:
                raise ReuseScheduleError(f"--reuse: cannot read '{part}' (give steps like 30-49:2,45)") from None
    if 0 in chosen:
        raise ReuseScheduleError("--reuse: step 0 has no previous prediction to reuse")
    outside = sorted(k for k in chosen if k < 0 or k >= steps)
    if outside:
        raise ReuseScheduleError(f"--reuse: step {outside[0]} is outside 0..{steps - 1}")
    return frozenset(chosen)


def reuse_step_model(opset: int = 17) -> bytes:
    """The reuse graph of the module docstring (float32 latents, state and guided output)."""
    import onnx_graphsurgeon as gs

    from onnxopt.fusion import Emit, NameAuthority
    from onnxopt.pipeline.sessions import serialized_graph

    f32, latent = np.float32, ["images", 4, "height", "width"]
    graph = gs.Graph(name="reuse_step", opset=opset)
    make = Emit(graph, NameAuthority(graph), "reuse")
    latents, state, step_index, coefficients, eps = (
        make.variable(name, dtype, shape, exact=True) for name, dtype, shape in (
            ("latents", f32, latent), ("state", f32, latent), ("step_index", np.int64, [1]),
            ("schedule_coefficients", f32, ["schedule", 6]), ("guided_output", f32, latent)))
    latents_out, state_out = (make.variable(name, f32, latent, exact=True) for name in ("latents_out", "state_out"))
    step_index_out = make.variable("step_index_out", np.int64, [1], exact=True)

    row = make.op.Gather(coefficients, step_index, axis=0, _shape=[1, 6])
    _, c_x, c_eps, c_state, d_x, d_eps = make.op.Split(row, make.constant("sizes", np.ones(6, np.int64)), axis=1,
                                                       _outputs=6, _shape=[1, 1])
    x_term, eps_term, state_term = (make.op.Mul(c, x, _shape=latent) for c, x in ((c_x, latents), (c_eps, eps), (c_state, state)))
    make.op.Add(make.op.Add(x_term, eps_term), state_term, _outputs=[latents_out])
    make.op.Add(make.op.Mul(d_x, latents, _shape=latent), make.op.Mul(d_eps, eps, _shape=latent), _outputs=[state_out])
    make.op.Add(step_index, make.constant("one", np.ones(1, np.int64)), _outputs=[step_index_out])
    make.into(graph)
    graph.inputs = [latents, state, step_index, coefficients, eps]
    graph.outputs = [latents_out, state_out, step_index_out]
    return serialized_graph(graph)
