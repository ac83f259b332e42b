"""The weight-provenance record forgets a values object when it dies, also at interpreter exit.

At exit Python sets a module's globals to None before the last objects die; a weakref callback that
looked the record up as a global then raised in every CLI run that still held rewritten weights,
and Python printed an 'Exception ignored ... Traceback' block per object on stderr.
"""

from __future__ import annotations

import gc
import sys

import numpy as np


def test_a_dying_values_object_is_forgotten_even_after_the_module_globals_are_gone(monkeypatch):
    from onnxopt import weight_provenance

    raised = []
    monkeypatch.setattr(sys, "unraisablehook", raised.append)
    values = weight_provenance.record(np.ones(3, np.float32), [("w", [])])
    table = weight_provenance._RECORD
    key = id(values)
    assert key in table
    monkeypatch.setattr(weight_provenance, "_RECORD", None)  # what interpreter shutdown does to globals
    del values
    gc.collect()
    assert raised == [] and key not in table
