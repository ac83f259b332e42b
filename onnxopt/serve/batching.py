"""Grouping a batch of queued requests into compatible groups, each one batched run.

Ray Serve's ``@serve.batch`` hands a replica every request queued within its wait window, with no
notion of which requests can share a denoising step; so the batch it hands over is split here by
:meth:`ImageRequest.compatible_key` (same size, steps, scheduler, and the guidance the step applies),
each group one batched run (:func:`onnxopt.pipeline.batch.generate_batch`), and the images handed
back to the requests they belong to, in order.
"""

from __future__ import annotations

from onnxopt.serve.api import ImageRequest


def compatible_groups(requests: list[list[ImageRequest]], max_images: int) -> list[list[tuple[int, int]]]:
    """Groups of (request index, image index) with one compatible key each and at most
    ``max_images`` images, in first-come order."""
    by_key: dict[tuple, list[list[tuple[int, int]]]] = {}
    order: list[list[tuple[int, int]]] = []
    for r, images in enumerate(requests):
        for i, image in enumerate(images):
            groups = by_key.setdefault(image.compatible_key(), [])
            if not groups or len(groups[-1]) >= max_images:
                groups.append([])
                order.append(groups[-1])
            groups[-1].append((r, i))
    return order


def run_grouped(requests: list[list[ImageRequest]], max_images: int, run_group) -> list:
    """``run_group(list of ImageRequest) -> list of results`` over each compatible group; per
    request, its results in its image order, or the exception its group's run raised (the other
    groups still run: one request's failure is not its neighbours')."""
    out: list[list] = [[None] * len(images) for images in requests]
    for group in compatible_groups(requests, max_images):
        try:
            results = run_group([requests[r][i] for r, i in group])
        except Exception as exc:  # noqa: BLE001 (handed to the requests it belongs to)
            results = [exc] * len(group)
        for (r, i), result in zip(group, results):
            out[r][i] = result
    return [next((x for x in results if isinstance(x, Exception)), results) for results in out]
