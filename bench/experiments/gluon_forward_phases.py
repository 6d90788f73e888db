"""Where does a Gluon forward consumer warpgroup's time go, per KV tile (issue #48)?

    PYTHONPATH=. python bench/experiments/gluon_forward_phases.py [--cases no_mask_s8192_d128,...]
    PYTHONPATH=. python bench/experiments/gluon_forward_phases.py --offline OUT_DIR   # CPU: the text only

The template's consumer loop (KV tiles after the first), instrumented with %clock64 reads
around each step, in cycles of the SM clock, summed per query tile and warpgroup:

- inputs: the waits for this tile's K and last tile's V to land;
- turn: the wait for this warpgroup's turn (the others issuing);
- issue: issuing S = Q K^T and the last tile's P V, and handing the turn on;
- s_wait: the wait for S;
- softmax: the mods and the online softmax, up to the wait for P V;
- pv_wait: the wait for P V;
- rescale: acc *= alpha and P to 16 bits;

and per query tile, from its query load to its output store (`tile`), so that what the loop
does not cover (the query load, the first KV tile, the last P V, the write-out) shows as
`outside_loop` = tile - (KV tiles after the first) x the phases' sum.

The averages per KV tile come back through the row-max output (the first rows of each
warpgroup's slice of each query tile carry the phases instead), so the instrumented call
asks for max_scores and its row maxima are not row maxima. Clock reads are ordering points
for ptxas, so the instrumented schedule can differ from the plain one: the call is timed
beside the plain template (`ms`) to show how far. Cases as gluon_forward_sync.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
import gluon_forward_sync as sync  # noqa: E402

PHASES = ("inputs", "turn", "issue", "s_wait", "softmax", "pv_wait", "rescale")

#: The clock read (one per element of a [ROWS] vector: each thread reads its own clock).
_CLOCK_HELPER = '''

@gluon.jit
def clock_now(like):
    """The SM's %clock64, one read per element of ``like`` (an int32 vector)."""
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [like], dtype=gl.int64, is_pure=False, pack=1)
'''


def _insert(text: str, anchor: str, before: str = "", after: str = "") -> str:
    assert text.count(anchor) == 1, f"anchor not found once: {anchor!r}"
    indent = anchor[:len(anchor) - len(anchor.lstrip())]
    pre = "".join(f"{indent}{line}\n" for line in before.splitlines())
    post = "".join(f"\n{indent}{line}" for line in after.splitlines())
    return text.replace(anchor, pre + anchor + post)


def instrumented(text: str) -> str:
    """The template's text with the phase clocks (see the module docstring)."""
    loop = "                "
    out = _insert(text, "        offs_qm = off_m * BLOCK_M + WARPGROUP * ROWS",
                  before="ph_zero = gl.zeros([ROWS], gl.int32, layout=row_s)\nt_begin = clock_now(ph_zero)")
    out = _insert(out, "        if num_tiles > 0:\n",
                  before="".join(f"ph_{p} = gl.zeros([ROWS], gl.int64, layout=row_s)\n" for p in PHASES)
                         + "ph_n = gl.zeros([ROWS], gl.int64, layout=row_s)")
    out = _insert(out, "        if OUTPUT_LOGSUMEXP:\n", before="t_end = clock_now(ph_zero)")
    out = _insert(out, loop + "mbarrier.wait(k_ready.index(stage), phase)", before="t0 = clock_now(ph_zero)")
    out = _insert(out, loop + "mbarrier.wait(turn.index(WARPGROUP), (done + it) & 1)",
                  before="t1 = clock_now(ph_zero)", after="t2 = clock_now(ph_zero)")
    out = _insert(out, loop + "mbarrier.arrive(turn.index(NEXT_WARPGROUP))", after="t3 = clock_now(ph_zero)")
    out = _insert(out, loop + "qk = warpgroup_mma_wait(num_outstanding=1, deps=(qk, ))",
                  after="t4 = clock_now(ph_zero)")
    out = _insert(out, loop + "acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))",
                  before="t5 = clock_now(ph_zero)", after="t6 = clock_now(ph_zero)")
    steps = ", ".join(f"ph_{p}" for p in PHASES)
    out = _insert(out, loop + "p_op = gl.convert_layout(p.to(dtype), p_layout)",
                  after=f"t7 = clock_now(ph_zero)\n{steps} = ("
                        "ph_inputs + (t1 - t0), ph_turn + (t2 - t1), ph_issue + (t3 - t2), ph_s_wait + (t4 - t3), "
                        "ph_softmax + (t5 - t4), ph_pv_wait + (t6 - t5), ph_rescale + (t7 - t6))\nph_n = ph_n + 1")
    averages = "\n".join(
        f"row_max = gl.where(offs_r == {i}, gl.convert_layout(ph_{p}.to(gl.float32), row_o) / ph_tiles, row_max)"
        for i, p in enumerate(PHASES))
    out = _insert(out, "        if OUTPUT_MAX:\n",
                  before="offs_r = gl.arange(0, ROWS, layout=row_o)\n"
                         "ph_tiles = gl.maximum(gl.convert_layout(ph_n.to(gl.float32), row_o), 1.0)\n"
                         f"{averages}\n"
                         f"row_max = gl.where(offs_r == {len(PHASES)}, "
                         "gl.convert_layout(ph_n.to(gl.float32), row_o), row_max)\n"
                         f"row_max = gl.where(offs_r == {len(PHASES) + 1}, "
                         "gl.convert_layout((t_end - t_begin).to(gl.float32), row_o), row_max)")
    return out + _CLOCK_HELPER


def read_phases(row_max, block_m: int, consumers: int) -> dict:
    """{warpgroup: {phase: mean cycles per KV tile}} over the call's query tiles with KV tiles."""
    import torch

    B, H, L = row_max.shape
    tiles = L // block_m
    n = len(PHASES)
    rows = row_max[:, :, :tiles * block_m].reshape(B, H, tiles, consumers, block_m // consumers)[..., :n + 2]
    result = {}
    for wg in range(consumers):
        vals = rows[:, :, :, wg].reshape(-1, n + 2).float()
        counts = vals[:, n]
        weights = counts / counts.sum()
        result[wg] = {p: round(float((vals[:, i] * weights).sum()), 1) for i, p in enumerate(PHASES)}
        result[wg]["kv_tiles_per_query_tile"] = round(float(counts.mean()) + 1, 1)
        result[wg]["tile"] = round(float(vals[:, n + 1].mean()), 1)
        result[wg]["outside_loop"] = round(float((vals[:, n + 1] - counts * vals[:, :n].sum(1)).mean()), 1)
    assert torch.isfinite(rows).all()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="no_mask_s8192_d128,causal_s8192_d128,window1024_s8192_d128,"
                                           "document8_s8192_d128,no_mask_s8192_d64")
    parser.add_argument("--offline", metavar="OUT_DIR", help="write the instrumented template and stop")
    args = parser.parse_args()
    from flexattn.templates import gluon_kernel_source
    text = instrumented(gluon_kernel_source("gluon_forward"))
    if args.offline:
        with open(f"{args.offline}/gluon_forward_phases.py.jinja", "w") as f:
            f.write(text)
        return

    import torch
    from torch._inductor import config as inductor_config
    from triton.testing import do_bench

    import flexattn
    from flexattn.lowering.configs import gluon_forward as gluon_configs

    sys.path.insert(0, "bench")
    from _tuning import allow_recompiles
    allow_recompiles()
    inductor_config.force_disable_caches = True
    path = os.path.join(tempfile.mkdtemp(), "phases.py.jinja")
    with open(path, "w") as f:
        f.write(text)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__}), flush=True)
    for case in args.cases.split(","):
        B, H, S, D, mask, *score = sync.CASES[case]
        mod = sync.score_mod(score[0] if score else None, H)
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        block_mask = flexattn.create_block_mask(sync.mask_mod(mask, S), None, None, S, S) if mask else None
        unmodified = block_mask is None and mod is None
        cfg = gluon_configs.config_for(D, D, 2, unmodified)
        row = {"case": case, "block_m": cfg.block_m, "ms": {}}
        for name in ("base", f"file:{path}"):
            sync.install(name, gluon_kernel_source("gluon_forward"))
            fn = torch.compile(lambda q, k, v, n=name: flexattn.flex_attention(
                q, k, v, score_mod=mod, block_mask=block_mask, kernel_options={"BACKEND": "GLUON"},
                return_aux=flexattn.AuxRequest(max_scores=True)))
            torch._dynamo.reset()
            out, aux = fn(q, k, v)
            torch.cuda.synchronize()
            row["ms"]["plain" if name == "base" else "instrumented"] = round(do_bench(lambda: fn(q, k, v)), 4)
            if name != "base":
                row["cycles_per_kv_tile"] = read_phases(aux.max_scores, cfg.block_m, cfg.block_m // 64)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
