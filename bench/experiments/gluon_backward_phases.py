"""Where does a Gluon backward consumer warpgroup's time go, per query tile (issue #50)?

    PYTHONPATH=. python bench/experiments/gluon_backward_phases.py [--cases no_mask_s8192_d128,...]
    PYTHONPATH=. python bench/experiments/gluon_backward_phases.py --offline OUT_DIR   # CPU: the text only

The per-query-tile loop of each consumer warpgroup of ``templates/gluon_backward.py.jinja``,
instrumented with %clock reads around each step, in cycles of the SM clock per query tile
(summed over each program's tiles, divided by them, averaged over the warpgroup's warps):

- setup: the tile's start row, the LSE and delta loads issued, up to the wait for Q;
- inputs: the waits for this tile's Q and dO to land in the ring;
- issue_st_dpt: issuing S^T = K_w Q^T and dP^T = V_w dO^T;
- st_wait: the wait for S^T;
- pt: P^T (score_mod, mask_mod on partial tiles, exp2), up to the wait for dP^T;
- dpt_wait: the wait for dP^T;
- dst: dS^T (and the joint graph) to 16 bits;
- issue_dv_dk: P^T and dS^T to the operand layout, issuing dV += P^T dO and dK += dS^T Q;
- dst_smem: dS^T to shared memory and the fence;
- dv_dk_wait: the wait for dV and dK;
- release: handing the ring slot back (tile_free);
- dq_issue, dq_wait: issuing and waiting for the two dQ half products dS K_w;
- dq_store_wait: waiting for the bulk add that last read a dQ half's buffer;
- dq_add: the dQ half to shared memory, the fence, and its bulk add issued;

and per program and warpgroup: the wait for K and V (`kv_wait`), from the warpgroup's start
to after its dK store (`program`), from the end of the loop to then (`epilogue`: the last
bulk adds drained, dV and dK written), `outside_loop` = program - the phases' sum over the
program's tiles (kv_wait, head walks, epilogue), `tiles_per_program`, and `loop_per_tile`.

Variants (`--variants`, READ_SETS): `fine` reads every phase above; `coarse` and `loop` read
fewer clocks (each read phase then has the time since the read before it, unread phases
merged into it), because clock reads are ordering points for ptxas and the fine reads
around the wait for dP^T double the kernel's spills. Each variant is timed beside the plain
kernel (`ms`: forward+backward, and the backward alone through retain_graph): trust a split
only as far as its ms stays near plain's.

One int32 accumulator a thread: thread t of a warpgroup adds only the times of slot t % 32
(its lane), so the instrumentation costs two or three registers. The 128 accumulators of a
warpgroup come back through the dV output: the first rows of each warpgroup's slice of each
program's keys carry them instead of dV (the kernel's dV store skips those rows, everything
else still computes), so the instrumented call's v.grad is garbage there. Cases in the style
of gluon_backward_ab.py (forward+backward, kernel_options BWD_BACKEND="GLUON", bf16, B=4 H=16).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

PHASES = ("setup", "inputs", "issue_st_dpt", "st_wait", "pt", "dpt_wait", "dst", "issue_dv_dk", "dst_smem",
          "dv_dk_wait", "release", "dq_issue", "dq_wait", "dq_store_wait", "dq_add")
#: Per program and warpgroup, after the phases (slots 15-18).
EXTRAS = ("tiles", "kv_wait", "program", "epilogue")
#: Thread t of a warpgroup (lane t % 32 of warp t // 32) accumulates slot t % 32 only.
SLOTS = 32
assert len(PHASES) + len(EXTRAS) <= SLOTS

#: Instrumented variants by the phases they read the clock for (the last must be dq_add): every
#: read adds the cycles since the read before it, so a coarser set merges each unread phase into
#: the next read one. Offline (sm90, causal D=128 as tests/test_gluon_backward.py renders it)
#: the plain kernel spills 660 bytes, fine 1368, coarse 944, loop 596: the reads around the
#: wait for dP^T cost the most.
READ_SETS = {
    "fine": PHASES,
    "coarse": ("setup", "inputs", "st_wait", "dst", "dv_dk_wait", "dq_add"),
    "loop": ("dq_add", ),
}

# name: (B, H, S, D, mask: None, "causal" or "document8")
CASES = {
    "no_mask_s8192_d128": (4, 16, 8192, 128, None),
    "causal_s8192_d128": (4, 16, 8192, 128, "causal"),
    "no_mask_s8192_d64": (4, 16, 8192, 64, None),
    "causal_s8192_d64": (4, 16, 8192, 64, "causal"),
    "document8_s8192_d128": (4, 16, 8192, 128, "document8"),
}

#: The clock read (one per thread: a [128] vector with one element a thread of the warpgroup).
_CLOCK_HELPER = '''

@gluon.jit
def clock_now(like):
    """The SM's %clock (32 bits: differences of under 2**31 cycles come out right), one read
    per element of ``like`` (an int32 vector of one element a thread)."""
    return gl.inline_asm_elementwise("mov.u32 $0, %clock;", "=r,r", [like], dtype=gl.int32, is_pure=False, pack=1)
'''

_LOOP = " " * 12


def _add(slot: int, value: str) -> str:
    """``value`` added to the accumulator of the threads that keep ``slot``."""
    return f"ph_acc = ph_acc + gl.where(ph_slot == {slot}, {value}, 0)"


def _tick_read(phase: str, read: tuple = PHASES) -> str:
    """Read the clock and add the time since the last read to ``phase`` (nothing where
    ``phase`` is not in ``read``: the next phase read takes its time)."""
    if phase not in read:
        return ""
    return f"t_now = clock_now(ph_slot)\n{_add(PHASES.index(phase), 't_now - t_prev')}\nt_prev = t_now"


def _insert(text: str, anchor: str, before: str = "", after: str = "", indent: str | None = None) -> str:
    assert text.count(anchor) == 1, f"anchor not found once: {anchor!r}"
    if indent is None:
        indent = anchor[:len(anchor) - len(anchor.lstrip())]
    pre = "".join(f"{indent}{line}\n" for line in before.splitlines() if line)
    post = "".join(f"\n{indent}{line}" for line in after.splitlines() if line)
    return text.replace(anchor, pre + anchor + post)


def _replace(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"text not found once: {old!r}"
    return text.replace(old, new)


def instrumented(text: str, read: tuple = PHASES) -> str:
    """The template's text with the clocks of the phases in ``read`` (see the module
    docstring). One int32 accumulator a thread: thread t adds only the times of slot t % 32
    (its lane), so that the instrumentation costs two or three registers beside a kernel that
    is short of them; the threads of a warp run in step, so a lane's clock stands for its warp's."""
    assert read[-1] == PHASES[-1] and set(read) <= set(PHASES), read
    loop, dq = _LOOP, _LOOP + "    "

    def _tick(phase: str) -> str:
        return _tick_read(phase, read)

    tiles, kv_wait, program, epilogue = (len(PHASES) + i for i in range(len(EXTRAS)))
    # The consumer loop's statements (the template's text, without their indentation).
    issue_st = "st = warpgroup_mma(k_w, q_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)"
    issue_dpt = "dpt = warpgroup_mma(v_w, do_tile.permute((1, 0)), no_scores, use_acc=False, is_async=True)"
    issue_dv = "dv = warpgroup_mma(gl.convert_layout(pt.to(dtype), op_layout), do_tile, dv, is_async=True)"
    issue_dk = "dk = warpgroup_mma(gl.convert_layout(ds_low, op_layout), q_tile, dk, is_async=True)"
    add_dq = ("tma_atomic_add(dq_desc, [off_z.to(gl.int32), off_hq.to(gl.int32), start_m.to(gl.int32), h * HALF_D],\n"
              + dq + " " * len("tma_atomic_add(") + "buf.reshape([1, 1, BLOCK_M, HALF_D]))")
    out = _insert(text, "    k_w = k_smem.index(WARPGROUP)",
                  before="ph_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])\n"
                         "ph_slot = gl.arange(0, 128, layout=ph_layout) % 32\n"
                         f"ph_acc = 0 - gl.where(ph_slot == {program}, clock_now(ph_slot), 0)")
    out = _insert(out, "    mbarrier.wait(kv_ready, 0)\n", before="t_kv = clock_now(ph_slot)")
    out = _insert(out, "    done = 0\n", before=_add(kv_wait, "clock_now(ph_slot) - t_kv"))
    out = _insert(out, loop + "stage = (done + it) % NUM_STAGES", before="t_prev = clock_now(ph_slot)")
    out = _insert(out, loop + "mbarrier.wait(q_ready.index(stage), phase)", before=_tick("setup"),
                  after=_tick("inputs"))
    out = _insert(out, loop + issue_st, after=_tick("issue_st_dpt"))
    out = _insert(out, loop + "mbarrier.wait(do_ready.index(stage), phase)", after=_tick("inputs"))
    out = _insert(out, loop + issue_dpt, after=_tick("issue_st_dpt"))
    out = _insert(out, loop + "st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))", after=_tick("st_wait"))
    out = _insert(out, loop + "dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))", before=_tick("pt"),
                  after=_tick("dpt_wait"))
    out = _insert(out, loop + issue_dv, before=_tick("dst"))
    out = _insert(out, loop + issue_dk, after=_tick("issue_dv_dk"))
    out = _insert(out, loop + "ds_w.store(ds_low)\n" + loop + "fence_async_shared()", after=_tick("dst_smem"))
    out = _insert(out, loop + "dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))",
                  after=_tick("dv_dk_wait"))
    out = _insert(out, loop + "mbarrier.arrive(tile_free.index(stage))",
                  after=_tick("release") + "\n" + _add(tiles, "1"))
    out = _insert(out, dq + "dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))", before=_tick("dq_issue"),
                  after=_tick("dq_wait"))
    out = _insert(out, dq + "tma.store_wait(1)", after=_tick("dq_store_wait"))
    out = _insert(out, add_dq, after=_tick("dq_add"), indent=dq)
    out = _insert(out, "    tma.store_wait(0)\n",
                  before=f"ph_acc = ph_acc - gl.where(ph_slot == {epilogue}, clock_now(ph_slot), 0)")
    # The dV store skips the rows that carry the accumulators (128 int32 a warpgroup).
    out = _replace(out, "    gl.store(dv_ptrs, dv.to(dtype), mask=gl.expand_dims(offs_kv, 1) < KV_LEN)",
                   "    PH_ROWS: gl.constexpr = (4 * 128 + 2 * V_HEAD_DIM - 1) // (2 * V_HEAD_DIM)\n"
                   "    ph_first = off_n + WARPGROUP * HALF\n"
                   "    gl.store(dv_ptrs, dv.to(dtype), mask=(gl.expand_dims(offs_kv, 1) < KV_LEN)\n"
                   "             & (gl.expand_dims(offs_kv, 1) >= ph_first + PH_ROWS))")
    store = ('    {{store_output(("idx_z", "idx_h", "idx_n", "idx_d"), "dk", "dk_mask", indent_width=4,\n'
             '                  val_shape=("HALF", "QK_HEAD_DIM"))}}')
    out = _insert(out, store,
                  after=f"ph_ends = (ph_slot == {program}) | (ph_slot == {epilogue})\n"
                        "ph_acc = ph_acc + gl.where(ph_ends, clock_now(ph_slot), 0)\n"
                        "# Thread t's accumulator to int32 slot t of the first rows of this warpgroup's slice of dV.\n"
                        "ph_ptr = (dv_base + off_z * stride_dvz + off_hkv * stride_dvh + ph_first * stride_dvn"
                        ").to(gl.pointer_type(gl.int32))\n"
                        "ph_thread = gl.arange(0, 128, layout=ph_layout)\n"
                        "gl.store(ph_ptr + ph_thread, ph_acc, mask=(ph_thread >= 0) & (ph_first + PH_ROWS <= KV_LEN))")
    return out + _CLOCK_HELPER


def read_phases(grad_v, block_n: int, read: tuple = PHASES) -> dict:
    """{warpgroup: {phase: mean cycles per query tile, ...}} from the instrumented call's dV
    (contiguous [B, KV heads, KV_LEN, D]): each slot's value is the mean over the warpgroup's
    four warps, the phases summed over every program and divided by the tiles. Only the
    phases in ``read`` (each has the time since the read before it)."""
    import torch

    assert grad_v.is_contiguous() and grad_v.element_size() == 2
    B, H, S, D = grad_v.shape
    half = block_n // 2
    acc = grad_v.view(torch.int32).reshape(B, H, S // block_n, 2, half * D // 2)[..., :128]
    acc = acc.reshape(B, H, S // block_n, 2, 4, SLOTS).double()
    n = len(PHASES)
    assert bool((acc[..., n] >= 0).all()), "tile counts out of range: the dV rows do not carry the phases"
    result = {}
    for wg in range(2):
        per_warp = acc[:, :, :, wg].reshape(-1, 4, SLOTS)  # [program, warp, slot]
        vals = per_warp.mean(1)
        extra = {name: vals[:, n + i] for i, name in enumerate(EXTRAS)}
        tiles = extra["tiles"]
        total = tiles.sum().clamp(min=1)
        row = {p: round(float(vals[:, i].sum() / total), 1) for i, p in enumerate(PHASES) if p in read}
        row["loop_per_tile"] = round(float(vals[:, :n].sum() / total), 1)
        row["tiles_per_program"] = round(float(tiles.mean()), 2)
        for name in ("program", "kv_wait", "epilogue"):
            row[name] = round(float(extra[name].mean()), 1)
        row["outside_loop"] = round(float((extra["program"] - vals[:, :n].sum(1)).mean()), 1)
        # How far the warps of a warpgroup differ: the largest spread of a phase per tile.
        spread = (per_warp.amax(1) - per_warp.amin(1))[:, :n].sum(0) / total
        row["warp_spread_max"] = round(float(spread.max()), 1)
        result[wg] = row
    return result


def _timed(fn, q, k, v, grad) -> tuple[dict, tuple]:
    """ms of forward+backward and of the backward alone (retain_graph; absent where the
    compiled backward refuses it), and one backward's gradients."""
    from triton.testing import do_bench

    def step():
        q.grad = k.grad = v.grad = None
        fn(q, k, v).backward(grad)

    step()  # the compile
    times = {"fwd_bwd": round(do_bench(step), 4)}
    out = fn(q, k, v)
    try:
        grads = torch_grad(out, (q, k, v), grad)
        times["bwd"] = round(do_bench(lambda: torch_grad(out, (q, k, v), grad)), 4)
    except Exception as e:  # noqa: BLE001 - the backward alone is a bonus
        times["bwd_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        step()
        grads = (q.grad, k.grad, v.grad)
    return times, grads


def torch_grad(out, inputs, grad):
    import torch
    return torch.autograd.grad(out, inputs, grad, retain_graph=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--variants", default="fine,coarse",
                        help=f"instrumented variants, comma-separated, of {sorted(READ_SETS)}")
    parser.add_argument("--offline", metavar="OUT_DIR", help="write the instrumented templates and stop")
    args = parser.parse_args()
    from flexattn.templates import gluon_kernel_source
    base = gluon_kernel_source("gluon_backward")
    variants = {name: instrumented(base, READ_SETS[name]) for name in args.variants.split(",")}
    if args.offline:
        for name, text in variants.items():
            suffix = "" if name == "fine" else f"_{name}"
            with open(f"{args.offline}/gluon_backward_phases{suffix}.py.jinja", "w") as f:
                f.write(text)
        return

    import torch
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    import flexattn
    from flexattn.lowering.configs import gluon_backward as gluon_configs

    sys.path.insert(0, os.path.dirname(__file__))
    sys.path.insert(0, "bench")
    import gluon_forward_sync as sync  # noqa: E402
    from _tuning import allow_recompiles, install_gluon_template
    allow_recompiles()
    inductor_config.force_disable_caches = True
    # The backward alone is timed through retain_graph, which donated buffers forbid.
    functorch_config.donated_buffer = False
    folder = tempfile.mkdtemp()
    for name, text in variants.items():
        with open(os.path.join(folder, f"bwd_phases_{name}.py.jinja"), "w") as f:
            f.write(text)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "triton": __import__("triton").__version__, "instrumented": folder,
                      "reads": {name: READ_SETS[name] for name in variants}}), flush=True)
    for case in args.cases.split(","):
        B, H, S, D, mask = CASES[case]
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, grad = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        block_mask = flexattn.create_block_mask(sync.mask_mod(mask, S), None, None, S, S) if mask else None
        cfg = gluon_configs.SM90[D]
        row = {"case": case, "block_m": cfg.block_m, "block_n": cfg.block_n, "ms": {}, "cycles_per_query_tile": {}}
        for name, source in (("plain", base), *variants.items()):
            install_gluon_template("backward", name, source)
            torch._dynamo.reset()
            fn = torch.compile(lambda q, k, v: flexattn.flex_attention(
                q, k, v, block_mask=block_mask, kernel_options={"BWD_BACKEND": "GLUON"}))
            try:
                row["ms"][name], grads = _timed(fn, q, k, v, grad)
                torch.cuda.synchronize()
                if name != "plain":
                    row["cycles_per_query_tile"][name] = read_phases(grads[2].contiguous(), cfg.block_n,
                                                                     READ_SETS[name])
            except Exception as e:  # noqa: BLE001 - a variant that fails is a reading
                row.setdefault("error", {})[name] = f"{type(e).__name__}: {str(e)[:300]}"
            grads = None
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
