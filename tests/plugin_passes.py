"""Passes used by the tests: a deliberately wrong rewrite and a fusion that never matches.

They are registered the way a third-party package would register them: through the
``onnxopt.passes`` entry-point group (see test_pass_manager.py).
"""

from onnxopt.graph_edit import is_standard
from onnxopt.pass_infra import Pass, PassResult


class AddToSub(Pass):
    """Planted wrong rewrite: every Add becomes Sub. --verify must name it."""

    name = "test-add-to-sub"
    description = "WRONG on purpose: Add -> Sub"

    def run(self, model):
        adds = [n for n in model.graph.nodes if n.op == "Add" and is_standard(n)]
        for node in adds:
            node.op = "Sub"
        return PassResult(modified=bool(adds), sites_matched=len(adds), sites_rewritten=len(adds))


class NeverMatches(Pass):
    name = "test-fuse-nothing"
    description = "a fusion whose pattern occurs nowhere"
    is_fusion = True

    def run(self, model):
        return PassResult(modified=False)


class _Marker(Pass):
    """Changes nothing; exists to exercise requirement handling."""

    description = "test marker"

    def run(self, model):
        return PassResult(modified=False)


class ProvidesA(_Marker):
    name = "test-provides-a"
    provides = frozenset({"test-a"})


class ProvidesB(_Marker):
    name = "test-provides-b"
    requires = frozenset({"test-a"})
    provides = frozenset({"test-b"})


class NeedsB(_Marker):
    name = "test-needs-b"
    requires = frozenset({"test-b"})
