"""Context parallelism (flexattn.distributed): plans, local masks, and the attention of a
sharded sequence on gloo process groups of 2 and 4 ranks spawned here, each rank on the
CPU (the C++ engine), checked against the single-process result (harness three-way bound:
the float64 dense reference is the golden run, the same-dtype reference the ref run, and
each rank checks its shard of the output, the lse and q/k/v gradients; captured-tensor
gradients are summed over the ranks first)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flexattn
from flexattn import mods
from flexattn._hop import dense_flex_attention
from flexattn.distributed import (
    ContextParallelAttention,
    ShardInputs,
    context_parallel_attention,
    plan_context_parallel,
    plan_shards,
)
from flexattn.distributed.local import LocalMasks, block_positions

import _harness as H

BLOCK = 16
S = 256
B, HQ, D = 1, 2, 16
DOCS = torch.tensor([0] * 40 + [1] * 100 + [2] * 20 + [3] * 96)
WINDOW = 40
LAG = 24
#: The lagged mask's first queries see fewer keys: contiguous shards are 14% apart.
MAX_IMBALANCE = {"lagged": 0.2, "lead": 0.2}


def _lagged(b, h, q_idx, kv_idx):
    """A window of keys LAG to LAG + WINDOW behind (the first LAG queries: the keys up to
    their own): a rank's queries then skip its last own blocks (only later ranks read those)."""
    lag = q_idx - kv_idx
    return ((lag >= LAG) & (lag < LAG + WINDOW)) | ((q_idx < LAG) & (lag >= 0))


def _lead(b, h, q_idx, kv_idx):
    """The mirror of _lagged, keys ahead: a rank's queries skip its first own blocks, so
    the own blocks it lists are not a prefix of its shard."""
    lead = kv_idx - q_idx
    return ((lead >= LAG) & (lead < LAG + WINDOW)) | ((q_idx >= S - LAG) & (lead >= 0))


def _mask_mod(name: str):
    if name in ("causal", "alibi", "learnable_bias", "gqa"):
        return mods.causal_mask
    if name == "document":
        return mods.document_mask(DOCS)
    if name == "sliding":
        return mods.sliding_window(WINDOW)
    if name == "lagged":
        return _lagged
    if name == "lead":
        return _lead
    raise ValueError(name)


def _score_mod(name: str, table: torch.Tensor | None):
    if name == "alibi":
        return mods.alibi(HQ)
    if name == "learnable_bias":
        return mods.relative_bias(table)
    return None


def _block_mask(name: str, length: int = S, block: int = BLOCK):
    return flexattn.create_block_mask(_mask_mod(name), None, None, length, length, device="cpu", BLOCK_SIZE=block)


# --------------------------------------------------------------------------------------
# Plans and local masks (one process)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("name", ["causal", "document", "sliding"])
def test_plan_balances_blocks(name, world):
    length, block = 4096, 64
    if name == "document":
        docs = torch.repeat_interleave(torch.arange(7), torch.tensor([900, 300, 1200, 100, 700, 500, 396]))
        mask = flexattn.create_block_mask(mods.document_mask(docs), None, None, length, length, device="cpu",
                                          BLOCK_SIZE=block)
    else:
        mask = flexattn.create_block_mask(_mask_mod(name) if name != "sliding" else mods.sliding_window(256),
                                          None, None, length, length, device="cpu", BLOCK_SIZE=block)
    plan = plan_context_parallel(mask, world)
    assert plan.imbalance <= 0.10, (plan.loads, plan.chunks)
    assert sum(plan.loads) == int(mask.to_dense().sum())
    assert sorted(c for chunks in plan.chunks for c in chunks) == list(range(len(plan.chunks) * len(plan.chunks[0])))
    assert all(len(chunks) == len(plan.chunks[0]) for chunks in plan.chunks)


def test_causal_plan_is_zigzag():
    plan = plan_context_parallel(_block_mask("causal", 1024, 64), 4)
    assert plan.chunks == ((0, 7), (1, 6), (2, 5), (3, 4)) and plan.imbalance == 0.0


def test_sliding_plan_is_contiguous():
    mask = flexattn.create_block_mask(mods.sliding_window(128), None, None, 4096, 4096, device="cpu", BLOCK_SIZE=64)
    plan = plan_context_parallel(mask, 4)
    assert plan.chunks == ((0,), (1,), (2,), (3,))
    masks = LocalMasks(mask, plan, None, torch.device("cpu"))
    # Each rank reads its own keys and its left neighbour's only.
    assert masks.needed == [[r == s or s == r - 1 for s in range(4)] for r in range(4)]


def test_plan_shards_is_pure_and_checks_lengths():
    inputs = ShardInputs(torch.arange(1, 17), 1, 4)
    assert plan_shards(inputs, 16) == plan_shards(inputs, 16)
    with pytest.raises(ValueError, match="multiple of world_size=3"):
        plan_shards(ShardInputs(torch.ones(16, dtype=torch.int64), 1, 3), 16)
    with pytest.raises(ValueError, match="self-attention"):
        plan_context_parallel(flexattn.create_block_mask(mods.causal_mask, None, None, 64, 128, device="cpu"), 2)


def test_shard_unshard_round_trip():
    plan = plan_context_parallel(_block_mask("causal"), 4)
    x = torch.randn(2, 3, S, 5)
    parts = [plan.shard(x, r) for r in range(4)]
    assert all(p.shape == (2, 3, S // 4, 5) for p in parts)
    assert torch.equal(plan.unshard(parts), x)
    with pytest.raises(ValueError, match="rank must be an int"):
        plan.shard(x, 4)


@pytest.mark.parametrize("name", ["causal", "document", "sliding", "lagged", "lead"])
def test_local_masks_select_the_global_mask(name):
    mask = _block_mask(name)
    plan = plan_context_parallel(mask, 4, max_imbalance=MAX_IMBALANCE.get(name, 0.05))
    masks = LocalMasks(mask, plan, None, torch.device("cpu"))
    dense = flexattn.create_mask(mask.mask_mod, 1, 1, S, S, device="cpu")[0, 0]
    for rank in range(4):
        q_pos = plan.positions(rank)
        gathered = masks.gathered_call(rank)
        for kv_ranks, call in [((s,), masks.ring_call(rank, s)) for s in range(4)] + [(None, gathered)]:
            if kv_ranks is None:  # the gather: the blocks this rank's queries list
                kv_pos = block_positions(masks.gathered_blocks(rank), BLOCK)
                # Every allowed key of these queries lies in a gathered block.
                assert int(dense[q_pos].sum()) == int(dense[q_pos][:, kv_pos].sum())
                owners = [next(r for r, chunks in enumerate(plan.chunks) if int(p) // plan.chunk_len in chunks)
                          for p in kv_pos[::BLOCK]]
                assert owners == sorted(owners)
            else:
                kv_pos = plan.positions(kv_ranks[0])
            want = dense[q_pos][:, kv_pos]
            local = call.block_mask
            got = flexattn.create_mask(local.mask_mod, 1, 1, *local.seq_lengths, device="cpu")[0, 0]
            assert torch.equal(got, want)
            listed = local.to_dense()[0, 0].repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1).bool()
            assert not (want & ~listed).any(), "an allowed entry lies in a block the local mask skips"
            assert call.blocks == int(local.to_dense().sum())
            if kv_ranks is not None:
                assert masks.needed[rank][kv_ranks[0]] == bool(want.any())
    # Causal (zigzag) ranks list most blocks: one all-gather; a sliding window and the
    # documents list few: each rank receives only those.
    assert masks.gathers_all() is (name == "causal"), masks.received_fraction()
    for rank in range(4):
        receives, sends = masks.transfers(rank)
        received = sum(p.numel() for src, p in receives if src != rank)
        assert received == BLOCK * int((masks._owner[masks.needed_blocks[rank]] != rank).sum())
        # What each rank sends is what its destination receives from it.
        for dst, positions in sends:
            assert any(src == rank and torch.equal(p, positions) for src, p in masks.transfers(dst)[0])
        # The gradients that come back land at the union of what this rank sends.
        union, indices = masks.returned(rank)
        for (_, positions), index in zip(sends, indices):
            assert torch.equal(union[index], positions)
    own = [next(p for src, p in masks.transfers(r)[0] if src == r) for r in range(4)]
    # Every mask here but the lagged and lead ones lists all of a rank's own blocks for its
    # queries; those two list a prefix of them and a suffix.
    assert (min(p.numel() for p in own) < plan.local_len) is (name in ("lagged", "lead"))
    if name == "lead":
        assert all(int(p[0]) > 0 for p in own)


def test_errors_without_a_process_group():
    mask = _block_mask("causal")
    plan = plan_context_parallel(mask, 2)
    q = torch.randn(B, HQ, S // 2, D)
    with pytest.raises(RuntimeError, match="init_process_group"):
        context_parallel_attention(q, q, q, mask, plan)


# --------------------------------------------------------------------------------------
# Sharded attention on gloo groups
# --------------------------------------------------------------------------------------
def _inputs(name: str, dtype: torch.dtype):
    gen = H.generator(7)
    hkv = 1 if name == "gqa" else HQ
    q, k, v = H.make_inputs(gen, B=B, Hq=HQ, Hkv=hkv, L=S, S=S, E=D, dtype=dtype, device="cpu", requires_grad=True)
    grad_out, grad_lse = H.make_output_grads(gen, q, v, with_lse=True)
    table = H.randn(gen, HQ, 2 * S - 1, device="cpu", requires_grad=True) if name == "learnable_bias" else None
    return q, k, v, grad_out, grad_lse, table


def _whole_sequence(name, q, k, v, grad_out, grad_lse, table, dtype):
    """(out, lse, grads) of the dense reference over the whole sequence, computed in dtype."""
    q, k, v, grad_out, table = H.copies((q, k, v, grad_out, table), dtype)
    mask = _block_mask(name)
    score_mod = _score_mod(name, table) or (lambda score, b, h, m, n: score)
    captured = [table] if table is not None else []

    def attend(q, k, v):
        kv_heads = k.shape[1]
        k, v = (t.repeat_interleave(HQ // kv_heads, dim=1) for t in (k, v))
        out, lse, _ = dense_flex_attention(q, k, v, score_mod, mask.as_tuple(), D ** -0.5, {})
        return out, lse

    return H.attention_grads(attend, (q, k, v), grad_out, grad_lse.to(torch.float64 if dtype == torch.float64
                                                                       else torch.float32), captured)


def _check_rank(name: str, strategy: str, rank: int, world: int) -> None:
    dtype = torch.float32
    q, k, v, grad_out, grad_lse, table = _inputs(name, dtype)
    golden = _whole_sequence(name, q, k, v, grad_out, grad_lse, table, torch.float64)
    ref = _whole_sequence(name, q, k, v, grad_out, grad_lse, table, dtype)
    mask = _block_mask(name)
    attention = ContextParallelAttention(mask, _score_mod(name, table), strategy=strategy, scale=D ** -0.5,
                                         enable_gqa=name == "gqa", max_imbalance=MAX_IMBALANCE.get(name, 0.05))
    plan = attention.plan
    shards = [attention.shard(t.detach()).requires_grad_() for t in (q, k, v)]
    out, lse = attention(*shards, return_lse=True)
    captured = [table] if table is not None else []
    grads = torch.autograd.grad([out, lse], [*shards, *captured], [attention.shard(grad_out), attention.shard(grad_lse)])
    grads = list(grads)
    for i in range(3, len(grads)):
        dist.all_reduce(grads[i])  # each rank holds its queries' share
    mine = functools.partial(plan.shard, rank=rank)
    prefix = f"[{name} {strategy} rank {rank}/{world}] "
    for label, test, r, g in (("out", out, ref[0], golden[0]), ("lse", lse, ref[1], golden[1])):
        H.check_three_way(prefix + label, test, mine(r), mine(g), dtype)
    for i, label in enumerate(("grad_q", "grad_k", "grad_v")):
        H.check_three_way(prefix + label, grads[i], mine(ref[2][i]), mine(golden[2][i]), dtype)
    for i in range(3, len(grads)):
        H.check_three_way(prefix + "grad_captured", grads[i], ref[2][i], golden[2][i], torch.float32,
                          ratio=H.CAPTURED_GRAD_RATIO)


def _worker(rank: int, world: int, init_file: str, cases: list[tuple[str, str]]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, strategy in cases:
            _check_rank(name, strategy, rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


CASES = {
    2: [("causal", "ring"), ("document", "ring"), ("sliding", "auto"), ("sliding", "ring"), ("alibi", "allgather"),
        ("learnable_bias", "ring"), ("gqa", "auto"), ("document", "allgather")],
    4: [("causal", "ring"), ("document", "allgather"), ("learnable_bias", "ring"), ("sliding", "allgather"),
        ("lagged", "allgather"), ("lead", "allgather")],
}


@pytest.mark.parametrize("world", sorted(CASES))
def test_context_parallel_matches_one_process(world, tmp_path):
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    mp.spawn(_worker, args=(world, str(tmp_path / "store"), CASES[world]), nprocs=world, join=True)
