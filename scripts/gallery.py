"""Draw every mask and score mod of ``flexattn.mods`` as PNG pictures, with the code that
makes each, into docs/gallery/ (``python3 scripts/gallery.py``; ``--check`` exits 1 when
a picture or the page would change).

Masks get two pictures: the token-level mask (``create_mask``: white = attended) and the
block-level BlockMask (``create_block_mask``: dark = full block, mask_mod skipped; grey =
partial block, mask_mod applied; white = skipped block). Score mods get a heat map of
the modified score of head 0 (blue negative, red positive) from a zero score, or for
soft-capping from the score ``(kv_idx - q_idx) / 8``. The PNG encoder is a few lines of
zlib, so the script needs nothing beyond torch.
"""

from __future__ import annotations

import argparse
import pathlib
import struct
import sys
import zlib

import torch

import flexattn
from flexattn import mods
from flexattn.numerics import IndexWithTensors, vmap_over_bhmn

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "gallery"
S, BLOCK, PIXELS = 64, 8, 4  # tokens per side, tokens per block, pixels per token

DOC_IDS = torch.tensor([0] * 20 + [1] * 12 + [2] * 24 + [3] * 8)
CU_SEQLENS = torch.tensor([0, 20, 32, 56, 64])
TABLE = torch.linspace(-2.0, 2.0, 2 * S - 1)
#: RoPE applied to a vector of ones at each position: [cos(p t), sin(p t)] at four rates t.
ROPE = torch.cat([torch.cos(torch.arange(S).view(S, 1) * 0.5 ** torch.arange(1, 5)),
                  torch.sin(torch.arange(S).view(S, 1) * 0.5 ** torch.arange(1, 5))], dim=1)

#: name -> (the code a user writes, the mod it makes).
MASKS = {
    "causal_mask": ("mods.causal_mask", mods.causal_mask),
    "sliding_window": ("mods.sliding_window(16)", mods.sliding_window(16)),
    "sliding_window_bidirectional": ("mods.sliding_window(16, causal=False)", mods.sliding_window(16, causal=False)),
    "prefix_lm": ("mods.prefix_lm(24)", mods.prefix_lm(24)),
    "document_mask": ("mods.document_mask(doc_ids)  # doc_ids: 20, 12, 24, 8 tokens", mods.document_mask(DOC_IDS)),
    "document_mask_from_offsets": ("mods.document_mask_from_offsets(torch.tensor([0, 20, 32, 56, 64]), 64)",
                                   mods.document_mask_from_offsets(CU_SEQLENS, S)),
}
#: name -> (the code a user writes, the mod it makes, the score it is drawn from).
SCORE_MODS = {
    "alibi": ("mods.alibi(8)  # head 0 of 8", mods.alibi(8), "zero"),
    "alibi_bias": ("mods.alibi_bias(torch.full((1,), 0.05))", mods.alibi_bias(torch.full((1,), 0.05)), "zero"),
    "tanh_softcap": ("mods.tanh_softcap(2.0)", mods.tanh_softcap(2.0), "ramp"),
    "relative_bias": ("mods.relative_bias(torch.linspace(-2, 2, 127))", mods.relative_bias(TABLE), "zero"),
    "decoupled_rope": ("mods.decoupled_rope(q_pe, k_pe, 1.0)  # q_pe, k_pe: RoPE of a vector of ones, 4 rates",
                       mods.decoupled_rope(ROPE.view(1, 1, S, 8), ROPE.view(1, S, 8), 1.0), "zero"),
}


def png(pixels: torch.Tensor) -> bytes:
    """(rows, cols, 3) uint8 -> PNG bytes (8-bit RGB, no interlace)."""
    rows, cols, _ = pixels.shape
    raw = b"".join(b"\x00" + bytes(pixels[r].flatten().tolist()) for r in range(rows))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", cols, rows, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def png_content(data: bytes) -> bytes:
    """What a PNG holds, independent of how zlib compressed it: its header and pixel rows
    (a file from another zlib version compares equal)."""
    pos, header, pixels = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            pixels += body
        pos += 12 + length
    return header + zlib.decompress(pixels)


def same_file(path: pathlib.Path, data: bytes) -> bool:
    if not path.exists():
        return False
    on_disk = path.read_bytes()
    return png_content(on_disk) == png_content(data) if path.suffix == ".png" else on_disk == data


def _scaled(rgb: torch.Tensor, factor: int) -> torch.Tensor:
    return rgb.repeat_interleave(factor, 0).repeat_interleave(factor, 1)


def token_picture(mask_mod) -> torch.Tensor:
    allowed = flexattn.create_mask(mask_mod, 1, 1, S, S, device="cpu")[0, 0]
    gray = torch.where(allowed, 255, 40).to(torch.uint8)
    return _scaled(gray[..., None].expand(S, S, 3), PIXELS)


def _listed(num_blocks: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """(rows, columns) bool: the blocks each row lists among its first num_blocks."""
    grid = torch.zeros(num_blocks.shape[-1], columns, dtype=torch.bool)
    for row in range(grid.shape[0]):
        grid[row, indices[row, :int(num_blocks[row])].long()] = True
    return grid


def block_picture(mask_mod) -> torch.Tensor:
    bm = flexattn.create_block_mask(mask_mod, 1, 1, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    columns = S // BLOCK
    partial = _listed(bm.kv_num_blocks[0, 0], bm.kv_indices[0, 0], columns)
    full = _listed(bm.full_kv_num_blocks[0, 0], bm.full_kv_indices[0, 0], columns)
    shade = torch.where(full, 60, torch.where(partial, 170, 255)).to(torch.uint8)
    return _scaled(shade[..., None].expand(*shade.shape, 3), PIXELS * BLOCK)


def heat_picture(score_mod, start: str) -> torch.Tensor:
    q_idx = torch.arange(S).view(S, 1).expand(S, S)
    kv_idx = torch.arange(S).view(1, S).expand(S, S)
    score = (kv_idx - q_idx).float() / 8 if start == "ramp" else torch.zeros(S, S)
    # The mod on every (q_idx, kv_idx) of head 0 of batch 0, as the kernels see it.
    with IndexWithTensors():
        t = vmap_over_bhmn(score_mod, True, 0)(score.view(1, 1, S, S), torch.zeros(1, dtype=torch.int64),
                                               torch.zeros(1, dtype=torch.int64), torch.arange(S), torch.arange(S))
    t = t.view(S, S)
    t = (t / (float(t.abs().max()) or 1.0)).clamp(-1, 1)
    red = (255 * torch.where(t > 0, torch.ones_like(t), 1 + t)).round()
    blue = (255 * torch.where(t < 0, torch.ones_like(t), 1 - t)).round()
    green = (255 * (1 - t.abs())).round()
    return _scaled(torch.stack([red, green, blue], -1).to(torch.uint8), PIXELS)


#: name -> (the code a user writes, the sink logit drawn).
SINKS = {"sinks": ("sinks = torch.zeros(H)  # one logit per head, here 0", 0.0)}


def sink_picture(sink: float) -> torch.Tensor:
    """The attention weights of a causal mask over equal scores (v the identity, so the
    output rows are the weights), then a gap and the sink's weight, 1 - the row's sum:
    a row that sees n keys gives each key and the sink 1/(n+1). Dark = weight 1."""
    q = torch.zeros(1, 1, S, 8)
    eye = torch.eye(S).view(1, 1, S, S)
    bm = flexattn.create_block_mask(mods.causal_mask, 1, 1, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    with flexattn.eager_mods():
        weights = flexattn.flex_attention(q, q, eye, block_mask=bm, sinks=torch.full((1,), sink))[0, 0]
    sink_weight = (1 - weights.sum(-1, keepdim=True)).clamp(0, 1).expand(S, 4)
    gap = torch.zeros(S, 2)
    shade = 255 * (1 - torch.cat([weights, gap, sink_weight], -1).sqrt())
    return _scaled(shade.round().to(torch.uint8)[..., None].expand(S, S + 6, 3), PIXELS)


#: name -> (the code a user writes, dropout_p drawn, the seed).
DROPOUT = {"dropout": ("out = flexattn.flex_attention(q, k, v, block_mask=causal, dropout_p=0.3)", 0.3, 0)}


def dropout_picture(p: float, seed: int) -> torch.Tensor:
    """The attention weights of a causal mask over equal scores as a call with dropout
    applies them (AuxRequest(probabilities=True)): kept weights, scaled by 1 / (1 - p),
    dark = 1 (square-root scale); dropped ones red. The seed fixes the keep mask."""
    q = torch.zeros(1, 1, S, 8)
    bm = flexattn.create_block_mask(mods.causal_mask, 1, 1, S, S, device="cpu", BLOCK_SIZE=BLOCK)
    torch.manual_seed(seed)
    with flexattn.eager_mods():
        _, aux = flexattn.flex_attention(q, q, q, block_mask=bm, dropout_p=p,
                                         return_aux=flexattn.AuxRequest(probabilities=True))
    probabilities = aux.probabilities[0, 0]
    # The sign bit is the keep mask's at every entry; only the attended ones are drawn.
    dropped = torch.signbit(probabilities) & flexattn.create_mask(mods.causal_mask, 1, 1, S, S, device="cpu")[0, 0]
    shade = (255 * (1 - probabilities.clamp(0, 1).sqrt())).round()
    red = torch.where(dropped, 230, shade)
    green_blue = torch.where(dropped, 60, shade)
    rgb = torch.stack([red, green_blue, green_blue], -1).to(torch.uint8)
    return _scaled(rgb, PIXELS)


def render() -> dict[str, bytes]:
    """Every file of docs/gallery/, by name."""
    files: dict[str, bytes] = {}
    lines = ["# Gallery of masks and score mods", "",
             f"Every mod of `flexattn.mods` on a {S}x{S} grid (queries down, keys across), drawn by",
             "`python3 scripts/gallery.py` from the library itself. Masks: the tokens attended (white)",
             f"and the BlockMask at {BLOCK}-token blocks (dark: full block, mask_mod skipped; grey: partial",
             "block, mask_mod applied; white: block skipped). Score mods: the modified score of head 0",
             "from a zero score (soft-capping: from `(kv_idx - q_idx) / 8`), red positive, blue",
             "negative, scaled to the largest.", ""]
    for name, (code, mask_mod) in MASKS.items():
        files[f"{name}-tokens.png"] = png(token_picture(mask_mod))
        files[f"{name}-blocks.png"] = png(block_picture(mask_mod))
        lines += [f"## `{name}`", "", "```python", f"mask_mod = {code}",
                  f"block_mask = flexattn.create_block_mask(mask_mod, B, H, {S}, {S}, BLOCK_SIZE={BLOCK})", "```", "",
                  f"![{name}, tokens]({name}-tokens.png) ![{name}, blocks]({name}-blocks.png)", ""]
    for name, (code, score_mod, start) in SCORE_MODS.items():
        files[f"{name}.png"] = png(heat_picture(score_mod, start))
        lines += [f"## `{name}`", "", "```python", f"score_mod = {code}",
                  "out = flexattn.flex_attention(q, k, v, score_mod=score_mod)", "```", "",
                  f"![{name}]({name}.png)", ""]
    for name, (code, sink) in SINKS.items():
        files[f"{name}.png"] = png(sink_picture(sink))
        lines += [f"## `{name}` (attention sinks)", "", "```python", code,
                  "out = flexattn.flex_attention(q, k, v, block_mask=causal, sinks=sinks)", "```", "",
                  "The weights of a causal mask over equal scores, dark = 1 (square-root scale); right of the",
                  "gap, the sink's share of each row.", "", f"![{name}]({name}.png)", ""]
    for name, (code, p, seed) in DROPOUT.items():
        files[f"{name}.png"] = png(dropout_picture(p, seed))
        lines += [f"## `{name}` (attention dropout)", "", "```python", f"torch.manual_seed({seed})", code, "```", "",
                  f"The weights of a causal mask over equal scores as applied with dropout_p={p}: kept ones",
                  f"scaled by 1 / (1 - {p}), dark = 1 (square-root scale); dropped ones red (the call's",
                  "`AuxRequest(probabilities=True)`).", "", f"![{name}]({name}.png)", ""]
    files["README.md"] = "\n".join(lines).encode()
    return files


def stale_files(out: pathlib.Path) -> list[str]:
    """The files of ``render()`` that ``out`` lacks or holds in another version."""
    return [name for name, data in render().items() if not same_file(out / name, data)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if any file would change")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args()
    if args.check:
        stale = stale_files(args.out)
        for name in stale:
            print(f"stale: {args.out / name}")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, data in render().items():
        (args.out / name).write_bytes(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
