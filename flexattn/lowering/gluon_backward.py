"""The Gluon backward template for Hopper (``templates/gluon_backward.py.jinja``) and its
grid; ``backward.lower_backward`` prepares the call as for the Triton template (in its
DQ_ATOMIC form) and hands this template the choice where ``backward_plan`` says so."""

from __future__ import annotations

from torch._inductor.select_algorithm import SymbolicGridFn

from ..templates import gluon_kernel_source
from .gluon_template import GluonTemplate

TEMPLATE_NAME = "flexattn_gluon_backward"


@SymbolicGridFn
def gluon_backward_grid(batch, kv_heads, q_len, kv_len, meta, *, cdiv):
    """(key tiles of BLOCK_N, batch, KV heads), from ``call_sizes`` = (B, Hkv, Q_LEN, KV_LEN)."""
    return cdiv(kv_len, meta["BLOCK_N"]), batch, kv_heads


gluon_backward_template = GluonTemplate(
    name=TEMPLATE_NAME,
    grid=gluon_backward_grid,
    source=gluon_kernel_source("gluon_backward"),
)
