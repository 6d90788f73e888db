"""Shared setup of the tile-sweep scripts (tune_forward / tune_backward / tune_decode)."""

from __future__ import annotations

import itertools
import json

import torch


def allow_recompiles() -> None:
    """Each pinned configuration is a recompile of the same frame; without this Dynamo
    stops compiling after its recompile limit and the rest of a sweep would time the
    uncompiled function. Shapes stay static: a sweep over batch sizes or lengths would
    otherwise reuse one symbolic-shape compile, whose host-side choices (tiles, splits)
    were made from the first changed shape's sizes."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 10_000)
    torch._dynamo.config.automatic_dynamic_shapes = False


def grid_settings(grid_json: str) -> list[dict]:
    """Every combination of a ``--grid`` JSON object (kernel_options key -> list of
    values) as one kernel_options dict; [{}] for an empty grid."""
    grid = json.loads(grid_json)
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
