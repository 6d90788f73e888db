"""flexattn's progress log: what it compiles, with which configuration, and how long it took.

Records go to the ``flexattn`` loggers: ``flexattn.lowering`` (one line per kernel a
compile lowers: shapes, the tile configuration, the lowering and autotuning time),
``flexattn.api`` (each compile of the operator for a call made outside torch.compile,
with its time), ``flexattn.cpu`` (the C++ libraries of the CPU engine built or loaded,
with their times) and ``flexattn.block_mask`` (create_block_mask builds that take long).
They are INFO records, silent by default; ``FLEXATTN_LOG=info`` in the environment
prints them to stderr (``debug`` shows more), as does configuring the ``flexattn``
logger yourself.

One thing is said by default: the CPU engine's one-time build (about 20 s) is announced
before it starts and its time given after, as two WARNING records of ``flexattn.cpu``,
which Python prints to stderr when no logging is configured; a run that finds the
engine cached prints nothing. ``FLEXATTN_LOG=error`` (or the ``flexattn`` logger set to
ERROR) silences them.
"""

from __future__ import annotations

import logging
import os
import warnings

ENV_VAR = "FLEXATTN_LOG"
_LEVELS = {"1": logging.INFO, "info": logging.INFO, "debug": logging.DEBUG, "warning": logging.WARNING,
           "error": logging.ERROR}


class _Handler(logging.StreamHandler):
    """The stderr handler FLEXATTN_LOG installs (a class of its own, so it is added once)."""


def configure_from_env() -> None:
    """Apply FLEXATTN_LOG, if set, to the ``flexattn`` logger."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value or value == "0":
        return
    level = _LEVELS.get(value)
    if level is None:
        warnings.warn(f"flexattn: {ENV_VAR} must be one of {sorted(_LEVELS)} (or 0), got {value!r}; ignored",
                      stacklevel=2)
        return
    logger = logging.getLogger("flexattn")
    logger.setLevel(level)
    if not any(isinstance(h, _Handler) for h in logger.handlers):
        handler = _Handler()
        handler.setFormatter(logging.Formatter("[flexattn %(asctime)s] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
