"""Shared setup of the tile-sweep scripts (tune_forward / tune_backward / tune_decode)."""

from __future__ import annotations

import torch


def allow_recompiles() -> None:
    """Each pinned configuration is a recompile of the same frame; without this Dynamo
    stops compiling after its recompile limit and the rest of a sweep would time the
    uncompiled function."""
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 10_000)
