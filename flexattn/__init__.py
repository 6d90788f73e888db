"""flexattn: FlexAttention as a torch.compile / Inductor plugin.

Write an attention variant as a tiny ``score_mod(score, b, h, q_idx, kv_idx)`` and/or
``mask_mod(b, h, q_idx, kv_idx)``; flexattn captures it under ``torch.compile`` and runs
it as fused, block-sparse kernels. The API mirrors ``torch.nn.attention.flex_attention``.
"""

from . import _dynamo_capture, _logging
from .api import AuxOutput, AuxRequest, eager_mods, flex_attention
from .options import FlexKernelOptions
from .block_mask import (
    BlockMask,
    and_masks,
    create_block_mask,
    create_mask,
    noop_mask,
    or_masks,
)
from . import mods
from .paged import PagedKVCache
from .kvcache import flex_attention_with_kvcache

# Dynamo learns the operator when it is imported, and the Inductor lowerings are
# registered when Dynamo first captures a call: importing flexattn imports neither.
_dynamo_capture.register()
_logging.configure_from_env()

__version__ = "0.1.0"

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "FlexKernelOptions",
    "PagedKVCache",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "eager_mods",
    "flex_attention",
    "flex_attention_with_kvcache",
    "mods",
    "noop_mask",
    "or_masks",
]
