"""A small Llama-style model served with flexattn's paged KV cache.

The model: token embedding, ``layers`` blocks of (RMSNorm -> grouped-query attention with
rotary position embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual), a final
RMSNorm and an output projection. Random weights from ``--seed``; nothing is downloaded.

What the script does:

1. Prefill: the prompts (random tokens, different lengths) are packed into one row and
   run at once, attention masked causally within each prompt (``causal_mask`` and
   ``document_mask_from_offsets``). Each prompt's keys and values go into its slot of a
   ``flexattn.PagedKVCache`` (one pool of pages per layer, laid out as ``--pool-layout``
   says: page-major, a page holding every KV head, by default).
2. Decode: ``--new-tokens`` tokens per prompt, greedily. One decode step (all layers,
   writing the new token's K/V into the pool and attending on the pool through a paged
   BlockMask) is one ``torch.compile``'d function with fixed shapes: a (B, 1) query,
   positions and slots as tensors, a BlockMask rebuilt each step with the same shapes.
   It must compile once: the script fails if the step recompiles. With ``--fused-step``
   each layer's rotary, append and attention are one ``flex_attention_with_kvcache``
   call instead. With
   ``--cuda-graphs`` it is compiled with ``mode="reduce-overhead"`` (CUDA graphs): the
   pools and page tables are marked static (written and read in place), and a CUDA-graph
   skip is an error too.
3. Check: the same model, with the generated tokens fed back, run sequence by sequence
   on plain contiguous caches with plain masked-softmax attention, in float64 (golden)
   and in the run's dtype (reference). The paged logits pass when
   ``err(paged, golden) <= 2 * err(reference, golden) + floor(dtype)`` (flexattn's test
   rule). The script prints the errors and the decode speed and exits 1 on a mismatch
   or a recompile.

    python examples/llama_paged.py                                  # CPU, a few seconds
    python examples/llama_paged.py --tiny --backend eager           # the test's size
    python examples/llama_paged.py --device cuda --cuda-graphs      # GPU, CUDA graphs
    python examples/llama_paged.py --fused-step                     # decode via flex_attention_with_kvcache
    python examples/llama_paged.py --device cuda --batch 16 --new-tokens 128 --dim 1024 \\
        --layers 8 --heads 16 --kv-heads 4 --page-size 128 --cuda-graphs
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import flexattn  # noqa: E402
from flexattn import PagedKVCache, mods  # noqa: E402
from flexattn.paged import POOL_LAYOUTS  # noqa: E402

#: err(paged) <= RATIO * err(reference) + FLOOR[dtype], errors against float64.
RATIO = 2.0
FLOOR = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float64: 1e-10}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Attention callback: (layer index, q (B, H, L, D), k, v (B, Hkv, L, D)) -> (B, H, L, D).
# q and k come rotated, unless the callback has ``applies_rotary = True`` (it rotates them).
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 512
    dim: int = 128
    layers: int = 2
    heads: int = 8
    kv_heads: int = 2
    ffn: int = 344
    max_positions: int = 1024
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        work = x.float() if x.dtype != torch.float64 else x
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding of x (B, H, L, D) with cos/sin (B, 1, L, D/2) (halves layout)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.index, self.cfg = index, cfg
        D = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.heads * D, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * D, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * D, bias=False)
        self.wo = nn.Linear(cfg.heads * D, cfg.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        B, L, _ = x.shape
        D = self.cfg.head_dim
        q = self.wq(x).view(B, L, self.cfg.heads, D).transpose(1, 2)
        k = self.wk(x).view(B, L, self.cfg.kv_heads, D).transpose(1, 2)
        v = self.wv(x).view(B, L, self.cfg.kv_heads, D).transpose(1, 2)
        if not getattr(attend, "applies_rotary", False):
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = attend(self.index, q, k, v)
        return self.wo(out.transpose(1, 2).reshape(B, L, self.cfg.heads * D))


class SwiGLU(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: Config, index: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attn = Attention(cfg, index)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin, attend):
        x = x + self.attn(self.attn_norm(x), cos, sin, attend)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        half = cfg.head_dim // 2
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(cfg.max_positions, dtype=torch.float64)[:, None] * inv_freq
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Attend) -> Tensor:
        """tokens, positions (B, L) -> logits (B, L, vocab)."""
        x = self.embed(tokens)
        cos = self.cos[positions][:, None].to(x.dtype)
        sin = self.sin[positions][:, None].to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, attend)
        return self.head(self.norm(x))


def build_model(cfg: Config, seed: int, dtype: torch.dtype, device: torch.device) -> Llama:
    """Random weights (std 1/sqrt(fan_in), so activations and logits are O(1))."""
    torch.manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.8, 1.2)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 if name.startswith("embed") else p.shape[1] ** -0.5)
    return model.to(device=device, dtype=dtype).eval()


# --------------------------------------------------------------------------------------
# Serving with the paged cache
# --------------------------------------------------------------------------------------
class PagedServer:
    """The model's K/V in a PagedKVCache (one pair of pool tensors per layer)."""

    def __init__(self, model: Llama, cache: PagedKVCache, dtype: torch.dtype, *, backend: str,
                 cuda_graphs: bool, q_block: int = 16, fused_step: bool = False):
        cfg = model.cfg
        self.model, self.cache, self.q_block, self.fused_step = model, cache, q_block, fused_step
        decode_step = self._fused_decode_step if fused_step else self._decode_step
        self.pools = [cache.allocate(cfg.kv_heads, cfg.head_dim, dtype) for _ in range(cfg.layers)]
        if cuda_graphs:
            # Written (pools) and read (page tables) in place by the graph: static
            # addresses, so CUDA graphs neither copy them nor refuse the in-place write.
            for k_pool, v_pool in self.pools:
                torch._dynamo.mark_static_address(k_pool)
                torch._dynamo.mark_static_address(v_pool)
            torch._dynamo.mark_static_address(cache.page_table)
            torch._dynamo.mark_static_address(cache.owner_page)
            self.step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True, dynamic=False)
        else:
            self.step = torch.compile(decode_step, backend=backend, fullgraph=True, dynamic=False)

    def prefill(self, prompts: list[Tensor], slots: list[int]) -> Tensor:
        """Run the prompts packed in one row (causal within each prompt), write their K/V
        into the slots' pages; returns each prompt's last logits (B, vocab)."""
        device = prompts[0].device
        lengths = [p.numel() for p in prompts]
        total = sum(lengths)
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device)
        tokens = torch.cat(prompts)[None]
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        mask = flexattn.and_masks(mods.causal_mask, mods.document_mask_from_offsets(offsets, total))
        block_mask = flexattn.create_block_mask(mask, 1, None, total, total, device=device)
        for slot, n in zip(slots, lengths):
            self.cache.reserve(slot, n)

        def attend(layer, q, k, v):
            k_pool, v_pool = self.pools[layer]
            for i, slot in enumerate(slots):
                start, stop = int(offsets[i]), int(offsets[i + 1])
                self.cache.append([slot], positions[:, start:stop], k[:, :, start:stop], v[:, :, start:stop],
                                  k_pool, v_pool)
            return flexattn.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)

        with torch.no_grad():
            logits = self.model(tokens, positions, attend)
        return logits[0, offsets[1:] - 1]

    def _decode_step(self, tokens: Tensor, positions: Tensor, slots: Tensor, block_mask) -> Tensor:
        """One token per sequence: tokens, positions (B, 1); slots (B,). Compiled."""
        def attend(layer, q, k, v):
            k_pool, v_pool = self.pools[layer]
            self.cache.append(slots, positions, k, v, k_pool, v_pool)
            return flexattn.flex_attention(q, k_pool, v_pool, block_mask=block_mask, enable_gqa=True)

        return self.model(tokens, positions, attend)[:, 0]

    def _fused_decode_step(self, tokens: Tensor, positions: Tensor, slots: Tensor, block_mask=None) -> Tensor:
        """The decode step through flex_attention_with_kvcache: rotary on q and the new k,
        the append and the attention in one call per layer (its mask from the lengths:
        with one query per sequence that is the causal mask). Compiled."""
        cos, sin = self.model.cos, self.model.sin

        def attend(layer, q, k, v):
            k_pool, v_pool = self.pools[layer]
            return flexattn.flex_attention_with_kvcache(
                q, k_pool, v_pool, k, v, cache_seqlens=positions[:, 0], rotary_cos=cos, rotary_sin=sin,
                page_cache=self.cache, slots=slots, enable_gqa=True)

        attend.applies_rotary = True
        return self.model(tokens, positions, attend)[:, 0]

    def decode_block_mask(self, slots: Tensor, positions: Tensor) -> flexattn.BlockMask:
        """The step's paged BlockMask: the query at logical position positions[b] sees
        keys 0..positions[b] of its sequence. Same shapes every step."""
        pos = positions[:, 0]

        def up_to_position(b, h, q_idx, kv_idx):
            return kv_idx <= pos[b]

        longest = int(pos.max()) + 1
        logical = flexattn.create_block_mask(up_to_position, pos.shape[0], None, 1, longest, device=pos.device,
                                             BLOCK_SIZE=(self.q_block, self.cache.page_size))
        return self.cache.block_mask_on_pages(logical, slots)


# --------------------------------------------------------------------------------------
# The reference: one sequence at a time, contiguous caches, plain attention
# --------------------------------------------------------------------------------------
def plain_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of the last L positions (q) over all S keys: products in the
    inputs' dtype, softmax in float32 (float64 for float64), GQA by repeating K/V."""
    H, L, S = q.shape[1], q.shape[2], k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = (q @ k.transpose(-2, -1)).to(work) * q.shape[-1] ** -0.5
    query_pos = torch.arange(S - L, S, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(S, device=q.device)[None, :] > query_pos, -math.inf)
    return scores.softmax(-1).to(q.dtype) @ v


def reference_logits(model: Llama, prompt: Tensor, generated: Tensor) -> Tensor:
    """Logits (N, vocab) after the prompt and after each of generated[:-1], computed
    incrementally on a contiguous cache (a list of growing K/V tensors per layer)."""
    caches: list[tuple[Tensor, Tensor] | None] = [None] * model.cfg.layers

    def attend(layer, q, k, v):
        if caches[layer] is not None:
            k = torch.cat([caches[layer][0], k], dim=2)
            v = torch.cat([caches[layer][1], v], dim=2)
        caches[layer] = (k, v)
        return plain_attention(q, k, v)

    device = prompt.device
    with torch.no_grad():
        out = [model(prompt[None], torch.arange(prompt.numel(), device=device)[None], attend)[0, -1]]
        for t, token in enumerate(generated[:-1].tolist()):
            pos = torch.tensor([[prompt.numel() + t]], device=device)
            out.append(model(torch.tensor([[token]], device=device), pos, attend)[0, 0])
    return torch.stack(out)


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--cuda-graphs", action="store_true",
                   help='compile the decode step with mode="reduce-overhead" (CUDA graphs; --device cuda)')
    p.add_argument("--backend", default="inductor", help="torch.compile backend of the decode step (no --cuda-graphs)")
    p.add_argument("--fused-step", action="store_true",
                   help="decode through flexattn.flex_attention_with_kvcache (rotary, append and attention in one call)")
    p.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--batch", type=int, default=4, help="number of prompts")
    p.add_argument("--prompt-lengths", default=None, help="comma list (overrides --batch), e.g. 7,30,19")
    p.add_argument("--max-prompt", type=int, default=48, help="random prompt lengths in [max/4, max]")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--page-size", type=int, default=None, help="default: 16 on CPU, 128 on CUDA")
    p.add_argument("--spare-pages", type=int, default=4, help="pages in the pool beyond what the batch needs")
    p.add_argument("--pool-layout", default="pages", choices=POOL_LAYOUTS,
                   help="PagedKVCache layout of the pools (flexattn.paged.POOL_LAYOUTS)")
    p.add_argument("--vocab", type=int, default=Config.vocab)
    p.add_argument("--dim", type=int, default=Config.dim)
    p.add_argument("--layers", type=int, default=Config.layers)
    p.add_argument("--heads", type=int, default=Config.heads)
    p.add_argument("--kv-heads", type=int, default=Config.kv_heads)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch (the CPU test's size)")
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.dim, args.layers, args.heads, args.kv_heads = 96, 64, 2, 4, 2
        args.prompt_lengths = args.prompt_lengths or "5,19,11"
        args.new_tokens = min(args.new_tokens, 6)
    if args.cuda_graphs and args.device != "cuda":
        p.error("--cuda-graphs needs --device cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    if args.dim % args.heads or (args.dim // args.heads) % 2 or args.heads % args.kv_heads:
        p.error("--dim must split into --heads heads of an even size, and --heads must be a multiple of --kv-heads")
    if args.new_tokens < 1:
        p.error("--new-tokens must be at least 1")
    return args


def run(argv=None) -> dict:
    """Prefill, decode and check; returns a summary dict ("ok" says whether it passed)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    page_size = args.page_size or (128 if device.type == "cuda" else 16)
    gen = torch.Generator().manual_seed(args.seed)
    if args.prompt_lengths:
        lengths = [int(n) for n in args.prompt_lengths.split(",")]
    else:
        lengths = torch.randint(max(1, args.max_prompt // 4), args.max_prompt + 1, (args.batch,), generator=gen).tolist()
    B, N = len(lengths), args.new_tokens
    cfg = Config(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 ffn=(8 * args.dim // 3 + 7) // 8 * 8, max_positions=max(lengths) + N)
    model = build_model(cfg, args.seed, dtype, device)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=gen).to(device) for n in lengths]

    n_pages = sum(-(-(n + N) // page_size) for n in lengths) + args.spare_pages
    # A slot holds at most the longest sequence's pages: the width of the page tables and
    # of each step's paged block lists.
    cache = PagedKVCache(n_pages=n_pages, page_size=page_size, max_slots=B + 2, device=device,
                         layout=args.pool_layout, num_kv_heads=cfg.kv_heads,
                         max_pages_per_slot=-(-cfg.max_positions // page_size))
    server = PagedServer(model, cache, dtype, backend=args.backend, cuda_graphs=args.cuda_graphs,
                         fused_step=args.fused_step)
    slot_list = list(range(B + 1, 1, -1))[:B]          # any free slots; not 0..B-1 in order
    slots = torch.tensor(slot_list, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    counters = torch._dynamo.utils.counters
    skips_at_start = counters["inductor"]["cudagraph_skips"]
    start = time.perf_counter()
    logits = [server.prefill(prompts, slot_list).float()]
    sync()
    prefill_s = time.perf_counter() - start
    tokens = [logits[0].argmax(-1)]
    positions = torch.tensor(lengths, device=device)[:, None]

    graphs_before = None
    step_times = []
    for t in range(N - 1):
        start = time.perf_counter()
        for slot, pos in zip(slot_list, positions[:, 0].tolist()):
            cache.reserve(slot, pos + 1)
        block_mask = None if args.fused_step else server.decode_block_mask(slots, positions)
        if args.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            step_logits = server.step(tokens[-1][:, None], positions, slots, block_mask)
        logits.append(step_logits.float().clone())     # CUDA-graph outputs are reused by the next replay
        tokens.append(logits[-1].argmax(-1))
        positions = positions + 1
        sync()
        step_times.append(time.perf_counter() - start)
        if t == 0:
            graphs_before = counters["stats"]["unique_graphs"]
    recompiles = counters["stats"]["unique_graphs"] - graphs_before if graphs_before is not None else 0
    cudagraph_skips = counters["inductor"]["cudagraph_skips"] - skips_at_start if args.cuda_graphs else 0
    generated = torch.stack(tokens, dim=1)             # (B, N)
    paged = torch.stack(logits, dim=1)                 # (B, N, vocab)

    # The check: the same model (dtype-rounded weights) in float64, and in dtype.
    golden_model = build_model(cfg, args.seed, dtype, device).double()
    golden = torch.stack([reference_logits(golden_model, prompts[b], generated[b]) for b in range(B)])
    reference = torch.stack([reference_logits(model, prompts[b], generated[b]) for b in range(B)]).double()
    err_paged = float((paged.double() - golden).abs().max())
    err_ref = float((reference - golden).abs().max())
    bound = RATIO * err_ref + FLOOR[dtype]
    agree = float((golden.argmax(-1) == generated).float().mean())
    for slot in slot_list:
        cache.free(slot)

    timed = step_times[1:]                              # the first step compiles
    tokens_per_s = B * len(timed) / sum(timed) if timed else float("nan")
    ok = err_paged <= bound and recompiles == 0 and cudagraph_skips == 0 and cache.free_pages() == n_pages
    summary = {
        "ok": ok, "device": str(device), "dtype": str(dtype).replace("torch.", ""), "cuda_graphs": args.cuda_graphs,
        "fused_step": args.fused_step, "batch": B, "prompt_lengths": lengths, "new_tokens": N, "page_size": page_size, "n_pages": n_pages,
        "max_abs_err": err_paged, "reference_err": err_ref, "bound": bound, "greedy_agreement": agree,
        "recompiles": recompiles, "cudagraph_skips": cudagraph_skips,
        "prefill_s": prefill_s, "first_step_s": step_times[0] if step_times else float("nan"),
        "decode_tokens_per_s": tokens_per_s, "generated": generated.tolist(),
    }
    print(f"llama_paged: {B} prompts of {lengths} tokens, {N} new tokens each, {cfg.layers} layers, dim {cfg.dim}, "
          f"{cfg.heads} heads on {cfg.kv_heads} KV heads, {dtype}, {device}"
          f"{' with CUDA graphs' if args.cuda_graphs else ''}"
          f"{', decoding through flex_attention_with_kvcache' if args.fused_step else ''}; pages of {page_size} tokens, "
          f"{n_pages} in the pool")
    print(f"logits: max |paged - float64| = {err_paged:.3e}; reference ({summary['dtype']}, contiguous) "
          f"{err_ref:.3e}; bound {bound:.3e}; greedy tokens agree with float64: {agree:.0%}")
    print(f"decode: {tokens_per_s:.1f} tokens/s over {len(timed)} steps after the first "
          f"(first step, with compilation: {summary['first_step_s']:.2f} s; prefill {prefill_s:.2f} s); "
          f"recompiles after the first step: {recompiles}"
          + (f"; CUDA-graph skips: {cudagraph_skips}" if args.cuda_graphs else ""))
    if not ok:
        reasons = [why for bad, why in (
            (err_paged > bound, f"logit error {err_paged:.3e} > bound {bound:.3e}"),
            (recompiles != 0, f"the decode step recompiled {recompiles} time(s)"),
            (cudagraph_skips != 0, "CUDA graphs were skipped (TORCH_LOGS=cudagraphs,perf_hints says why)"),
            (cache.free_pages() != n_pages, "pages leaked")) if bad]
        print("FAILED: " + "; ".join(reasons), file=sys.stderr)
    return summary


def main(argv=None) -> int:
    return 0 if run(argv)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
