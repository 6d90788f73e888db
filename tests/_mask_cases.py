"""Shared mask cases and comparison helpers for the BlockMask and mods tests.

Each mask case is a factory ``(B, H, Q_LEN, KV_LEN, device="cpu") -> mask_mod`` (some
masks capture tensors sized by the lengths, created on ``device``), named for readable
test ids.
"""

from __future__ import annotations

import torch

from flexattn.block_mask import BlockMask, and_masks, or_masks
from flexattn.block_tables import flags_from_lists
from flexattn.mods import causal_mask, document_mask, prefix_lm, sliding_window

TENSOR_FIELDS = BlockMask._TENSOR_FIELDS


def _document_ids(length: int, num_docs: int, device="cpu") -> torch.Tensor:
    """Deterministic uneven document ids: boundaries at fixed fractions of the length."""
    bounds = torch.tensor([0.13, 0.4, 0.55, 0.9][: num_docs - 1]) * length
    return torch.bucketize(torch.arange(length), bounds.long(), right=True).to(device)


def _batched_document_ids(B: int, length: int, device="cpu") -> torch.Tensor:
    return torch.stack([_document_ids(length, 2 + b % 4) for b in range(B)]).to(device)


def _all_false(b, h, q_idx, kv_idx):
    return q_idx < 0


def _full(b, h, q_idx, kv_idx):
    return q_idx >= 0


def _some_rows_empty(b, h, q_idx, kv_idx):
    """Query rows 100..299 see nothing; other rows are causal."""
    return (q_idx >= kv_idx) & ((q_idx < 100) | (q_idx >= 300))


def _head_dependent(b, h, q_idx, kv_idx):
    """Each head has a different window, each batch a different offset."""
    return (q_idx - kv_idx + 7 * b).abs() < 40 * (h + 1)


MASK_CASES = {
    "causal": lambda B, H, Q, KV, device="cpu": causal_mask,
    "sliding_window_64": lambda B, H, Q, KV, device="cpu": sliding_window(64),
    "sliding_window_200_bidir": lambda B, H, Q, KV, device="cpu": sliding_window(200, causal=False),
    "prefix_lm_70": lambda B, H, Q, KV, device="cpu": prefix_lm(70),
    "prefix_lm_per_batch": lambda B, H, Q, KV, device="cpu": prefix_lm(
        torch.tensor([5, 300, 1000], device=device)[: B or 1]
    ),
    "document": lambda B, H, Q, KV, device="cpu": document_mask(_document_ids(max(Q, KV), 4, device)),
    "document_per_batch": lambda B, H, Q, KV, device="cpu": document_mask(
        _batched_document_ids(B or 1, max(Q, KV), device)
    ),
    "causal_and_document": lambda B, H, Q, KV, device="cpu": and_masks(
        causal_mask, document_mask(_document_ids(max(Q, KV), 3, device))
    ),
    "window_or_prefix": lambda B, H, Q, KV, device="cpu": or_masks(sliding_window(30), prefix_lm(20)),
    "all_false": lambda B, H, Q, KV, device="cpu": _all_false,
    "full": lambda B, H, Q, KV, device="cpu": _full,
    "some_rows_empty": lambda B, H, Q, KV, device="cpu": _some_rows_empty,
    "head_dependent": lambda B, H, Q, KV, device="cpu": _head_dependent,
}


def block_kinds_of(mask) -> torch.Tensor:
    """int64 (B, H, QB, KVB) kinds 0/1/2 = empty/partial/full of flexattn's or torch's
    BlockMask, from its block lists."""
    cols = mask.kv_indices.shape[-1]
    kinds = flags_from_lists(mask.kv_num_blocks.cpu(), mask.kv_indices.cpu(), cols).long()
    if mask.full_kv_num_blocks is not None:
        full = flags_from_lists(mask.full_kv_num_blocks.cpu(), mask.full_kv_indices.cpu(), cols)
        kinds = torch.where(full, 2, kinds)
    return kinds


def _tail_blocks(mask, rows: int, cols: int) -> torch.Tensor:
    """(rows, cols) bool: the blocks that hang over the end of a sequence."""
    q_len, kv_len = mask.seq_lengths
    q_block, kv_block = mask.BLOCK_SIZE
    tail = torch.zeros(rows, cols, dtype=torch.bool)
    if q_len % q_block and -(-q_len // q_block) <= rows:
        tail[-(-q_len // q_block) - 1, :] = True
    if kv_len % kv_block and -(-kv_len // kv_block) <= cols:
        tail[:, -(-kv_len // kv_block) - 1] = True
    return tail


def assert_same_block_mask(ours, theirs, hanging_full_in_theirs: bool = False) -> None:
    """Compare two block masks block for block: counts, valid index prefixes, shapes.

    ``theirs`` may be torch's BlockMask. Everything must match exactly: when the kinds
    match everywhere, the block lists and their padding are compared too (flexattn fills
    the padding the way torch does), valid parts first so that a failure says which part
    differs. ``hanging_full_in_theirs``: blocks that hang over the end of a sequence may
    be full in ``theirs`` where ``ours`` has them partial (a mask cropped by _adjust keeps
    its full blocks full; one built at the new lengths counts the positions past the end
    as masked, as torch does).
    """
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    our_kinds, their_kinds = block_kinds_of(ours), block_kinds_of(theirs)
    assert our_kinds.shape == their_kinds.shape, (our_kinds.shape, their_kinds.shape)
    differ = our_kinds != their_kinds
    if differ.any():
        assert hanging_full_in_theirs, f"block kinds differ at {differ.nonzero()[:8].tolist()}"
        tail = _tail_blocks(ours, *our_kinds.shape[-2:]).expand_as(differ)
        promoted = (their_kinds == 2) & (our_kinds == 1) & tail
        assert torch.equal(differ, promoted), (
            f"block kinds differ beyond full hanging blocks at {differ.nonzero()[:8].tolist()}")
        return
    for prefix in ("", "full_"):
        for axis in ("kv", "q"):
            num_name, idx_name = f"{prefix}{axis}_num_blocks", f"{prefix}{axis}_indices"
            our_num, their_num = getattr(ours, num_name), getattr(theirs, num_name)
            our_idx, their_idx = getattr(ours, idx_name), getattr(theirs, idx_name)
            if our_num is None or their_num is None:
                # One side lists no full blocks: the other must list none either.
                other = their_num if our_num is None else our_num
                assert other is None or int(other.sum()) == 0, num_name
                continue
            assert our_num.dtype == their_num.dtype == torch.int32, num_name
            assert our_idx.dtype == their_idx.dtype == torch.int32, idx_name
            assert our_num.shape == their_num.shape, (num_name, our_num.shape, their_num.shape)
            assert our_idx.shape == their_idx.shape, (idx_name, our_idx.shape, their_idx.shape)
            assert torch.equal(our_num.cpu(), their_num.cpu()), num_name
            slots = torch.arange(our_idx.shape[-1])
            valid = slots < our_num.cpu().unsqueeze(-1)
            assert torch.equal(
                torch.where(valid, our_idx.cpu(), -1), torch.where(valid, their_idx.cpu(), -1)
            ), f"valid prefix of {idx_name}"
            assert torch.equal(our_idx.cpu(), their_idx.cpu()), f"padding of {idx_name}"


def reference_block_kinds(mask: torch.Tensor, q_block: int, kv_block: int) -> torch.Tensor:
    """Block kinds from a dense (B, H, Q, KV) bool mask by brute force: 0/1/2 = empty/partial/full.

    Positions past the sequence ends count as masked (torch's rule): a block that hangs
    over an end is never full.
    """
    B, H, Q, KV = mask.shape
    rows, cols = -(-Q // q_block), -(-KV // kv_block)
    allowed = torch.zeros(B, H, rows * q_block, cols * kv_block, dtype=torch.bool)
    allowed[:, :, :Q, :KV] = mask

    counts = allowed.view(B, H, rows, q_block, cols, kv_block).permute(0, 1, 2, 4, 3, 5).sum(dim=(-2, -1))
    kinds = torch.zeros(B, H, rows, cols, dtype=torch.int64)
    kinds[counts > 0] = 1
    kinds[counts == q_block * kv_block] = 2
    return kinds
