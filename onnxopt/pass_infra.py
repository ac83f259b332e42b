"""What a pass is: a named, self-describing rewrite of a :class:`~onnxopt.model.Model`.

A pass declares
* ``name`` and a one-line ``description`` (shown by ``onnxopt passes``),
* ``targets`` it applies to (``ort-cuda``, ``tensorrt``; default: all),
* graph properties it ``requires`` before it runs and ``provides`` after it ran. The pass manager
  establishes a missing requirement by running the registered pass that provides it, and drops
  every property a modifying pass does not list in ``provides`` or ``preserves``,
* passes it must follow when both are in one run (``runs_after``: name -> why); the manager
  refuses a list that puts them the other way round, before any work,
* whether it also applies to a model's companions (``applies_to_companions``, see
  :mod:`onnxopt.model`): by default every pass that runs after a split runs on both parts,
* the passes that complete it (``followers``, each one of ``possible_followers``): the manager runs
  them right after it, as steps of their own, reported, timed and verified one by one (nhwc-conv,
  then sink-transposes),
* whether it ``rebases_verification``: it computes more exactly than the source (float32 where the
  source rounded), and ``--verify`` compares it and every later step with the source rewritten by it,
* whether it ``traces`` its pattern candidates: its ``run`` then takes ``tracer=``, which the pass
  manager passes for the passes ``--explain`` names (every candidate, and why it failed).

``run`` edits ``model.graph`` in place and returns a :class:`PassResult` saying what it did: how
many sites fit its pattern, how many it rewrote, and why it refused the others.
"""

from __future__ import annotations

import abc
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator

from onnxopt.model import Model

TARGETS = frozenset({"ort-cuda", "tensorrt"})

# Graph properties passes can require and provide.
SHAPES_INFERRED = "shapes-inferred"  # every tensor the ONNX shape inference can type has dtype/shape
CONSTANTS_FOLDED = "constants-folded"
NO_DEAD_NODES = "no-dead-nodes"
ATTENTION_CANONICAL = "attention-canonical"  # every attention in one form (canonicalize-attention's docstring)
SLICES_AS_SPLIT = "slices-as-split"  # no Slices that tile an axis of one tensor are left (they are Splits)
# What a pass that only annotates tensors keeps: every property (annotations change no computation).
EVERY_PROPERTY = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED, NO_DEAD_NODES, ATTENTION_CANONICAL, SLICES_AS_SPLIT})


@dataclass
class PassResult:
    modified: bool
    sites_matched: int = 0  # sites that fit the pass's pattern
    sites_rewritten: int = 0  # of those, how many it rewrote
    refused: list[tuple[str, str]] = field(default_factory=list)  # (site, reason) for matched-but-refused
    details: dict[str, Any] = field(default_factory=dict)  # pass-specific facts for the report
    nothing_to_do: str = ""  # why a pass found no site at all, said instead of the generic "nothing to fuse"
    trace: Any = None  # a pattern Tracer, when the pass was asked to explain itself (--explain)

    def refuse(self, site: str, reason: str) -> None:
        self.refused.append((site, reason))

    def refusal_counts(self) -> Counter:
        return Counter(reason for _, reason in self.refused)


class Pass(abc.ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    targets: ClassVar[frozenset[str]] = TARGETS
    requires: ClassVar[frozenset[str]] = frozenset()
    provides: ClassVar[frozenset[str]] = frozenset()
    preserves: ClassVar[frozenset[str]] = frozenset()
    # A fusion reports "nothing to fuse" when it matched no site; a cleanup pass does not.
    is_fusion: ClassVar[bool] = False
    # (atol, rtol) a pass that changes numerics (fp16) needs from --verify, from it on; None: exact
    # up to the user's tolerance.
    verify_tolerance: ClassVar[tuple[float, float] | None] = None
    # The pass makes the graph compute more exactly than the source (widen-periodic-arguments
    # computes in float32 what a bfloat16 source rounded): its result differs from the source by
    # the source's own error, which tests bound against the float32 module. --verify then compares
    # it, and every later step, with the source rewritten by the same pass.
    rebases_verification: ClassVar[bool] = False
    # Passes that, when in the same run, must come before this one: name -> why.
    runs_after: ClassVar[dict[str, str]] = {}
    # Run on the companions too (fp16 converts the context-KV graph as well as the denoiser).
    applies_to_companions: ClassVar[bool] = True
    # Every name ``followers`` may return (the CLI checks an --explain name against them before any work).
    possible_followers: ClassVar[frozenset[str]] = frozenset()
    # ``run`` takes ``tracer=`` (a pattern Tracer) and records every candidate on it.
    traces: ClassVar[bool] = False

    def __call__(self, model: Model, *, tracer=None) -> PassResult:
        """Run the pass; ``tracer`` (``--explain``) reaches a pass that ``traces``, others run as always."""
        return self.run(model, tracer=tracer) if tracer is not None and self.traces else self.run(model)

    def followers(self, result: PassResult) -> list[str]:
        """Names of the passes that complete this one after a run that gave ``result`` (some of
        ``possible_followers``); the pass manager runs each right after it, as its own step (default: none)."""
        return []

    @abc.abstractmethod
    def run(self, model: Model) -> PassResult:
        """Rewrite ``model.graph`` in place and say what was done."""

    def __repr__(self) -> str:
        return f"<pass {self.name}>"


class OrtFusion(Pass):
    """A fusion into ONNX Runtime's com.microsoft ops: the ORT CUDA target, reads inferred shapes,
    annotates the tensors it writes and folds nothing new. Subclasses override what differs."""

    targets = frozenset({"ort-cuda"})
    requires = frozenset({SHAPES_INFERRED})
    preserves = frozenset({SHAPES_INFERRED, CONSTANTS_FOLDED})
    is_fusion = True


class Sequence(Pass):
    """Passes run as one: the pass manager runs each of ``steps`` as a step of its own (reported,
    timed, verified and property-checked like any other). With ``fixpoint`` it repeats them until
    ``len(steps)`` steps in a row modified nothing, at most ``max_rounds`` times round; a sequence
    still changing the model then is a bug in one of its passes (an error naming them)::

        cleanup = remove-identity, infer-shapes, fold-constants, ..., eliminate-dead-nodes   (fixpoint)

    ``steps`` are pass names, which ``lookup`` turns into passes (the registry's ``get_pass`` for
    the sequences it makes: :func:`onnxopt.registry.fixpoint_sequence`). Outside the pass manager,
    :meth:`run` runs them the same way, unreported.
    """

    steps: ClassVar[tuple[str, ...]] = ()
    lookup: ClassVar[Callable[[str], type[Pass]]]
    fixpoint: ClassVar[bool] = False
    max_rounds: ClassVar[int] = 8

    def schedule(self) -> "Iterator[tuple[int, str]]":
        """(round, step name) in the order to run them; the caller ``send``s whether each modified the model."""
        n = len(self.steps)
        modified_last: dict[str, bool] = {}  # each step's verdict in its latest run
        for i in range(self.max_rounds * n if self.fixpoint else n):
            name = self.steps[i % n]
            modified_last[name] = bool((yield i // n + 1, name))
            if self.fixpoint and i >= n - 1 and not any(modified_last.values()):
                return  # n steps in a row changed nothing
        if self.fixpoint:
            still = ", ".join(name for name, modified in modified_last.items() if modified)
            raise RuntimeError(f"{self.name} reached no fixpoint in {self.max_rounds} rounds: {still} still modify the model")

    def run(self, model: Model) -> PassResult:
        result = PassResult(modified=False)
        schedule = self.schedule()
        modified = None
        try:
            while True:
                _, name = schedule.send(modified)
                modified = type(self).lookup(name)()(model).modified
                result.modified = result.modified or modified
        except StopIteration:
            return result
