"""Two streams for ControlNet (seeds 001, 003): the UNet's part that does not wait for the ControlNet, cut off.

The step graph reads the ControlNet's residuals only where the UNet adds them to its skip
connections (after the down blocks) and to the mid block's output. Everything the step computes
before those Adds, and without them, can run while the ControlNet runs::

    step graph (unet/step.onnx):
        latents, step_index, schedules, K/V ─ time embedding ─ conv_in ─ down blocks ─┬─ skips ─┐
        ControlNet residuals ─────────────────────────────────────────────────────────┴─ Add ───┴─ mid ─ up ─ update

    after (unet/step.streams.down.onnx, then unet/step.streams.onnx):
        down:  latents, step_index, schedules, K/V ─ time embedding ─ conv_in ─ down blocks ─ skips, emb, ...
        rest:  skips, emb, ..., ControlNet residuals ─ Add ─ mid ─ up ─ update ─ latents_out, ...

    per step:   stream 1: ControlNet input graph ─ ControlNet ─┐
                stream 2: down ────────────────────────────────┴─ rest

More than one ControlNet (:mod:`onnxopt.pipeline.multi_controlnet`): the step graph reads one
residual set per ControlNet and sums them; the sums read residuals, so they fall in ``rest``, and
``down`` is the same graph as with one ControlNet. The ControlNets run one after another on the
worker thread (one input graph computes ``sample`` and ``timestep`` for all of them), beside
``down``::

    per step:   thread 2: input graph ─ ControlNet 0 ─ ControlNet 1 ─ ... ─┐
                thread 1: down ────────────────────────────────────────────┴─ rest (sums, mid, up, update)

The cut: a node belongs to ``down`` when nothing it reads depends on a residual input and some
node of ``rest`` needs what it computes; everything else (the nodes that read a residual, what
follows them, and side branches that only feed graph outputs, such as the step counter) stays in
``rest``. ``down`` is written as the companion of ``rest`` (see :mod:`onnxopt.model`): its outputs
feed ``rest``'s inputs of the same names. Both files refer to the UNet's own data file.

Whether two streams pay is measured, not assumed: the runner's ``Pipeline.load(two_streams=True)``
runs the two graphs and the ControlNet on two CUDA streams (:class:`TwoStreamStepLoop`), and the
pipeline benchmark's ablation compares it with one graph per step (:mod:`onnxopt.pipeline.merged_step`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import onnx_graphsurgeon as gs

from onnxopt.errors import UnsupportedModelError
from onnxopt.model import Model
from onnxopt.pipeline.folder import STREAMS_COMPANION, STREAMS_FILE
from onnxopt.pipeline.sessions import DeviceStepLoop, input_types

FILE, COMPANION = STREAMS_FILE, STREAMS_COMPANION  # the folder's names (onnxopt.pipeline.folder)


def split_step_graph(step: Model, residual_inputs) -> Model:
    """``step`` cut into ``rest`` (returned) with the companion ``down`` (see the module docstring).

    Raises UnsupportedModelError when ``step`` reads none of ``residual_inputs`` or nothing can
    run before them."""
    graph = step.graph
    graph.toposort()
    read = {t.name for t in graph.inputs} & set(residual_inputs)
    if not read:
        raise UnsupportedModelError("the step graph reads none of the ControlNet residuals "
                                    f"({', '.join(sorted(residual_inputs))})")
    nodes = graph.nodes
    tainted, constant = set(read), set()  # tensors computed from a residual; from constants alone
    late, free = set(), set()  # indices: nodes that wait for the ControlNet; nodes of constants alone
    for i, node in enumerate(nodes):
        names = [t.name for t in node.inputs if t.name]
        if any(name in tainted for name in names):
            late.add(i)
            tainted.update(t.name for t in node.outputs)
        elif all(isinstance(t, gs.Constant) or t.name in constant for t in node.inputs if t.name):
            free.add(i)
            constant.update(t.name for t in node.outputs)
    # down: the ancestors of the late nodes that neither wait nor compute constants (each part
    # computes its own constants, so none crosses the cut)
    producer = {t.name: i for i, n in enumerate(nodes) for t in n.outputs}
    early, stack = set(), [t.name for i in late for t in nodes[i].inputs]
    while stack:
        i = producer.get(stack.pop())
        if i is None or i in late or i in free or i in early:
            continue
        early.add(i)
        stack.extend(t.name for t in nodes[i].inputs)
    if not early:
        raise UnsupportedModelError("nothing in the step graph runs before the ControlNet residuals")
    crossing = {t.name for i, n in enumerate(nodes) if i not in early for t in n.inputs}
    crossing |= {t.name for t in graph.outputs}
    cut = sorted(name for name in crossing if producer.get(name) in early)
    return _parts(step, early, free, cut)


def _parts(step: Model, early: set[int], free: set[int], cut: list[str]) -> Model:
    from onnxopt.pipeline.step_graph import copy_sharing_constants

    down_graph = copy_sharing_constants(step.graph)  # a copy keeps the node order: indices hold
    down_graph.nodes = [n for i, n in enumerate(down_graph.nodes) if i in early or i in free]
    tensors = down_graph.tensors()
    down_graph.outputs = [tensors[name] for name in cut]
    down_graph.cleanup(remove_unused_graph_inputs=True)

    rest_graph = copy_sharing_constants(step.graph)
    tensors = rest_graph.tensors()
    for name in cut:  # the cut tensors become inputs: their producers are in down
        tensors[name].inputs.clear()
    rest_graph.nodes = [n for i, n in enumerate(rest_graph.nodes) if i not in early]
    rest_graph.inputs = [*rest_graph.inputs, *(tensors[name] for name in cut)]
    rest_graph.cleanup(remove_unused_graph_inputs=True)

    def model(graph, **extra):
        return Model(graph=graph, source=step.source, metadata_props=dict(step.metadata_props),
                     model_version=step.model_version, doc_string=step.doc_string, domain=step.domain,
                     node_scopes=dict(step.node_scopes), **extra)

    return model(rest_graph, companions={COMPANION: model(down_graph)})


def write_two_stream_graphs(unet_dir: str | os.PathLike, residual_inputs, *, step_file: str = "step.onnx") -> Path:
    """Split ``unet_dir/step_file`` into ``step.streams.onnx`` and ``step.streams.down.onnx`` beside it
    (atomically, weights referenced in the UNet's data file); returns the path of the first."""
    from onnxopt.loading import load_model
    from onnxopt.saving import save_model

    unet_dir = Path(unet_dir)
    rest = split_step_graph(load_model(unet_dir / step_file), residual_inputs)
    return save_model(rest, unet_dir / FILE, reference_external=True).path


class TwoStreamStepLoop(DeviceStepLoop):
    """The device loop with the step in two graphs and the ControlNet beside the first::

        thread 2 (the ControlNets' sessions, each on its own stream): input graph ─ ControlNet(s) ─┐
        thread 1 (down's session, its own CUDA stream):                down ─────────────────────────┴─ rest

    Each ORT session runs on a stream of its own and a bound run releases the GIL, so the
    two threads' GPU work can overlap; ``rest`` starts when both have returned (each run waits for
    its stream). The cut tensors (down's outputs, rest's inputs) are fixed buffers like every other,
    so each graph (three and one per ControlNet) can be captured; the two steps that capture run one
    graph at a time.
    Everything else is :class:`DeviceStepLoop`'s.
    """

    def __init__(self, ort, down_session, rest_session, controlnet_session, prepare_session, reuse_session=None, **kw):
        super().__init__(ort, rest_session, controlnet_session, prepare_session, reuse_session, **kw)
        self.down_session = down_session
        self.types = {**input_types(down_session), **input_types(rest_session)}
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="onnxopt-controlnet")
        self._captured: set[int] = set()  # parities whose graphs are captured: those run in parallel

    def step_inputs(self, parity: int) -> dict:
        return {**super().step_inputs(parity), **getattr(self, "cut", {})}

    def _bind_steps(self) -> None:
        # The cut buffers: their shapes from one uncaptured run of down on parity 0's inputs.
        down = self._captured_session(self.down_session)
        first = down.bind(self.step_inputs(0), graph_id=self.graph_ids[0])
        self.cut = first.outputs
        self._keep += self.cut.values()
        self.down_runs = [first, down.bind(self.step_inputs(1), self.cut, graph_id=self.graph_ids[1])]
        self.step_runs = [self.step_captured.bind(self.step_inputs(parity), self.step_outputs(parity),
                                                  graph_id=self.graph_ids[parity]) for parity in (0, 1)]

    def step(self, reuse: bool = False) -> None:
        if reuse:
            return super().step(reuse=True)
        parity = self.index % 2
        if parity in self._captured:
            controlnet = self._worker.submit(self.controlnet_step, parity)
            self.down_runs[parity].run()
            controlnet.result()
        else:  # the runs that capture: one at a time (ORT captures in CUDA's global mode, which fails
            # when another thread launches meanwhile; measured on the H100: "operation failed due to a
            # previous error during capture")
            self.controlnet_step(parity)
            self.down_runs[parity].run()
            self._captured.add(parity)
        self.step_runs[parity].run()
        self.index += 1
