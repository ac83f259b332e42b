"""An HTTP image service for a pipeline folder on Ray Serve (``onnxopt serve``; the ``serve`` extra).

:mod:`~onnxopt.serve.api` (the request shape and limits), :mod:`~onnxopt.serve.adapter` (the one
place that calls onnxopt.pipeline), :mod:`~onnxopt.serve.batching` (compatible groups),
:mod:`~onnxopt.serve.deployment` (the Ray Serve replica), :mod:`~onnxopt.serve.command` (the CLI).
Importing this package imports nothing of Ray.
"""
