"""The Gluon backward for Hopper (``templates/gluon_backward.py.jinja``).

On the CPU: the kernel choice (``lowering/backward_plan.py``) with literal inputs, and the
rendered kernel compiled for sm90 offline. On an sm90 GPU: gradients of q, k and v against
the float64 golden and the same-dtype reference (the three-way bound of ``_harness``),
through the public API with kernel_options BWD_BACKEND="GLUON".
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import flexattn
from flexattn import mods
from flexattn._hop import build_score_mod_graphs
from flexattn.lowering.backward_plan import BackwardInputs, BackwardPlan, plan_backward
from flexattn.lowering.configs import gluon_backward as gluon_configs
from flexattn.lowering.subgraph import divides_by_non_power_of_two, reads_positions
from flexattn.templates import gluon_kernel_source

import _harness as harness
from _barrier_model import explore
from _gluon_offline import compile_offline_for_sm90, rendered_gluon_sources
from conftest import DEVICE
from test_backward import _no_buffers, run_case

ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)

HOPPER_CALL = BackwardInputs(
    device_type="cuda", capability=(9, 0), interpreter=False, gluon_available=True, dtype=torch.bfloat16,
    qk_head_dim=128, v_head_dim=128, sparse_q=128, sparse_kv=128, has_dropout=False, buffer_grads=False,
    deterministic=False, tma_obstacle=None, backend="GLUON", q_len=8192, kv_len=8192)


def test_the_backend_option_forces_either_kernel():
    assert plan_backward(dataclasses.replace(HOPPER_CALL, backend="TRITON")) == BackwardPlan(
        "triton", "kernel_options BWD_BACKEND='TRITON'")
    assert plan_backward(HOPPER_CALL) == BackwardPlan("gluon", "kernel_options BWD_BACKEND='GLUON'")
    # Forced, the Gluon kernel runs calls AUTO leaves to the Triton one.
    assert plan_backward(dataclasses.replace(HOPPER_CALL, q_len=128, mask_reads_memory=True)).kernel == "gluon"


@pytest.mark.parametrize("change, kernel, reason", [
    (dict(), "gluon", "long sequences"),
    (dict(q_len=4096, kv_len=4096), "gluon", "long sequences"),
    (dict(q_len=2048), "triton", "lengths 2048/8192 below 4096 at head dim 128"),
    (dict(kv_len=4095), "triton", "lengths 8192/4095 below 4096"),
    (dict(qk_head_dim=64, v_head_dim=64), "gluon", "long sequences"),
    (dict(qk_head_dim=64, v_head_dim=64, q_len=4096, kv_len=4096), "triton", "below 8192 at head dim 64"),
    (dict(q_len=None), "triton", "symbolic lengths"),
    (dict(q_len=4096, kv_len=4096, work=2 ** 36), "gluon", "long sequences"),
    (dict(q_len=4096, kv_len=4096, work=2 ** 36 - 1), "triton", "a small call (batch x heads x queries x keys "
                                                               "x head dim 68719476735 < 2**36)"),
    (dict(work=None), "gluon", "long sequences"),
    (dict(mask_reads_memory=True), "gluon", "long sequences"),
    (dict(mask_reads_memory=True, partial_heavy=False), "gluon", "long sequences"),
    (dict(mask_reads_memory=True, partial_heavy=True), "triton",
     "a mask_mod reading captured tensors on nearly all partial blocks"),
    (dict(mask_reads_memory=True, partial_heavy=True, qk_head_dim=64, v_head_dim=64), "gluon", "long sequences"),
    (dict(partial_heavy=True), "gluon", "long sequences"),
    (dict(dtype=torch.float32), "triton", "dtype torch.float32"),
    (dict(buffer_grads=True), "triton", "gradients of captured tensors"),
])
def test_auto_takes_the_gluon_backward_for_long_calls(change, kernel, reason):
    plan = plan_backward(dataclasses.replace(HOPPER_CALL, backend="AUTO", **change))
    assert plan.kernel == kernel
    assert reason in plan.reason


@pytest.mark.triton_kernels
def test_the_backward_lowering_reads_the_mask_and_its_listing(monkeypatch, flexattn_kernels):
    """The backward's plan sees whether the mask_mod reads captured tensors and the
    BlockMask's partial_heavy that flex_attention hands the operator (here the operator is
    called directly: flex_attention records it for CUDA calls only)."""
    from flexattn._hop import flex_attention_hop, identity_score_mod
    from flexattn.lowering import backward as backward_lowering

    seen = []
    plan = backward_lowering.plan_backward
    monkeypatch.setattr(backward_lowering, "plan_backward", lambda inputs: seen.append(inputs) or plan(inputs))
    B, H, n = 1, 2, 48
    q, k, v = (harness.randn(harness.generator(i), B, H, n, 16, dtype=torch.float16, requires_grad=True)
               for i in range(3))
    docs = (torch.arange(n, device=DEVICE) >= 20).to(torch.int32)
    bm = flexattn.create_block_mask(mods.document_mask(docs), None, None, n, n, device=DEVICE, BLOCK_SIZE=16)
    options = {**flexattn.options.internal_options(MASK_PARTIAL_HEAVY=True), "OUTPUT_LOGSUMEXP": True}
    torch._dynamo.reset()

    def attend(q, k, v):
        return flex_attention_hop(q, k, v, identity_score_mod, bm.as_tuple(), 0.25, options, (), ())[0]

    torch.compile(attend, backend="inductor", fullgraph=True)(q, k, v).sum().backward()
    assert seen, "the backward lowering planned no kernel"
    assert seen[0].mask_reads_memory and seen[0].partial_heavy is True


@pytest.mark.parametrize("change, reason", [
    (dict(device_type="cpu", capability=None), "device cpu is not a Hopper GPU"),
    (dict(capability=(8, 0)), "compute capability (8, 0) is not sm90"),
    (dict(interpreter=True), "(interpreter) is not a Hopper GPU"),
    (dict(gluon_available=False), "no Gluon Hopper API"),
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(qk_head_dim=256, v_head_dim=256), "head dims 256/256"),
    (dict(v_head_dim=64), "head dims 128/64"),
    (dict(sparse_q=32), "BlockMask block size (32, 128)"),
    (dict(sparse_kv=64), "BlockMask block size (128, 64)"),
    (dict(has_dropout=True), "dropout"),
    (dict(buffer_grads=True), "gradients of captured tensors"),
    (dict(deterministic=True), "deterministic mode"),
    (dict(tma_obstacle="the query's strides [1, 2] are not multiples of 16 bytes"), "strides"),
])
def test_calls_the_gluon_backward_does_not_cover(change, reason):
    call = dataclasses.replace(HOPPER_CALL, **change)
    with pytest.raises(ValueError, match=f"BWD_BACKEND='GLUON' cannot run this call: .*{reason[:20]}".replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        plan_backward(call)
    auto = plan_backward(dataclasses.replace(call, backend="AUTO"))
    assert auto.kernel == "triton" and reason[:20] in auto.reason


@pytest.mark.parametrize("head_dim,reads_positions,divides,late", [
    (128, True, False, True), (128, False, False, False), (128, False, True, True), (128, True, True, True),
    (64, True, False, False), (64, False, True, False), (64, False, False, False)])
def test_dp_is_issued_late_at_head_dim_128_under_positional_or_dividing_mods(head_dim, reads_positions, divides, late):
    assert gluon_configs.late_dp_default(head_dim, reads_positions, divides) is late


def _canvas_mask(width):
    def mask(b, h, q_idx, kv_idx):
        return ((q_idx // width - kv_idx // width).abs() <= 3) & ((q_idx % width - kv_idx % width).abs() <= 3)
    return mask


@pytest.mark.parametrize("mask_mod,divides", [
    (_canvas_mask(90), True), (_canvas_mask(64), False), (mods.causal_mask, False), (mods.sliding_window(100), False),
    (lambda b, h, q, kv: torch.div(q, 3, rounding_mode="trunc") == torch.div(kv, 3, rounding_mode="trunc"), True),
    (lambda b, h, q, kv: torch.fmod(q - kv, 6) == 0, True), (lambda b, h, q, kv: q // 1024 == kv // 1024, False),
    (lambda b, h, q, kv: (q / 3) > kv, False), (lambda b, h, q, kv: q // (kv + 1) == 0, True)],
    ids=["canvas90", "canvas64", "causal", "window", "trunc3", "fmod6", "chunk1024", "true_division", "by_index"])
def test_which_mask_mods_divide_by_a_non_power_of_two(mask_mod, divides):
    from torch.fx.experimental.proxy_tensor import make_fx
    graph = make_fx(mask_mod)(*(torch.zeros((), dtype=torch.int32) for _ in range(4)))
    assert divides_by_non_power_of_two(graph) is divides


@pytest.mark.parametrize("score_mod,reads", [
    (mods.alibi(4), True), (mods.tanh_softcap(30.0), False), (lambda s, b, h, q, kv: s * 2, False),
    (lambda s, b, h, q, kv: s + (kv < 3), True), (lambda s, b, h, q, kv: s + 0 * q, True)],
    ids=["alibi", "softcap", "doubled", "first_keys", "zero_times_q"])
def test_which_score_mods_read_the_positions(score_mod, reads):
    fw_graph, _ = build_score_mod_graphs(score_mod, torch.zeros(1, 4, 8, 16), [])
    assert reads_positions(fw_graph) is reads


def test_bwd_backend_is_a_known_option():
    flexattn.options.validate({"BWD_BACKEND": "GLUON"})
    with pytest.raises(ValueError):
        flexattn.options.validate({"BWD_BACKEND": "FLASH"})


def test_the_default_tile_orders_by_head_dim():
    """D=64: dQ's product after dV's and dK's, all three in flight at once; D=128: between them,
    two dS^T buffers (bench/DECISIONS.md#gluon-backward-early-dq, #gluon-backward-dq-before-dk)."""
    d64, d128 = gluon_configs.SM90[64], gluon_configs.SM90[128]
    assert (d64.block_m, d64.dq_before_dk, d64.ds_buffers) == (64, False, 1)
    assert (d128.block_m, d128.dq_before_dk, d128.ds_buffers) == (64, True, 2)


def test_unmodified_calls_at_d64_take_tall_tiles():
    """flex_attention's own mask with no score_mod at D=64: 128x128 tiles, dQ before dK, two
    dS^T buffers (bench/DECISIONS.md#gluon-backward-tall-tiles); any mod keeps 64x128, as
    does D=128; the BlockMask's block must hold the taller tile."""
    tall = gluon_configs.config_for(64, unmodified=True)
    assert (tall.block_m, tall.block_n, tall.dq_before_dk, tall.ds_buffers) == (128, 128, True, 2)
    assert gluon_configs.config_for(64, unmodified=False) == gluon_configs.SM90[64]
    assert gluon_configs.config_for(128, unmodified=True) == gluon_configs.SM90[128]
    d64 = dataclasses.replace(HOPPER_CALL, qk_head_dim=64, v_head_dim=64, backend="AUTO")
    assert plan_backward(dataclasses.replace(d64, unmodified=True)).kernel == "gluon"
    plan = plan_backward(dataclasses.replace(d64, unmodified=True, sparse_q=64))
    assert plan.kernel == "triton" and "BlockMask block size (64, 128)" in plan.reason
    assert plan_backward(dataclasses.replace(d64, sparse_q=64)).kernel == "gluon"


OFFLINE_CASES = {
    "causal_d128": dict(E=128, L=256, mask="causal"),
    "no_mask_odd_d128": dict(E=128, L=200, mask=None),
    # A query length the copy engine cannot step through (rows of 4-byte statistics, 202 apart):
    # the rows' log-sum-exp and delta through pointers.
    "causal_rows_by_pointers_d128": dict(E=128, L=202, mask="causal"),
    "alibi_causal_d64": dict(E=64, L=256, mask="causal", score="alibi"),
    "gqa_documents_d128": dict(E=128, L=256, mask="documents", Hq=4, Hkv=2),
    # Inductor's max/min helpers in the score_mod and its gradient (the Gluon helpers' versions).
    "clamped_relative_causal_d128": dict(E=128, L=256, mask="causal", score="clamped_relative"),
    # An unmodified call's query tiles as tall as the program's keys (a [128, 128] dS^T tile,
    # UNMODIFIED_SM90), in the dQ-before-dK order, at a length no tile divides.
    "tall_tiles_no_mask_odd_d64": dict(E=64, L=200, mask=None),
}


@pytest.mark.skipif(DEVICE != "cpu", reason="renders through the CPU's Triton path (a GPU runs the kernel instead)")
@pytest.mark.parametrize("case", sorted(OFFLINE_CASES))
def test_rendered_backward_compiles_for_sm90(case, monkeypatch, tmp_path):
    """The rendered kernel compiles for sm90 with the partitions' register budgets. Spills
    are reported, not yet held to zero (the first version spills at D=128)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    c = OFFLINE_CASES[case]
    B, L, E, Hq, Hkv = 2, c["L"], c["E"], c.get("Hq", 4), c.get("Hkv", 4)
    gen = harness.generator(0)
    q = harness.randn(gen, B, Hq, L, E, dtype=torch.float16, requires_grad=True)
    k, v = (harness.randn(gen, B, Hkv, L, E, dtype=torch.float16, requires_grad=True) for _ in range(2))
    block_mask = None
    if c["mask"] == "causal":
        block_mask = flexattn.create_block_mask(mods.causal_mask, B, None, L, L, device=DEVICE)
    elif c["mask"] == "documents":
        ids = torch.arange(L, device=DEVICE) // 97
        block_mask = flexattn.create_block_mask(lambda b, h, qi, ki: ids[qi] == ids[ki], B, None, L, L, device=DEVICE)
    score_mod = {"alibi": lambda: mods.alibi(Hq, device=DEVICE), None: lambda: None,
                 "clamped_relative": lambda: harness.clamped_relative_score_mod(DEVICE)}[c.get("score")]()

    def run():
        out = torch.compile(flexattn.flex_attention)(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                                     enable_gqa=Hq != Hkv)
        out.sum().backward()

    config = gluon_configs.config_for(E, unmodified=c["mask"] is None and c.get("score") is None)
    sources = [s for s in rendered_gluon_sources(monkeypatch, tmp_path, run, kernel="backward")
               if "def consume_keys(" in open(s).read()]
    assert sources, "no Gluon backward kernel was rendered"
    late_dp = c.get("score") is not None and E == 128
    assert all(f"LATE_DP : tl.constexpr = {late_dp}" in open(s).read() for s in sources)
    expected = {"BLOCK_M": config.block_m, "DQ_BEFORE_DK": config.dq_before_dk, "DS_BUFFERS": config.ds_buffers}
    assert all(f"{name} : tl.constexpr = {value}" in open(s).read() for s in sources for name, value in expected.items())
    rows_by_tma = E == 128 and L % 4 == 0
    assert all(f"ROWS_BY_TMA : tl.constexpr = {rows_by_tma}" in open(s).read() for s in sources)
    for report in compile_offline_for_sm90(sources):
        assert report["setmaxnreg"], "the partitions' register budgets were not applied"
        assert report["num_warps"] == 12  # two consumer warpgroups and the producer's
        assert report["ptxas_read"]


# --------------------------------------------------------------------------------------
# The barrier protocol: the producer's K/V and Q/dO ring against both consumers, and the
# consumers' shared dS^T tile
# --------------------------------------------------------------------------------------
#: The mbarrier operations of the producer (load_tiles) and a consumer (consume_keys) in
#: source order, as (operation, barrier, index expression), by the order of a tile's dQ
#: product: after dV's and dK's (the Q/dO stage released after the ds_ready wait) or, with
#: DQ_BEFORE_DK, between them (released after dK's product, behind the ds_free arrival); the
#: model below follows them.
PRODUCER_OPS = [("expect", "kv_ready", None), ("wait", "tile_free", "stage"), ("expect", "q_ready", "stage"),
                ("expect", "do_ready", "stage")]
_TILE_START = [("wait", "kv_ready", None), ("wait", "q_ready", "stage"), ("wait", "do_ready", "stage"),
               ("wait", "ds_free", "ds_slot"), ("arrive", "ds_ready", "ds_slot")]
_FREE_STAGE, _DS_WAIT, _DS_RELEASE = ("arrive", "tile_free", "stage"), ("wait", "ds_ready", "ds_slot"), \
    ("arrive", "ds_free", "ds_slot")
ORDERS = {"dq_after_dk": (_DS_WAIT, _FREE_STAGE, _DS_RELEASE), "dq_before_dk": (_DS_WAIT, _DS_RELEASE, _FREE_STAGE)}
ORDER_FLAGS = {"dq_after_dk": {"DQ_BEFORE_DK": False}, "dq_before_dk": {"DQ_BEFORE_DK": True}}
COUNTS = {"kv_ready": 1, "q_ready": 1, "do_ready": 1, "tile_free": 2, "ds_ready": 2, "ds_free": 2}


def _template_ops(function: str, flags: dict[str, bool] | None = None) -> list[tuple]:
    """The function's mbarrier operations with its ``if``/``else`` blocks on the ``flags``
    constexprs (conditions over those names alone) resolved."""
    flags = flags or ORDER_FLAGS["dq_after_dk"]
    body = gluon_kernel_source("gluon_backward").split(f"def {function}(", 1)[1].split("\n@gluon.jit", 1)[0]
    kept, skipping_above, resolved = [], None, {}
    for line in body.splitlines():
        indent, stripped = len(line) - len(line.lstrip()), line.strip()
        if skipping_above is not None:
            if not stripped or indent > skipping_above:
                continue
            skipping_above = None
        if not stripped:
            continue
        branch = re.fullmatch(r"if (.+):", stripped)
        names = set(re.findall(r"\b[A-Z][A-Z_]+\b", branch.group(1))) if branch else set()
        if names and names <= set(flags):
            resolved[indent] = bool(eval(branch.group(1), {}, dict(flags)))  # noqa: S307 - the template's own text
            skipping_above = None if resolved[indent] else indent
            continue
        if stripped == "else:" and indent in resolved:
            skipping_above = indent if resolved.pop(indent) else None
            continue
        resolved = {i: v for i, v in resolved.items() if i < indent}
        kept.append(line)
    return [(op, bar, index or None) for op, bar, index in
            re.findall(r"mbarrier\.(arrive|wait|expect)\((\w+)(?:\.index\(([^)]*)\))?", "\n".join(kept))]


def _programs(tiles_per_head: list[int], stages: int, order: str = "dq_after_dk", ds_buffers: int = 1) -> list[list[tuple]]:
    """The producer's and both consumers' operations for one program whose group's query
    heads list ``tiles_per_head`` query tiles; the ring's and the dS^T buffers' counts run on
    across heads."""
    total = sum(tiles_per_head)
    producer = [("tma", ("kv_ready", 0), None)]
    for j in range(total):
        stage, lap = j % stages, j // stages
        # A fresh barrier passes a wait on phase 1: the first lap finds every slot free.
        producer += [("wait", ("tile_free", stage), lap - 1), ("tma", ("q_ready", stage), None),
                     ("tma", ("do_ready", stage), None)]
    consumer = [("wait", ("kv_ready", 0), 0)]
    for j in range(total):
        stage, lap = j % stages, j // stages
        slot, ds_lap = j % ds_buffers, j // ds_buffers
        ops = {_FREE_STAGE: ("arrive", ("tile_free", stage), None), _DS_WAIT: ("wait", ("ds_ready", slot), ds_lap),
               _DS_RELEASE: ("arrive", ("ds_free", slot), None)}
        consumer += [("wait", ("q_ready", stage), lap), ("wait", ("do_ready", stage), lap),
                     # A dS^T buffer rewritten once both warpgroups' dQ products of its last tile read it.
                     ("wait", ("ds_free", slot), ds_lap - 1), ("arrive", ("ds_ready", slot), None),
                     *(ops[op] for op in ORDERS[order])]
    return [producer, consumer, list(consumer)]


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_the_model_has_the_templates_barrier_operations(order):
    assert _template_ops("load_tiles") == PRODUCER_OPS
    assert _template_ops("consume_keys", ORDER_FLAGS[order]) == _TILE_START + list(ORDERS[order])


@pytest.mark.parametrize("tiles_per_head", [[0], [1], [3], [2, 0, 3], [1, 1, 1, 1]], ids=str)
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("ds_buffers", [1, 2])
def test_no_interleaving_of_the_backward_partitions_hangs(tiles_per_head, stages, order, ds_buffers):
    assert explore(_programs(tiles_per_head, stages, order, ds_buffers), COUNTS) == []


def test_the_model_finds_a_ds_ready_wait_on_the_wrong_parity():
    """A warpgroup whose ds_ready waits mean the wrong phase can pass one before the other
    warpgroup wrote its rows of dS^T (and, a lap on, wait forever): the check finds one or the other."""
    programs = _programs([3], 2)
    programs[1] = [("wait", bar, meant + 1) if bar == ("ds_ready", 0) and kind == "wait" else (kind, bar, meant)
                   for kind, bar, meant in programs[1]]
    problems = explore(programs, COUNTS)
    assert problems and ("passed a wait" in problems[0] or "wait forever" in problems[0])


def test_the_model_finds_a_consumer_that_never_frees_ds():
    """A warpgroup skipping its first ds_free arrival stalls the other at its next tile."""
    programs = _programs([3], 2)
    programs[1].remove(("arrive", ("ds_free", 0), None))
    problems = explore(programs, COUNTS)
    assert problems and "wait forever" in problems[0]


def test_the_model_finds_a_consumer_that_frees_a_slot_once_too_few():
    """The check can fail: a consumer skipping its release of the first slot stalls the producer."""
    programs = _programs([3], 2)
    programs[1].remove(("arrive", ("tile_free", 0), None))
    problems = explore(programs, COUNTS)
    assert problems and "wait forever" in problems[0]


GPU_CASES = {
    "causal_d128": dict(E=128, L=1000, S=1000, mods=(None, mods.causal_mask)),
    "causal_d64": dict(E=64, L=640, S=640, mods=(None, mods.causal_mask)),
    "no_mask_odd_d128": dict(E=128, L=255, S=300, default_mask=True),
    # The unmodified calls' tall tiles (UNMODIFIED_SM90) at lengths no tile divides.
    "no_mask_odd_d64": dict(E=64, L=255, S=300, default_mask=True),
    "alibi_causal_d64": dict(E=64, L=512, S=512, alibi=True),
    "softcap_d128": dict(E=128, L=384, S=384, mods=(mods.tanh_softcap(30.0), None)),
    "clamped_relative_causal_d128": dict(E=128, L=500, S=500, clamped_relative=True),
    "sliding_window_d128": dict(E=128, L=1024, S=1024, mods=(None, mods.sliding_window(200))),
    "gqa_causal_d128": dict(E=128, Hq=8, Hkv=2, L=640, S=640, mods=(None, mods.causal_mask)),
    "empty_rows_d128": dict(E=128, L=384, S=384, mods=(None, lambda b, h, qi, ki: (qi >= 130) & (ki <= qi))),
    "cross_q_shorter_d128": dict(E=128, L=100, S=777, mods=(None, None)),
    # dP^T issued late under a soft-cap and without a score_mod (the defaults' opposites).
    "softcap_late_dp_d128": dict(E=128, L=384, S=384, mods=(mods.tanh_softcap(30.0), None),
                                 options={"BWD_LATE_DP": True}),
    "sliding_window_late_dp_odd_d128": dict(E=128, L=700, S=650, mods=(None, mods.sliding_window(200)),
                                            options={"BWD_LATE_DP": True}),
}


@pytest.mark.skipif(not ON_SM90, reason="the Gluon backward runs on sm90 GPUs")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gluon_backward_against_the_golden_reference(case, dtype):
    c = GPU_CASES[case]
    if c.get("alibi"):
        make_mods = _no_buffers(mods.alibi(c.get("Hq", 2), device=DEVICE), mods.causal_mask)
    elif c.get("clamped_relative"):
        make_mods = _no_buffers(harness.clamped_relative_score_mod(DEVICE), mods.causal_mask)
    else:
        make_mods = _no_buffers(*c.get("mods", (None, None)))
    run_case(dtype=dtype, Hq=c.get("Hq", 2), Hkv=c.get("Hkv"), L=c["L"], S=c["S"], E=c["E"], make_mods=make_mods,
             default_mask=c.get("default_mask", False), options={"BWD_BACKEND": "GLUON", **c.get("options", {})})
