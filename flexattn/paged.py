"""A paged KV cache: sequences of different lengths share one pool of fixed-size pages.

Storage: ``k_cache`` / ``v_cache`` of shape (1, Hkv, n_pages * page_size, D), the pool.
Page ``p`` holds the tokens [p * page_size, (p + 1) * page_size) of the pool. Each batch
slot (a sequence being served) owns a list of pages: its *page table* maps the slot's
logical page i (tokens [i * page_size, (i + 1) * page_size) of the sequence) to a
physical page. ``PagedKVCache`` keeps the page tables and the free list:

* ``reserve(slot, length)``: make the slot hold at least ``length`` tokens;
* ``append(slots, positions, k, v, k_cache, v_cache)``: write new tokens at their
  logical positions;
* ``free(slot)``: give the slot's pages back.

Attention then runs directly on the pool, without gathering a sequence's pages into a
contiguous tensor: ``block_mask_on_pages`` turns a BlockMask built in logical positions
(KV block size = page size) into one over the pool's positions, whose block lists name
physical pages, and ``mask_mod_on_pages`` / ``score_mod_on_pages`` wrap mods written in
logical positions so that they see the logical kv_idx (a pool position the slot does not
own is masked out). The query's batch index b is the position in ``slots``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from .block_mask import BlockMask

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Page tables and free list of a pool of ``n_pages`` pages of ``page_size`` tokens,
    for up to ``max_slots`` sequences.

    Tensors (on ``device``): ``page_table`` (max_slots, n_pages) int32, logical page ->
    physical page (-1: none); ``owner_page`` (max_slots, n_pages) int32, physical page ->
    the slot's logical page (-1: not the slot's).
    """

    def __init__(self, n_pages: int, page_size: int, max_slots: int, device: torch.device | str = "cpu"):
        for name, value in (("n_pages", n_pages), ("page_size", page_size), ("max_slots", max_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"flexattn: PagedKVCache {name} must be a positive int, got {value!r}")
        self.n_pages, self.page_size, self.max_slots = n_pages, page_size, max_slots
        self.device = torch.device(device)
        self.page_table = torch.full((max_slots, n_pages), -1, dtype=torch.int32, device=self.device)
        self.owner_page = torch.full((max_slots, n_pages), -1, dtype=torch.int32, device=self.device)
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]
        self._free: list[int] = list(range(n_pages - 1, -1, -1))  # pop() hands out page 0 first

    @property
    def pool_length(self) -> int:
        """Token positions in the pool: the KV length attention sees."""
        return self.n_pages * self.page_size

    def capacity(self, slot: int) -> int:
        """Tokens the slot can hold now."""
        return len(self._pages[self._check_slot(slot)]) * self.page_size

    def free_pages(self) -> int:
        return len(self._free)

    def _check_slot(self, slot: int) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"flexattn: slot must be an int in [0, {self.max_slots}), got {slot!r}")
        return slot

    def reserve(self, slot: int, length: int) -> None:
        """Give ``slot`` pages until it holds at least ``length`` tokens."""
        pages = self._pages[self._check_slot(slot)]
        needed = -(-length // self.page_size) - len(pages)
        if needed > len(self._free):
            raise RuntimeError(
                f"flexattn: PagedKVCache is out of pages: slot {slot} needs {needed} more for "
                f"{length} tokens, {len(self._free)} free of {self.n_pages}")
        for _ in range(max(0, needed)):
            physical = self._free.pop()
            self.page_table[slot, len(pages)] = physical
            self.owner_page[slot, physical] = len(pages)
            pages.append(physical)

    def free(self, slot: int) -> None:
        """Return all pages of ``slot`` to the pool."""
        pages = self._pages[self._check_slot(slot)]
        self._free.extend(reversed(pages))
        self.page_table[slot] = -1
        self.owner_page[slot] = -1
        pages.clear()

    def pool_positions(self, slots: Tensor, positions: Tensor) -> Tensor:
        """Pool positions of logical ``positions`` (B, L) of the sequences in ``slots`` (B,)."""
        table_device = self.page_table.device
        pages = self.page_table[slots.long().to(table_device)[:, None],
                                (positions // self.page_size).long().to(table_device)]
        if bool((pages < 0).any()):
            raise RuntimeError("flexattn: PagedKVCache positions beyond a slot's reserved pages; reserve first")
        return pages.long().to(positions.device) * self.page_size + positions.long() % self.page_size

    def append(self, slots: Tensor, positions: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
        """Write k, v (B, Hkv, L, D) at logical ``positions`` (B, L) of ``slots`` (B,) into
        the pool tensors ``k_cache``, ``v_cache`` (1, Hkv, pool_length, D), in place."""
        where = self.pool_positions(slots, positions)           # (B, L)
        B, H, L, D = k.shape
        flat = where.reshape(-1)
        k_cache[0, :, flat] = k.permute(1, 0, 2, 3).reshape(H, B * L, D)
        v_cache[0, :, flat] = v.permute(1, 0, 2, 3).reshape(H, B * L, v.shape[-1])

    # ----------------------------------------------------------------------------------
    # Attention on the pool
    # ----------------------------------------------------------------------------------
    def mask_mod_on_pages(self, mask_mod: Callable, slots: Tensor) -> Callable:
        """``mask_mod`` (logical positions) as a mask over pool positions for the batch
        ``slots``: kv_idx is translated back to the slot's logical position; pool
        positions the slot does not own are masked."""
        owner_page, page_size = self.owner_page, self.page_size

        def paged_mask_mod(b, h, q_idx, kv_idx):
            logical_page = owner_page[slots[b], kv_idx // page_size]
            logical = logical_page * page_size + kv_idx % page_size
            return (logical_page >= 0) & mask_mod(b, h, q_idx, logical.clamp(min=0))

        paged_mask_mod.__name__ = f"paged_{getattr(mask_mod, '__name__', 'mask_mod')}"
        return paged_mask_mod

    def score_mod_on_pages(self, score_mod: Callable, slots: Tensor) -> Callable:
        """``score_mod`` (logical positions) applied at pool positions for ``slots``."""
        owner_page, page_size = self.owner_page, self.page_size

        def paged_score_mod(score, b, h, q_idx, kv_idx):
            logical_page = owner_page[slots[b], kv_idx // page_size]
            logical = logical_page.clamp(min=0) * page_size + kv_idx % page_size
            return score_mod(score, b, h, q_idx, logical)

        paged_score_mod.__name__ = f"paged_{getattr(score_mod, '__name__', 'score_mod')}"
        return paged_score_mod

    def block_mask_on_pages(self, block_mask: BlockMask, slots: Tensor) -> BlockMask:
        """A BlockMask over the pool for the sequences ``slots`` (B,), from one over
        logical positions (batch 1 or B; its KV block size must be the page size).

        Block lists keep their order and counts; each logical block becomes the physical
        page holding it. The mask_mod is wrapped by ``mask_mod_on_pages``.
        """
        q_block, kv_block = block_mask.BLOCK_SIZE
        if kv_block != self.page_size:
            raise ValueError(
                f"flexattn: the BlockMask's KV block size ({kv_block}) must equal the page size "
                f"({self.page_size}) to run on the pages")
        slots = slots.to(self.device)
        B = slots.shape[0]
        tables = self.page_table[slots.long()]                   # (B, n_pages)

        def to_pages(num: Tensor | None, idx: Tensor | None):
            if num is None:
                return None, None
            num = num.expand(B, *num.shape[1:])
            idx = idx.expand(B, *idx.shape[1:])
            logical = idx.long().clamp(max=self.n_pages - 1)
            physical = torch.gather(tables[:, None, None, :].expand(*idx.shape[:3], self.n_pages), 3, logical)
            # Listed blocks must be owned; padding after the listed prefix becomes page 0.
            listed = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
            if bool(((physical < 0) & listed).any()):
                raise RuntimeError(
                    "flexattn: the BlockMask lists a KV block beyond a slot's reserved pages; reserve first")
            physical = torch.where(listed, physical, 0).to(torch.int32)
            width = self.n_pages
            if physical.shape[-1] < width:
                pad = torch.zeros(*physical.shape[:-1], width - physical.shape[-1], dtype=torch.int32,
                                  device=physical.device)
                physical = torch.cat([physical, pad], dim=-1)
            return num.contiguous(), physical[..., :width].contiguous()

        kv_num, kv_idx = to_pages(block_mask.kv_num_blocks, block_mask.kv_indices)
        full_num, full_idx = to_pages(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        return BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, kv_block),
            mask_mod=self.mask_mod_on_pages(block_mask.mask_mod, slots),
            seq_lengths=(block_mask.seq_lengths[0], self.pool_length),
        )
