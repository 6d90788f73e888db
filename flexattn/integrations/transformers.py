"""flexattn as a Hugging Face transformers attention implementation, in one call.

    import flexattn.integrations.transformers

    flexattn.integrations.transformers.register()  # the name "flexattn"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flexattn")

transformers looks an implementation's name up in two registries: ``AttentionInterface``
for the attention function and ``AttentionMaskInterface`` for the function that builds
each forward's mask. A name found only in the first is taken for a kernel that needs no
mask, so the model would run with no causal, padding or sliding-window mask at all.
``register`` fills both under one name: ``attention_forward`` runs ``flex_attention``
and ``create_mask`` builds the block mask from transformers' mask pattern, the padding
mask and the cache offsets. ``attention_forward`` refuses to run a causal layer
on more than one query with no mask, the sign of the attention function registered
alone.

The attention function covers the arguments transformers' models pass: ``scaling``,
grouped-query heads, ``dropout`` (flexattn's fused dropout), ``softcap`` (Gemma 2's
logit soft-capping, a tanh score_mod), ``s_aux`` (gpt-oss's attention sinks) and
``kernel_options``. Sliding windows and chunked attention come in the mask. It runs
eagerly (flexattn compiles its kernels on first use) and inside ``torch.compile``.
Tested with transformers 4.57 and 5.x; this module imports transformers only inside
``register``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from ..api import flex_attention
from ..block_mask import BlockMask, create_block_mask
from ..mods import tanh_softcap

__all__ = ["DEFAULT_NAME", "attention_forward", "create_mask", "register"]

#: The name ``register`` uses unless given another: ``attn_implementation="flexattn"``.
DEFAULT_NAME = "flexattn"

MISSING_MASK_ERROR = (
    "flexattn: the attention function got no attention mask for the causal layer {layer} with {length} "
    "queries, so every query would see later tokens. transformers builds masks only for an implementation "
    "that is also in AttentionMaskInterface; register flexattn with "
    "flexattn.integrations.transformers.register(name) instead of AttentionInterface.register alone."
)


def register(name: str = DEFAULT_NAME) -> str:
    """Make flexattn transformers' attention implementation ``name``: its attention
    function in ``AttentionInterface`` and its mask function in
    ``AttentionMaskInterface``, so that ``attn_implementation=name`` runs causal,
    padded, sliding-window, soft-capped and attention-sink models right. Calling it again
    is harmless. Returns ``name``.

    Raises ImportError when transformers (4.57 or newer) is not installed, TypeError or
    ValueError for a name that is not a non-empty string, and ValueError for a name
    transformers already uses for another implementation ("sdpa", "flex_attention", ...).
    """
    if not isinstance(name, str):
        raise TypeError(f"flexattn: register's name must be a str, got {type(name).__name__}")
    if not name:
        raise ValueError("flexattn: register's name must be a non-empty str, got ''")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as error:
        raise ImportError(
            "flexattn.integrations.transformers.register needs Hugging Face transformers 4.57 or newer "
            "(AttentionInterface and AttentionMaskInterface): pip install 'transformers>=4.57'"
        ) from error
    for registry, ours in ((AttentionInterface, attention_forward), (AttentionMaskInterface, create_mask)):
        taken = registry._global_mapping.get(name)
        if taken is not None and taken is not ours:
            raise ValueError(
                f"flexattn: the name {name!r} is already transformers' {registry.__name__} entry "
                f"{getattr(taken, '__module__', '?')}.{getattr(taken, '__qualname__', taken)}; pick another name"
            )
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, create_mask)
    return name


# --------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------
def attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: BlockMask | Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    head_mask: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query (B, H, L, E), key and value
    (B, Hkv, S, E) in, the output as (B, L, H, Ev) and no attention weights out.

    ``attention_mask`` is the BlockMask ``create_mask`` built (flexattn's or torch's), a
    4-D tensor a caller passed the model as it is (bool: True attends; float: added to
    the scores), or None (every key visible). Other keyword arguments transformers passes
    (``sliding_window``, which the mask already holds, position ids, ...) are ignored,
    except ``is_causal`` (overriding ``module.is_causal``) and ``kernel_options``.
    """
    if head_mask is not None:
        raise ValueError("flexattn: head_mask is not supported by the flexattn attention implementation; "
                         "run the model with attn_implementation='eager' to mask heads")
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", False)
    score_mod = _softcap_mod(None if softcap is None else float(softcap))
    block_mask = None
    if attention_mask is None:
        if is_causal and query.shape[-2] > 1:
            layer = f"{type(module).__name__}" + (f" (layer {module.layer_idx})" if hasattr(module, "layer_idx") else "")
            raise RuntimeError(MISSING_MASK_ERROR.format(layer=layer, length=query.shape[-2]))
    elif isinstance(attention_mask, Tensor):
        block_mask, score_mod = _from_dense_mask(attention_mask, score_mod, query, key)
    else:
        block_mask = attention_mask
    out = flex_attention(
        query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], kernel_options=kwargs.get("kernel_options"), sinks=s_aux,
        dropout_p=dropout,
    )
    return out.transpose(1, 2).contiguous(), None


#: One score_mod per cap value, the same function object at every call, so flexattn's
#: compiled operator is reused rather than traced again for a new closure.
_SOFTCAP_MODS: dict[float, Callable] = {}


def _softcap_mod(softcap: float | None) -> Callable | None:
    if softcap is None:
        return None
    if softcap not in _SOFTCAP_MODS:
        _SOFTCAP_MODS[softcap] = tanh_softcap(softcap)
    return _SOFTCAP_MODS[softcap]


def _from_dense_mask(mask: Tensor, score_mod: Callable | None, query: Tensor, key: Tensor
                     ) -> tuple[BlockMask | None, Callable | None]:
    """(block_mask, score_mod) for a 4-D mask tensor (B or 1, H or 1, L, >= S): a bool
    one becomes a BlockMask, a float one a score added after ``score_mod``."""
    B, H, L = query.shape[:3]
    S = key.shape[-2]
    if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, H) \
            or mask.shape[2] != L or mask.shape[3] < S:
        raise ValueError(f"flexattn: a tensor attention_mask must be 4-D (B or 1, H or 1, L, >= S) = "
                         f"({B} or 1, {H} or 1, {L}, >= {S}), got shape {tuple(mask.shape)}")
    mask = mask[..., :S].expand(B, H, L, S).to(query.device)
    if mask.dtype == torch.bool:
        def dense_mask_mod(b, h, q_idx, kv_idx):
            return _read(mask, b, h, q_idx, kv_idx)

        return create_block_mask(dense_mask_mod, B, H, L, S, device=query.device), score_mod

    def additive_score_mod(score, b, h, q_idx, kv_idx):
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        return score + _read(mask, b, h, q_idx, kv_idx)

    return None, additive_score_mod


def _read(table: Tensor, *indices: Tensor) -> Tensor:
    """``table[indices]`` for 0-d (or batched) index tensors as one ``aten.index``, which
    keeps the indices tensors under tracing instead of turning them into Python ints."""
    return torch.ops.aten.index.Tensor(table, list(indices))


# --------------------------------------------------------------------------------------
# The mask function
# --------------------------------------------------------------------------------------
def create_mask(
    batch_size: int,
    cache_position: Tensor | None = None,
    kv_length: int | None = None,
    kv_offset: int | Tensor = 0,
    mask_function: Callable | None = None,
    attention_mask: Tensor | None = None,
    *,
    q_length: int | None = None,
    q_offset: int | Tensor = 0,
    device: Any = None,
    **kwargs: Any,
) -> Any:
    """transformers' mask-function contract, in both of its forms: 4.x passes the
    queries' ``cache_position``, 5.x their ``q_length`` and ``q_offset``.

    Returns the BlockMask (B = ``batch_size``, one head row; flexattn's block tables in
    torch's BlockMask type, see ``_as_torch_block_mask``) of ``mask_function`` (transformers' causal, sliding-window, chunked, packed-sequence or
    bidirectional pattern over absolute positions), restricted to the keys the 2-D
    ``attention_mask`` (B, >= kv_offset + kv_length) marks as real, for ``q_length``
    queries at ``q_offset`` and ``kv_length`` keys at ``kv_offset``. Always a mask, never
    None: transformers' skips for plain causal or full masks would reach the attention
    function as "no mask". Other keyword arguments (sdpa's and eager's) are ignored.
    """
    if q_length is None:
        if cache_position is None:
            raise TypeError("flexattn: create_mask needs q_length (transformers 5) or cache_position (transformers 4)")
        q_length, q_offset, device = cache_position.shape[0], cache_position[0], cache_position.device
    if kv_length is None:
        raise TypeError("flexattn: create_mask needs kv_length")
    pattern = _with_offsets(_causal if mask_function is None else mask_function, q_offset, kv_offset, device)
    if attention_mask is not None:
        pattern = _with_padding(pattern, _local_padding(attention_mask, kv_length, kv_offset, device))
    return _as_torch_block_mask(create_block_mask(pattern, batch_size, None, q_length, kv_length, device=device))


def _as_torch_block_mask(mask: BlockMask) -> Any:
    """flexattn's block tables in torch's BlockMask type (shared, not copied):
    transformers tells a ready mask from a 2-D padding mask by that type (generate with
    a static cache builds the masks before the forward), and flex_attention takes it as
    its own (bench/DECISIONS.md#transformers-torch-block-mask)."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    return TorchBlockMask(mask.seq_lengths, mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                          mask.full_kv_indices, mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks,
                          mask.full_q_indices, BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _local_padding(attention_mask: Tensor, kv_length: int, kv_offset: int | Tensor, device: Any) -> Tensor:
    """The 2-D padding mask's entries for this call's keys, (B, kv_length) bools: keys
    ``kv_offset ..`` of the mask, False past its end (a static cache can be longer than
    it). Its shape follows the call's, not the mask's, which grows by one each
    generated token."""
    table = attention_mask.to(device=device if device is not None else attention_mask.device, dtype=torch.bool)
    positions = torch.arange(kv_length, device=table.device) + kv_offset
    inside = positions < table.shape[-1]
    return table[:, positions.clamp(max=table.shape[-1] - 1)] & inside


def _with_padding(pattern: Callable, padding: Tensor) -> Callable:
    def padded(b, h, q_idx, kv_idx):
        return pattern(b, h, q_idx, kv_idx) & _read(padding, b, kv_idx)

    return padded


def _with_offsets(pattern: Callable, q_offset: int | Tensor, kv_offset: int | Tensor, device: Any) -> Callable:
    """``pattern`` over absolute positions, read with the call's (local) indices. Offsets
    go in as tensors the mask reads, not as constants of its code: a cache's offsets
    change every step, and each new constant would compile the operator again
    (bench/DECISIONS.md#transformers-mask-shapes)."""
    if not isinstance(q_offset, Tensor) and not isinstance(kv_offset, Tensor) and q_offset == kv_offset == 0:
        return pattern
    q_offset, kv_offset = (torch.as_tensor(offset, device=device) for offset in (q_offset, kv_offset))

    def offset(b, h, q_idx, kv_idx):
        return pattern(b, h, q_idx + q_offset, kv_idx + kv_offset)

    return offset
