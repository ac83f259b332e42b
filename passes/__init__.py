"""onnxopt's built-in passes, one module each. Importing this package registers them."""

from . import (  # noqa: F401  (imported for registration)
    cast_chains,
    dead_nodes,
    fold_constants,
    identity,
    shape_inference,
)
