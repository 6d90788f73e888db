"""A paged KV cache: sequences of different lengths share one pool of fixed-size pages.

Storage is two *pool* tensors, ``k_cache`` and ``v_cache`` of shape
(1, Hkv, pool_length, D) (``PagedKVCache.allocate`` makes them). Page ``p`` holds the pool
positions [p * page_stride, p * page_stride + page_size), where page_stride is the page
size, or Hkv times it for the "pages" layout (see ``POOL_LAYOUTS``). Each batch *slot* (one sequence
being served) owns a list of pages: its *page table* maps the slot's logical page i
(tokens [i * page_size, (i + 1) * page_size) of the sequence) to a physical page.
``PagedKVCache`` keeps the page tables and the free list:

* ``reserve(slot, length)``: give the slot pages until it can hold ``length`` tokens;
* ``append(slots, positions, k, v, k_cache, v_cache)``: write new tokens at their logical
  positions, in place;
* ``free(slot)``: give the slot's pages back (they are handed out again later; their old
  contents stay until overwritten, and are never visible to another slot).

Attention then runs directly on the pool, without gathering a sequence's pages into a
contiguous tensor. Masks and score mods are written in *logical* positions (a token's
index in its own sequence) and translated:

* ``block_mask_on_pages(block_mask, slots)``: a BlockMask over logical positions (KV block
  size = page size) -> one over the pool, whose block lists name physical pages;
* ``mask_mod_on_pages`` / ``score_mod_on_pages``: mods in logical positions -> mods over
  pool positions (they see the logical kv_idx; a pool position the slot does not own is
  masked out).

The query's batch index ``b`` is the position in ``slots``; ``q_idx`` is the query's own
row index, as always in flex_attention (for decoding, the mods add the sequence's offset
themselves, e.g. from a captured tensor of lengths).

Every method takes and keeps tensors on the cache's device and reads the page tables as
tensors, so a decode step that calls them under ``torch.compile`` is compiled once and
reused while only tensor *values* change (slots, positions, page tables, lengths).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .block_mask import BlockMask
from .block_tables import compact_kept
from .mod_signature import required_positional_count

__all__ = ["PagedKVCache"]

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _lookup(table: Tensor, *indices: Tensor) -> Tensor:
    """``table[indices]`` for 0-d index tensors as one ``aten.index`` op (traceable by
    Dynamo, make_fx and vmap without turning an index into a Python int)."""
    return torch.ops.aten.index.Tensor(table, list(indices))


def _canonical_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _values_checked(validate: bool) -> bool:
    """Value checks read tensor contents (a device sync); under torch.compile the values
    are not known while tracing, so they are skipped there."""
    return bool(validate) and not torch.compiler.is_compiling()


#: Memory layouts of the pool tensors (PagedKVCache's ``layout``; the pool tensors always
#: have shape (1, Hkv, pool_length, D)):
#:
#: * ``"heads"``: head-major, ``(1, Hkv, pool_length, D)`` contiguous; a page of one head is
#:   ``page_size * D`` contiguous elements, and one sequence's pages of all its heads lie
#:   in ``Hkv * pages`` separate places of the pool.
#: * ``"tokens"``: token-major, a transposed view of a contiguous ``(1, pool_length, Hkv,
#:   D)`` tensor; a page holds its tokens' keys (values) for every head in one ``page_size
#:   * Hkv * D`` run, so a sequence touches ``pages`` places, Hkv times fewer (fewer
#:   address-translation entries when its pages lie scattered over a large pool); each
#:   key row is still D contiguous elements, read at a stride of Hkv rows (what each
#:   layout costs against a contiguous cache: bench/DECISIONS.md#paged-pool-layouts).
#: * ``"pages"``: page-major, heads within a page (FlashInfer's "HND" paged layout): memory
#:   ``(n_pages, Hkv, page_size, D)``, a page holding every head's keys (values) of its
#:   tokens, each head's ``page_size * D`` contiguous; a sequence touches ``pages`` places
#:   as with "tokens", and each head's rows are as contiguous as with "heads". The pool
#:   tensor is an overlapping strided view of that memory: head h's row at pool position n
#:   is at ``(h * page_size + n) * D``, so page p starts at pool position ``p * Hkv *
#:   page_size`` (``page_stride``), and the positions in between belong to other heads
#:   (the translated masks never show them). The cache needs ``num_kv_heads`` for it.
POOL_LAYOUTS = ("heads", "tokens", "pages")


class PagedKVCache:
    """Page tables and free list of a pool of ``n_pages`` pages of ``page_size`` tokens,
    shared by up to ``max_slots`` sequences.

    Args:
        n_pages: pages in the pool; the pool tensors hold ``n_pages * page_size`` tokens.
        page_size: tokens per page. It must equal the KV block size of the BlockMasks
            used with the cache (``BLOCK_SIZE=(q_block, page_size)``); the kernels need a
            multiple of 16, and 128 (the default block size) is a good choice on GPUs.
        max_slots: how many sequences can hold pages at once (slots 0..max_slots-1).
        device: where the page tables live; the pool tensors, slots, positions and
            BlockMasks passed in must be on the same device.
        layout: how ``allocate`` lays the pool tensors out in memory, one of
            ``POOL_LAYOUTS`` ("heads" by default). Attention and ``append`` work on any
            pool tensor of the right shape; the layout decides where a page's rows lie,
            and for "pages" also the pool positions (``page_stride``).
        num_kv_heads: the pool's KV heads; required by the "pages" layout (its page
            stride is num_kv_heads pages), checked by ``allocate`` when given.
        max_pages_per_slot: the most pages one slot may hold (default n_pages), so the
            longest sequence is ``max_length = max_pages_per_slot * page_size`` tokens.
            It is the width of the page tables and of the block lists that
            ``block_mask_on_pages`` builds, whose cost grows with it: a server that
            knows its longest sequence sets it, and the lists no longer grow with the
            pool.

    Tensors (on ``device``, updated in place, so captured references stay valid):

    * ``page_table`` (max_slots, max_pages_per_slot) int32: logical page -> physical
      page, -1: none;
    * ``owner_page`` (max_slots, n_pages) int32: physical page -> the slot's logical
      page, -1: not the slot's.
    """

    def __init__(self, n_pages: int, page_size: int, max_slots: int, device: torch.device | str = "cpu", *,
                 layout: str = "heads", num_kv_heads: int | None = None, max_pages_per_slot: int | None = None):
        for name, value in (("n_pages", n_pages), ("page_size", page_size), ("max_slots", max_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"flexattn: PagedKVCache {name} must be a positive int, got {value!r}")
        if layout not in POOL_LAYOUTS:
            raise ValueError(f"flexattn: PagedKVCache layout must be one of {POOL_LAYOUTS}, got {layout!r}")
        if num_kv_heads is None and layout == "pages":
            raise ValueError('flexattn: PagedKVCache layout="pages" needs num_kv_heads (the pool\'s KV heads), '
                             "got None")
        if num_kv_heads is not None and (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int)
                                         or num_kv_heads < 1):
            raise ValueError(f"flexattn: PagedKVCache num_kv_heads must be a positive int or None, "
                             f"got {num_kv_heads!r}")
        if max_pages_per_slot is None:
            max_pages_per_slot = n_pages
        if (isinstance(max_pages_per_slot, bool) or not isinstance(max_pages_per_slot, int)
                or not 1 <= max_pages_per_slot <= n_pages):
            raise ValueError(f"flexattn: PagedKVCache max_pages_per_slot must be an int in [1, n_pages={n_pages}] "
                             f"or None, got {max_pages_per_slot!r}")
        self.layout, self.num_kv_heads, self.max_pages_per_slot = layout, num_kv_heads, max_pages_per_slot
        try:
            self.device = _canonical_device(device)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"flexattn: PagedKVCache device must name a torch device, got {device!r}") from error
        self.n_pages, self.page_size, self.max_slots = n_pages, page_size, max_slots
        self.page_table = torch.full((max_slots, max_pages_per_slot), -1, dtype=torch.int32, device=self.device)
        self.owner_page = torch.full((max_slots, n_pages), -1, dtype=torch.int32, device=self.device)
        self._pages: list[list[int]] = [[] for _ in range(max_slots)]
        self._free: list[int] = list(range(n_pages - 1, -1, -1))  # pop() hands out page 0 first

    def __repr__(self) -> str:
        used = self.n_pages - len(self._free)
        busy = sum(1 for pages in self._pages if pages)
        return (f"PagedKVCache(n_pages={self.n_pages}, page_size={self.page_size}, "
                f"max_slots={self.max_slots}, max_pages_per_slot={self.max_pages_per_slot}, "
                f"device={self.device}, layout={self.layout!r}, "
                f"pages_in_use={used}, slots_in_use={busy})")

    # ----------------------------------------------------------------------------------
    # Bookkeeping (host side)
    # ----------------------------------------------------------------------------------
    @property
    def page_stride(self) -> int:
        """Pool positions from one page's first token to the next page's: the page size,
        or num_kv_heads pages for the "pages" layout."""
        return self.page_size * (self.num_kv_heads if self.layout == "pages" else 1)

    @property
    def pool_length(self) -> int:
        """Positions of the pool tensors (the KV length attention on the pool sees): up to
        the last page's last token."""
        return (self.n_pages - 1) * self.page_stride + self.page_size

    @property
    def max_length(self) -> int:
        """The longest sequence a slot can hold: max_pages_per_slot * page_size tokens."""
        return self.max_pages_per_slot * self.page_size

    def capacity(self, slot: int) -> int:
        """Tokens the slot can hold now (its pages times the page size)."""
        return len(self._pages[self._check_slot(slot)]) * self.page_size

    def pages(self, slot: int) -> list[int]:
        """The slot's physical pages, in logical order."""
        return list(self._pages[self._check_slot(slot)])

    def free_pages(self) -> int:
        """Pages not owned by any slot."""
        return len(self._free)

    def _check_slot(self, slot: int, argument: str = "slot") -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.max_slots:
            raise ValueError(f"flexattn: PagedKVCache {argument} must be an int in [0, {self.max_slots}), "
                             f"got {slot!r}")
        return slot

    def reserve(self, slot: int, length: int) -> None:
        """Give ``slot`` pages until it can hold at least ``length`` tokens (pages it
        already has are kept; a smaller length is a no-op).

        Raises ValueError when the slot would hold more than ``max_pages_per_slot``
        pages, RuntimeError when the pool has too few free pages (nothing is changed
        either way).
        """
        self._check_slot(slot)
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"flexattn: PagedKVCache.reserve length must be a non-negative int, got {length!r}")
        pages = self._pages[slot]
        needed = -(-length // self.page_size) - len(pages)
        if needed <= 0:
            return
        if len(pages) + needed > self.max_pages_per_slot:
            raise ValueError(
                f"flexattn: PagedKVCache.reserve length {length} needs {len(pages) + needed} pages of "
                f"{self.page_size} tokens for slot {slot}, more than max_pages_per_slot = "
                f"{self.max_pages_per_slot} (max_length {self.max_length} tokens)")
        if needed > len(self._free):
            raise RuntimeError(
                f"flexattn: PagedKVCache is out of pages: slot {slot} needs {needed} more page(s) of "
                f"{self.page_size} tokens for length {length}, {len(self._free)} free of {self.n_pages}")
        new = [self._free.pop() for _ in range(needed)]
        first = len(pages)
        pages.extend(new)
        logical = torch.arange(first, first + needed, dtype=torch.int32)
        physical = torch.tensor(new, dtype=torch.int64)
        self.page_table[slot, first:first + needed] = torch.tensor(new, dtype=torch.int32).to(self.device)
        self.owner_page[slot].index_copy_(0, physical.to(self.device), logical.to(self.device))

    def free(self, slot: int) -> None:
        """Return all pages of ``slot`` to the pool. Their contents stay until another
        slot overwrites them; no other slot can see them (its page tables do not name
        them, and attention masks pool positions a slot does not own)."""
        pages = self._pages[self._check_slot(slot)]
        self._free.extend(reversed(pages))
        self.page_table[slot] = -1
        self.owner_page[slot] = -1
        pages.clear()

    def shuffle_free_pages(self, generator: torch.Generator | None = None) -> None:
        """Hand out the free pages in a random order from now on (tests and benchmarks:
        a sequence's pages then lie scattered over the pool, as in a long-running server)."""
        order = torch.randperm(len(self._free), generator=generator).tolist()
        self._free = [self._free[i] for i in order]

    def allocate(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float16,
                 value_head_dim: int | None = None) -> tuple[Tensor, Tensor]:
        """Zero-filled pool tensors ``(k_cache, v_cache)`` of shape
        (1, num_kv_heads, pool_length, head_dim) (value_head_dim for v_cache) on the
        cache's device, laid out in memory as the cache's ``layout`` says (see
        ``POOL_LAYOUTS``): what ``append`` writes and ``flex_attention`` reads.
        """
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("value_head_dim", value_head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"flexattn: PagedKVCache.allocate {name} must be a positive int, got {value!r}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"flexattn: PagedKVCache.allocate dtype must be a floating torch.dtype, got {dtype!r}")
        if self.num_kv_heads is not None and num_kv_heads != self.num_kv_heads:
            raise ValueError(f"flexattn: PagedKVCache.allocate num_kv_heads must be the cache's num_kv_heads "
                             f"{self.num_kv_heads}, got {num_kv_heads}")

        def pool(dim: int) -> Tensor:
            shape = (1, num_kv_heads, self.pool_length, dim)
            if self.layout == "heads":
                return torch.zeros(shape, dtype=dtype, device=self.device)
            if self.layout == "tokens":
                return torch.zeros(1, self.pool_length, num_kv_heads, dim, dtype=dtype,
                                   device=self.device).transpose(1, 2)
            memory = torch.zeros(self.n_pages, num_kv_heads, self.page_size, dim, dtype=dtype, device=self.device)
            return memory.as_strided(shape, (memory.numel(), self.page_size * dim, dim, 1))

        return pool(head_dim), pool(value_head_dim)

    # ----------------------------------------------------------------------------------
    # Argument checks
    # ----------------------------------------------------------------------------------
    def _check_device(self, argument: str, t: Tensor) -> None:
        if t.device != self.device:
            raise ValueError(f"flexattn: PagedKVCache {argument} must be on the cache's device {self.device}, "
                             f"got {t.device}")

    def _as_slots(self, slots: Tensor | Sequence[int], validate: bool, argument: str = "slots") -> Tensor:
        """``slots`` as a 1-D integer tensor on the cache's device (a list of ints is
        converted); with validate, every slot in range and none twice."""
        if not isinstance(slots, Tensor):
            if not isinstance(slots, (list, tuple)) or not all(
                    isinstance(s, int) and not isinstance(s, bool) for s in slots):
                raise TypeError(f"flexattn: PagedKVCache {argument} must be a 1-D integer tensor or a list of "
                                f"ints, got {type(slots).__name__}")
            slots = torch.tensor(slots, dtype=torch.int64, device=self.device)
        if slots.dim() != 1 or slots.numel() == 0:
            raise ValueError(f"flexattn: PagedKVCache {argument} must be a non-empty 1-D tensor (B,), "
                             f"got shape {tuple(slots.shape)}")
        if slots.dtype not in _INT_DTYPES:
            raise TypeError(f"flexattn: PagedKVCache {argument} must have an integer dtype, got {slots.dtype}")
        self._check_device(argument, slots)
        if _values_checked(validate):
            bad = (slots < 0) | (slots >= self.max_slots)
            if bool(bad.any()):
                raise ValueError(f"flexattn: PagedKVCache {argument} must hold slots in [0, {self.max_slots}), "
                                 f"got {slots.tolist()}")
            if slots.unique().numel() != slots.numel():
                raise ValueError(f"flexattn: PagedKVCache {argument} must not name a slot twice, "
                                 f"got {slots.tolist()}")
        return slots

    def _check_positions(self, positions: Tensor, batch: int) -> None:
        if not isinstance(positions, Tensor):
            raise TypeError(f"flexattn: PagedKVCache positions must be a (B, L) integer tensor, "
                            f"got {type(positions).__name__}")
        if positions.dim() != 2 or positions.shape[0] != batch:
            raise ValueError(f"flexattn: PagedKVCache positions must have shape (B, L) with B = len(slots) = "
                             f"{batch}, got {tuple(positions.shape)}")
        if positions.dtype not in _INT_DTYPES:
            raise TypeError(f"flexattn: PagedKVCache positions must have an integer dtype, got {positions.dtype}")
        self._check_device("positions", positions)

    def _check_pool(self, k_cache: Tensor, v_cache: Tensor) -> None:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not isinstance(t, Tensor):
                raise TypeError(f"flexattn: PagedKVCache {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[0] != 1 or t.shape[2] != self.pool_length:
                raise ValueError(
                    f"flexattn: PagedKVCache {name} must have shape (1, Hkv, pool_length={self.pool_length}, D) "
                    f"(see PagedKVCache.allocate), got {tuple(t.shape)}")
            self._check_device(name, t)
            if self.num_kv_heads is not None and t.shape[1] != self.num_kv_heads:
                raise ValueError(f"flexattn: PagedKVCache {name} must have the cache's num_kv_heads = "
                                 f"{self.num_kv_heads} heads, got shape {tuple(t.shape)}")
        if k_cache.shape[1] != v_cache.shape[1]:
            raise ValueError(f"flexattn: PagedKVCache k_cache and v_cache must have the same number of heads, "
                             f"got k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")

    def _check_new_tokens(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, B: int, L: int) -> None:
        for name, t, pool in (("k", k, k_cache), ("v", v, v_cache)):
            if not isinstance(t, Tensor):
                raise TypeError(f"flexattn: PagedKVCache {name} must be a torch.Tensor, got {type(t).__name__}")
            expected = (B, pool.shape[1], L, pool.shape[3])
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"flexattn: PagedKVCache {name} must have shape (B, Hkv, L, D) = {expected} "
                    f"(B = len(slots), L = positions.shape[1], Hkv and D from {name}_cache), got {tuple(t.shape)}")
            if t.dtype != pool.dtype:
                raise TypeError(f"flexattn: PagedKVCache {name} must have {name}_cache's dtype {pool.dtype}, "
                                f"got {t.dtype}")
            self._check_device(name, t)

    # ----------------------------------------------------------------------------------
    # Writing tokens
    # ----------------------------------------------------------------------------------
    def pool_positions(self, slots: Tensor | Sequence[int], positions: Tensor, *, validate: bool = True) -> Tensor:
        """Pool positions (B, L) int64 of the logical ``positions`` (B, L) of the
        sequences in ``slots`` (B,).

        With ``validate`` (the default; skipped under torch.compile) a position that is
        negative or beyond its slot's reserved pages raises ValueError. Without it the
        caller guarantees it: such a position would map into pool page 0, whoever owns it.
        """
        slots = self._as_slots(slots, validate)
        self._check_positions(positions, slots.shape[0])
        return self._pool_positions(slots, positions, validate)

    def _pool_positions(self, slots: Tensor, positions: Tensor, validate: bool) -> Tensor:
        positions = positions.long()
        logical_page = torch.div(positions, self.page_size, rounding_mode="floor")
        in_table = (positions >= 0) & (logical_page < self.max_pages_per_slot)
        page = self.page_table[slots.long()[:, None], logical_page.clamp(0, self.max_pages_per_slot - 1)]
        if _values_checked(validate):
            bad = ~in_table | (page < 0)
            if bool(bad.any()):
                row, col = (int(i) for i in bad.nonzero()[0])
                slot = int(slots[row])
                raise ValueError(
                    f"flexattn: PagedKVCache positions[{row}, {col}] = {int(positions[row, col])} is outside "
                    f"slot {slot}'s reserved pages (capacity {self.capacity(slot)} tokens); call "
                    f"reserve({slot}, length) first")
        page = torch.where(in_table, page, 0).clamp(min=0).long()
        return page * self.page_stride + positions.remainder(self.page_size)

    def append(self, slots: Tensor | Sequence[int], positions: Tensor, k: Tensor, v: Tensor,
               k_cache: Tensor, v_cache: Tensor, *, validate: bool = True) -> None:
        """Write new keys and values into the pool, in place.

        Args:
            slots: (B,) the slots the new tokens belong to (each at most once).
            positions: (B, L) their logical positions in their sequences (each at most once
                per slot), within the slot's reserved pages.
            k, v: (B, Hkv, L, D) and (B, Hkv, L, Dv) in the pool's dtype.
            k_cache, v_cache: the pool tensors (1, Hkv, pool_length, D / Dv).
            validate: check slot and position values (a device sync; skipped under
                torch.compile, where shapes, dtypes and devices are still checked).
        """
        self._check_pool(k_cache, v_cache)
        slots = self._as_slots(slots, validate)
        self._check_positions(positions, slots.shape[0])
        B, L = positions.shape
        self._check_new_tokens(k, v, k_cache, v_cache, B, L)
        where = self._pool_positions(slots, positions, validate).reshape(-1)
        if _values_checked(validate) and where.unique().numel() != where.numel():
            raise ValueError(f"flexattn: PagedKVCache positions must not repeat a position within a slot, "
                             f"got {positions.tolist()}")
        # An index_put on the whole pool tensor: under torch.compile Inductor writes it in
        # place (no copy of the pool), and CUDA graphs accept it when the pool tensors are
        # marked static (torch._dynamo.mark_static_address).
        H = k.shape[1]
        k_cache[:, :, where] = k.transpose(0, 1).reshape(1, H, B * L, k.shape[-1])
        v_cache[:, :, where] = v.transpose(0, 1).reshape(1, H, B * L, v.shape[-1])

    # ----------------------------------------------------------------------------------
    # Attention on the pool
    # ----------------------------------------------------------------------------------
    def mask_mod_on_pages(self, mask_mod: Callable, slots: Tensor | Sequence[int], *,
                          validate: bool = True) -> Callable:
        """``mask_mod(b, h, q_idx, kv_idx)`` written in logical positions, as a mask over
        pool positions for the batch ``slots``: kv_idx is translated back to the slot's
        logical position; pool positions the slot does not own are masked out.

        The returned mod reads the cache's ``owner_page`` and ``slots`` as captured
        tensors, so later page changes are seen without rebuilding it.
        """
        if not callable(mask_mod) or required_positional_count(mask_mod) not in (4, None):
            raise TypeError(f"flexattn: PagedKVCache mask_mod must be a callable (b, h, q_idx, kv_idx), "
                            f"got {mask_mod!r}")
        return self._paged_mask_mod(mask_mod, self._as_slots(slots, validate), None)

    def _paged_mask_mod(self, mask_mod: Callable, slots: Tensor, kv_len: Tensor | None) -> Callable:
        """The mask over pool positions; with ``kv_len`` (B,) also logical kv_idx < kv_len[b].
        With a page stride above the page size, the positions between pages (other heads'
        rows) are masked out."""
        owner_page, page_size, page_stride = self.owner_page, self.page_size, self.page_stride

        def paged_mask_mod(b, h, q_idx, kv_idx):
            logical_page = _lookup(owner_page, _lookup(slots, b), kv_idx // page_stride)
            offset = kv_idx % page_stride
            logical = logical_page * page_size + offset
            visible = (logical_page >= 0) & mask_mod(b, h, q_idx, logical.clamp(min=0))
            if page_stride != page_size:
                visible = visible & (offset < page_size)
            if kv_len is not None:
                visible = visible & (logical < _lookup(kv_len, b))
            return visible

        paged_mask_mod.__name__ = f"paged_{getattr(mask_mod, '__name__', 'mask_mod')}"
        return paged_mask_mod

    def score_mod_on_pages(self, score_mod: Callable, slots: Tensor | Sequence[int], *,
                           validate: bool = True) -> Callable:
        """``score_mod(score, b, h, q_idx, kv_idx)`` written in logical positions, applied
        at pool positions for the batch ``slots`` (it sees the logical kv_idx)."""
        if not callable(score_mod) or required_positional_count(score_mod) not in (5, None):
            raise TypeError(f"flexattn: PagedKVCache score_mod must be a callable (score, b, h, q_idx, kv_idx), "
                            f"got {score_mod!r}")
        slots = self._as_slots(slots, validate)
        owner_page, page_size, page_stride = self.owner_page, self.page_size, self.page_stride

        def paged_score_mod(score, b, h, q_idx, kv_idx):
            logical_page = _lookup(owner_page, _lookup(slots, b), kv_idx // page_stride)
            logical = logical_page.clamp(min=0) * page_size + kv_idx % page_stride
            return score_mod(score, b, h, q_idx, logical)

        paged_score_mod.__name__ = f"paged_{getattr(score_mod, '__name__', 'score_mod')}"
        return paged_score_mod

    def block_mask_on_pages(self, block_mask: BlockMask, slots: Tensor | Sequence[int], *,
                            validate: bool = True, compute_q_blocks: bool = False) -> BlockMask:
        """A BlockMask over the pool for the sequences ``slots`` (B,), from one built over
        logical positions.

        ``block_mask`` has batch 1 or B, any heads, Q_LEN = the query length, KV_LEN up to
        ``max_length`` (typically the longest sequence), and KV block size equal to
        ``page_size``: ``create_block_mask(mask_mod, B, None, L, max_len,
        BLOCK_SIZE=(q_block, cache.page_size))``. Its rows must not list a block twice.

        The attention it gives on the pool is the attention the logical mask gives on a
        contiguous (B, Hkv, KV_LEN, D) cache holding each slot's tokens: each listed
        logical block becomes the physical page that holds it (partial and full blocks
        alike, in the same order); a block beyond the slot's reserved pages, or at or
        beyond KV_LEN, is dropped; a full block that KV_LEN cuts becomes partial; and the
        mask_mod (wrapped as by ``mask_mod_on_pages``) also masks logical positions at or
        beyond KV_LEN. Positions of a reserved page that were never written are as
        visible as the logical mask makes them: the mask must exclude positions at or
        beyond each sequence's length (a causal mask with the sequence's offset does).

        The result has KV_LEN = ``pool_length`` (its KV blocks are the pool's,
        ``n_pages``, or ``(n_pages - 1) * num_kv_heads + 1`` for the "pages" layout,
        whose page p is block ``p * num_kv_heads``), and index rows of
        ``max_pages_per_slot`` entries (a row lists at most its slot's pages; the
        entries after its count are padding), whatever the logical KV length, so that
        growing sequences keep its shapes (no recompile) and its cost follows the
        pages a slot may hold, not the pool. Its tensors are computed on the device
        with no sync; it can be built inside a compiled function.

        The transposed lists that a backward needs span every block of the pool, so
        they are left out unless ``compute_q_blocks=True`` (a call that needs a
        backward through a mask without them raises).
        """
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"flexattn: PagedKVCache block_mask must be a flexattn.BlockMask, "
                            f"got {type(block_mask).__name__}")
        q_block, kv_block = block_mask.BLOCK_SIZE
        if kv_block != self.page_size:
            raise ValueError(
                f"flexattn: the BlockMask's KV block size ({kv_block}) must equal the page size "
                f"({self.page_size}) to run on the pages; build it with BLOCK_SIZE=(q_block, {self.page_size})")
        slots = self._as_slots(slots, validate)
        B = slots.shape[0]
        if block_mask.kv_num_blocks.dim() != 3:
            raise ValueError(f"flexattn: PagedKVCache block_mask must have (batch, heads) dims, got shape "
                             f"{block_mask.shape}")
        if block_mask.kv_num_blocks.shape[0] not in (1, B):
            raise ValueError(f"flexattn: PagedKVCache block_mask must have batch 1 or len(slots) = {B}, "
                             f"got {block_mask.kv_num_blocks.shape[0]}")
        self._check_device("block_mask", block_mask.kv_num_blocks)
        q_len, kv_len = block_mask.seq_lengths
        if kv_len > self.max_length:
            raise ValueError(f"flexattn: PagedKVCache block_mask's KV length {kv_len} exceeds max_length = "
                             f"{self.max_length} tokens (max_pages_per_slot = {self.max_pages_per_slot} pages of "
                             f"page_size = {self.page_size}); no sequence can be that long")
        tables = self.page_table[slots.long()]                   # (B, max_pages_per_slot)
        page = self.page_size

        def listed(num: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
            """(logical block ids (B, H, QB, W) int64, listed flags) of one block list."""
            idx = idx.expand(B, *idx.shape[1:]).long()
            num = num.expand(B, *num.shape[1:])
            return idx, torch.arange(idx.shape[-1], device=idx.device) < num[..., None]

        partial_idx, partial_keep = listed(block_mask.kv_num_blocks, block_mask.kv_indices)
        partial_keep = partial_keep & (partial_idx * page < kv_len)
        if block_mask.full_kv_num_blocks is not None:
            full_idx, full_listed = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
            whole = (full_idx + 1) * page <= kv_len
            cut = full_listed & ~whole & (full_idx * page < kv_len)   # KV_LEN ends inside it
            full_num, full_order = self._page_lists(tables, full_idx, full_listed & whole)
            kv_num, kv_order = self._page_lists(tables, torch.cat([partial_idx, full_idx], dim=-1),
                                                torch.cat([partial_keep, cut], dim=-1))
        else:
            full_num = full_order = None
            kv_num, kv_order = self._page_lists(tables, partial_idx, partial_keep)
        limit = torch.full((B,), kv_len, dtype=torch.int64, device=self.device)
        return BlockMask.from_kv_blocks(
            kv_num, kv_order, full_num, full_order, BLOCK_SIZE=(q_block, kv_block),
            mask_mod=self._paged_mask_mod(block_mask.mask_mod, slots, limit),
            seq_lengths=(q_len, self.pool_length), compute_q_blocks=compute_q_blocks,
        )

    def _page_lists(self, tables: Tensor, idx: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """Block lists over the pool: ``idx`` (B, H, QB, M) logical block ids (distinct
        within a row), ``keep`` which of them to list. Returns (num (B, H, QB) int32,
        indices (B, H, QB, max_pages_per_slot) int32): each row lists the blocks of the
        kept ones' physical pages first, in their order, then padding (block 0). A
        logical block the slot does not own is not kept, so a row keeps at most
        max_pages_per_slot blocks. A logical row that lists a block twice is invalid;
        its count is still clamped to the row width, so the kernels never read past
        the row."""
        B, H, QB, M = idx.shape
        width = self.max_pages_per_slot
        physical = torch.gather(tables[:, None, None, :].expand(B, H, QB, width), 3,
                                idx.clamp(0, width - 1)).long()
        keep = keep & (idx < width) & (physical >= 0)
        block = (physical * (self.page_stride // self.page_size)).to(torch.int32)
        return compact_kept(keep, block, width)
