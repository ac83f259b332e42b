"""Any size from one folder: bound buffers and CUDA graphs per input shape, least recently used evicted.

The graphs stay dynamic (every size runs the same sessions); what is per shape is what a captured
CUDA graph needs to stay put, the buffers it reads and writes at fixed addresses, and the graph
ORT captured on those addresses under a ``gpu_graph_id``::

    request at a new shape ─ new entry: its buffers, fresh graph ids ─ first run of each id captures
    request at a cached shape ─ the entry moves to the front ─ its graphs replay (no capture)
    more than ``size`` shapes ─ the least recently used entry is dropped (its buffers freed)

Graph ids are never reused. ORT replays whatever it captured under an id, reading the addresses of
that capture, so an id given to a new entry after its first owner was evicted would replay into
freed buffers. ORT has no call that releases one captured graph, so an evicted shape's graph stays
in its session (a few MB of launch records; its activations live in ORT's arena, which every graph
shares); what eviction frees is the shape's bound buffers (latents, conditioning, K/V, residuals,
the VAE's image), the part that grows with the size.
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_SIZE = 4  # shapes kept: SD's common sizes (square, portrait, landscape) and one more


class CaptureCache(OrderedDict):
    """Entries by shape key, most recently used last, at most ``size`` of them.

    ``lookup(key)`` returns an entry (and marks it used) or None; ``insert(key, entry)`` adds one and
    evicts the least recently used past ``size``; ``graph_ids(n)`` gives n ids never given before.
    ``captures`` counts entries made (each captures its graphs on first use), ``evictions`` those dropped.
    """

    def __init__(self, size: int = DEFAULT_SIZE):
        super().__init__()
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"the capture cache holds at least one shape, got {size!r}")
        self.size, self.next_id, self.captures, self.evictions = size, 0, 0, 0

    def lookup(self, key):
        if key not in self:
            return None
        self.move_to_end(key)
        return self[key]

    def insert(self, key, entry):
        self[key] = entry
        self.captures += 1
        while len(self) > self.size:
            self.popitem(last=False)
            self.evictions += 1
        return entry

    def graph_ids(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_id, self.next_id + n))
        self.next_id += n
        return ids

    def stats(self) -> dict:
        return {"size": self.size, "cached": len(self), "captures": self.captures, "evictions": self.evictions}
