"""Shared mask cases and comparison helpers for the BlockMask and mods tests.

Each mask case is a factory ``(B, H, Q_LEN, KV_LEN, device="cpu") -> mask_mod`` (some
masks capture tensors sized by the lengths, created on ``device``), named for readable
test ids.
"""

from __future__ import annotations

import torch

from flexattn.block_mask import BlockMask, and_masks, or_masks
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


def assert_same_block_mask(ours, theirs) -> None:
    """Compare two block masks block for block: counts, valid index prefixes, shapes.

    ``theirs`` may be torch's BlockMask. Padding after the valid prefix is compared too
    (flexattn fills it the way torch does), after checking the valid parts separately
    so that a failure says which part differs.
    """
    assert tuple(ours.seq_lengths) == tuple(theirs.seq_lengths)
    assert tuple(ours.BLOCK_SIZE) == tuple(theirs.BLOCK_SIZE)
    for prefix in ("", "full_"):
        for axis in ("kv", "q"):
            num_name, idx_name = f"{prefix}{axis}_num_blocks", f"{prefix}{axis}_indices"
            our_num, their_num = getattr(ours, num_name), getattr(theirs, num_name)
            our_idx, their_idx = getattr(ours, idx_name), getattr(theirs, idx_name)
            assert (our_num is None) == (their_num is None), num_name
            if our_num is None:
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

    Positions past the sequence ends count as masked (padding with False).
    """
    B, H, Q, KV = mask.shape
    rows, cols = -(-Q // q_block), -(-KV // kv_block)
    padded = torch.zeros(B, H, rows * q_block, cols * kv_block, dtype=torch.bool)
    padded[:, :, :Q, :KV] = mask
    tiles = padded.view(B, H, rows, q_block, cols, kv_block).permute(0, 1, 2, 4, 3, 5)
    counts = tiles.sum(dim=(-2, -1))
    kinds = torch.zeros(B, H, rows, cols, dtype=torch.int64)
    kinds[counts > 0] = 1
    kinds[counts == q_block * kv_block] = 2
    return kinds
