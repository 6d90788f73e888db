"""The lowering: the compiled graph holds our template kernel, with the right host-side
specialisations, config choice, kernel_options overrides, logging and device choice."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import flexattn
import flexattn.lowering
from flexattn import mods
from flexattn._hop import flex_attention_hop
from flexattn.block_mask import create_block_mask, noop_mask
from flexattn.lowering.configs import base as config_base
from flexattn.lowering.configs import forward as cfgs

from _generated_code import constexpr
import _harness as harness
from conftest import DEVICE

flexattn.lowering.register()

ON_CUDA = DEVICE == "cuda"
OPTIONS = dict(OUTPUT_LOGSUMEXP=True, OUTPUT_MAX=False, PRESCALE_QK=False,
               ROWS_GUARANTEED_SAFE=False, BLOCKS_ARE_CONTIGUOUS=False)
KERNEL_MARK = "def attend_kv_blocks("  # the template's inner loop, present only in our kernel


pytestmark = pytest.mark.usefixtures("inductor_runs_flexattn_kernels")


def compile_and_code(L=64, S=64, E=32, Ev=None, Hq=2, Hkv=2, score_mod=None, mask_mod=None,
                     options=None, block_size=128, dtype=torch.float16, block_mask_tuple=None, check=True):
    q, k, v = harness.make_inputs(0, B=2, Hq=Hq, Hkv=Hkv, L=L, S=S, E=E, Ev=Ev, dtype=dtype)
    score_mod = score_mod or (lambda s, b, h, qi, ki: s)
    if block_mask_tuple is None:
        block_mask_tuple = create_block_mask(mask_mod or noop_mask, None, None, L, S, device=DEVICE,
                                             BLOCK_SIZE=block_size).as_tuple()
    opts = {**OPTIONS, **(options or {})}

    def fn(q, k, v):
        return flex_attention_hop(q, k, v, score_mod, block_mask_tuple, E ** -0.5, opts, (), ())

    out, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), q, k, v)
    if not check:
        return "\n".join(code)
    golden, ref = harness.reference_runs(harness.dense_reference(score_mod, block_mask_tuple, E ** -0.5, opts),
                                         (q, k, v))
    harness.check_three_way("out", out[0], ref[0], golden[0], dtype)
    return "\n".join(code)


def test_graph_contains_the_template_kernel():
    code = compile_and_code(mask_mod=mods.causal_mask)
    assert KERNEL_MARK in code
    # No batched matmul (the dense decomposition) in the graph; the file names Inductor
    # writes are hashes and may spell "bmm", so only calls count.
    assert "bmm(" not in code and "flexattn_attention" not in code.split("def call", 1)[-1].split("\n")[0]


@pytest.mark.parametrize("use_lse", [False, True])
def test_an_unused_lse_adds_nothing_to_the_backward(use_lse):
    # Autograd hands the backward a zero lse gradient when the lse is unused: the delta
    # reduction then reads dO and O only, into a buffer of its own (no zero fill updated
    # in place).
    q, k, v = (t.requires_grad_() for t in harness.make_inputs(0, B=1, Hq=2, Hkv=2, L=64, S=64, E=32,
                                                                dtype=torch.float16))
    grad_out, grad_lse = harness.make_output_grads(harness.generator(1), q, v, with_lse=True)
    block_mask = create_block_mask(mods.causal_mask, None, None, 64, 64, device=DEVICE)

    def fn(q, k, v, grad_out, grad_lse):
        out, lse = flexattn.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
        torch.autograd.backward([out, lse] if use_lse else [out], [grad_out, grad_lse] if use_lse else [grad_out])
        return q.grad

    _, code = run_and_get_code(torch.compile(fn, backend="inductor"), q, k, v, grad_out, grad_lse)
    backward = next(c for c in code if "flexattn_attention_backward" in c)
    delta = backward.split("def triton_per_", 1)[1].split("\'\'\'", 1)[0]
    signature = delta.split(")", 1)[0]
    assert signature.count("in_ptr") == (3 if use_lse else 2), delta
    assert use_lse or "in_out_ptr" not in signature, delta


def test_unread_arguments_are_constants_of_the_graph(tmp_path, monkeypatch):
    # The kernel arguments a call leaves unread (no sinks, no dropout seed, no reduced
    # buffer gradients) are constants loaded with the compiled graph: its calls allocate
    # nothing for them, and a graph served from Inductor's cache brings them along.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    block_mask = create_block_mask(mods.causal_mask, None, None, 64, 64, device=DEVICE)
    inputs = harness.make_inputs(0, B=1, Hq=2, Hkv=2, L=64, S=64, E=32, dtype=torch.float16)
    grad_out = harness.make_output_grads(harness.generator(1), *inputs[::2], with_lse=False)[0]

    def run():
        q, k, v = (t.clone().requires_grad_() for t in inputs)
        compiled = torch.compile(lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=block_mask))

        def step():
            out = compiled(q, k, v)
            out.backward(grad_out)
            return out.detach()

        out, code = run_and_get_code(step)
        return out, [q.grad, k.grad, v.grad], code

    torch._dynamo.utils.counters.clear()
    with torch._inductor.config.patch(force_disable_caches=False, fx_graph_cache=True):
        out, grads, code = run()
        torch._dynamo.reset()
        cached_out, cached_grads, _ = run()
    assert torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] >= 2
    calls = [c.split("def call(", 1)[1] for c in code if "def call(" in c]
    assert len(calls) >= 2 and all("flexattn_unused" in c for c in calls), calls
    assert not any("((0, ), (1, ), torch.int32)" in c for c in calls), calls
    for got, expected in zip([cached_out, *cached_grads], [out, *grads]):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_specialisations_from_the_host():
    code = compile_and_code(L=100, S=128, E=80, Ev=48, Hq=4, Hkv=2, mask_mod=mods.causal_mask,
                            options={"BLOCK_M": 32, "BLOCK_N": 32})
    assert constexpr(code, "IS_DIVISIBLE_M") == "False"      # 100 % 32
    assert constexpr(code, "IS_DIVISIBLE_N") == "True"       # 128 % 128
    assert constexpr(code, "GQA_GROUP_SIZE") == "2"
    assert constexpr(code, "QK_HEAD_DIM_PAD") == "128"
    assert constexpr(code, "PAD_QK_HEAD_DIM") == "True"
    assert constexpr(code, "V_HEAD_DIM_PAD") == "64"
    assert constexpr(code, "HAS_SCORE_MOD") == "False"
    assert constexpr(code, "HAS_FULL_BLOCKS") == "True"
    assert constexpr(code, "FLOAT32_PRECISION") == "'ieee'"


def test_score_mod_and_missing_full_blocks():
    t = list(create_block_mask(mods.causal_mask, None, None, 64, 64, device=DEVICE).as_tuple())
    t[4], t[5] = None, None
    code = compile_and_code(score_mod=mods.tanh_softcap(4.0), block_mask_tuple=tuple(t))
    assert constexpr(code, "HAS_SCORE_MOD") == "True"
    assert constexpr(code, "HAS_FULL_BLOCKS") == "False"


def test_kernel_options_override_the_config():
    code = compile_and_code(L=128, S=128, options={"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 2,
                                                   "num_stages": 1, "PRESCALE_QK": True})
    assert constexpr(code, "BLOCK_M") == "16"
    assert constexpr(code, "BLOCK_N") == "32"
    assert constexpr(code, "PRESCALE_QK") == "True"
    assert "num_warps=2" in code and "num_stages=1" in code


def test_float32_precision_follows_torch_and_ieee_fp32():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        # TF32 products are checked against their own bound in test_forward; here only
        # the choice is.
        code = compile_and_code(dtype=torch.float32, options={"IEEE_FP32": False}, check=False)
        assert constexpr(code, "FLOAT32_PRECISION") == ("'tf32'" if DEVICE == "cuda" else "'ieee'")
        torch._dynamo.reset()
        code = compile_and_code(dtype=torch.float32, options={"IEEE_FP32": True})
        assert constexpr(code, "FLOAT32_PRECISION") == "'ieee'"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_options_without_effect_warn():
    with pytest.warns(UserWarning, match="WRITE_DQ=.*no effect"):
        compile_and_code(options={"WRITE_DQ": False})


def test_tma_choice():
    """USE_TMA: automatic on sm90+ GPUs for 16-bit inputs and long enough keys, on request
    elsewhere (the interpreter emulates descriptors), never when asked not to."""
    from flexattn.lowering.configs.tma import TMA_MIN_KV_LENGTH
    if ON_CUDA:  # the interpreter would take minutes over 4096 x 4096, and is never automatic
        auto = torch.cuda.get_device_capability() >= (9, 0)
        long = TMA_MIN_KV_LENGTH  # queries as many as keys: a prefill, not the decode kernel
        # B=2 x 16 heads x D=128 at 4096 x 4096: TMA_MIN_FORWARD_WORK exactly (the Triton
        # template asked for: on sm90 the Gluon forward would take this call).
        assert constexpr(compile_and_code(L=long, S=long, E=128, Hq=16, Hkv=16, check=False,
                                          options={"BACKEND": "TRITON"}), "USE_TMA") == str(auto)
        torch._dynamo.reset()
        # The same lengths with 2 heads and D=32: a small call keeps pointer loads.
        assert constexpr(compile_and_code(L=long, S=long, check=False), "USE_TMA") == "False"
        torch._dynamo.reset()
    assert constexpr(compile_and_code(check=False), "USE_TMA") == "False"
    torch._dynamo.reset()
    assert constexpr(compile_and_code(E=40, Ev=24, L=100, S=77, options={"USE_TMA": True}), "USE_TMA") == "True"
    torch._dynamo.reset()
    assert constexpr(compile_and_code(check=False, options={"USE_TMA": False}), "USE_TMA") == "False"


def test_tma_defaults_per_kernel_and_head_dim(monkeypatch):
    """The automatic USE_TMA table: 16-bit inputs on sm90 with TMA_MIN_KV_LENGTH keys or
    more; the forward at every head dim, the backward at D=128 only; never the decode
    kernel (no descriptor path)."""
    from flexattn.lowering.configs import tma as configs
    monkeypatch.setattr(configs, "gpu_generation", lambda device: "sm90")
    dev = torch.device("cuda")
    long, short = configs.TMA_MIN_KV_LENGTH, configs.TMA_MIN_KV_LENGTH - 1
    for dim in (32, 64, 128, 256):
        assert configs.tma_by_default("forward", dev, dim, torch.bfloat16, long)
        assert configs.tma_by_default("backward", dev, dim, torch.float16, long) == (64 < dim <= 128)
        assert not configs.tma_by_default("decode", dev, dim, torch.bfloat16, long)
        assert not configs.tma_by_default("forward", dev, dim, torch.float32, long)
        assert not configs.tma_by_default("forward", dev, dim, torch.bfloat16, short)
        assert not configs.tma_by_default("backward", dev, dim, torch.float16, short)
    # A small call keeps pointer loads (the static launcher), forward and backward alike.
    big, small = configs.TMA_MIN_FORWARD_WORK, configs.TMA_MIN_FORWARD_WORK - 1
    assert configs.tma_by_default("forward", dev, 64, torch.bfloat16, long, work=big)
    assert not configs.tma_by_default("forward", dev, 64, torch.bfloat16, long, work=small)
    big, small = configs.TMA_MIN_BACKWARD_WORK, configs.TMA_MIN_BACKWARD_WORK - 1
    assert configs.tma_by_default("backward", dev, 128, torch.bfloat16, long, work=big)
    assert not configs.tma_by_default("backward", dev, 128, torch.bfloat16, long, work=small)
    assert not configs.tma_by_default("decode", dev, 128, torch.bfloat16, long, work=big)
    monkeypatch.setattr(configs, "gpu_generation", lambda device: "sm80")
    assert not configs.tma_by_default("forward", dev, 128, torch.bfloat16, long)


def test_tma_request_that_cannot_be_honoured_warns():
    q = torch.randn(1, 2, 64, 32, device=DEVICE, dtype=torch.float16)
    k = torch.randn(1, 2, 64, 64, device=DEVICE, dtype=torch.float16)[..., ::2]
    bm = create_block_mask(noop_mask, None, None, 64, 64, device=DEVICE).as_tuple()
    opts = {**OPTIONS, "USE_TMA": True}

    def fn(q, k, v):
        return flex_attention_hop(q, k, v, lambda s, b, h, qi, ki: s, bm, 0.25, opts, (), ())

    with pytest.warns(UserWarning, match="USE_TMA=True: the key's head dimension is not contiguous"):
        _, code = run_and_get_code(torch.compile(fn, backend="inductor", fullgraph=True), q, k, q)
    assert constexpr("\n".join(code), "USE_TMA") == "False"


def test_decode_tma_only_on_request():
    """The decode kernel's descriptor path is off by default (measured slower) and
    taken when asked for."""
    assert constexpr(compile_and_code(L=1, S=256, options={"FORCE_DECODE": True}), "USE_TMA") == "False"
    torch._dynamo.reset()
    code = compile_and_code(L=1, S=256, options={"USE_TMA": True, "FORCE_DECODE": True})
    assert constexpr(code, "USE_TMA") == "True"


def test_fast_tanh_choice(monkeypatch):
    from flexattn.lowering import subgraph
    monkeypatch.setattr(subgraph._compat, "triton_interpreter_requested", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert subgraph.use_fast_tanh({}, torch.bfloat16, cuda)
    assert subgraph.use_fast_tanh({}, torch.float16, cuda)
    assert not subgraph.use_fast_tanh({}, torch.float32, cuda)
    assert subgraph.use_fast_tanh({"FAST_TANH": True}, torch.float32, cuda)
    assert not subgraph.use_fast_tanh({"FAST_TANH": False}, torch.bfloat16, cuda)
    assert not subgraph.use_fast_tanh({}, torch.bfloat16, cpu)
    with pytest.raises(ValueError, match="FAST_TANH=True needs an NVIDIA GPU.*torch.float64"):
        subgraph.use_fast_tanh({"FAST_TANH": True}, torch.float64, cuda)
    with pytest.raises(ValueError, match="FAST_TANH=True needs an NVIDIA GPU.*on cpu"):
        subgraph.use_fast_tanh({"FAST_TANH": True}, torch.bfloat16, cpu)


HARDWARE_TANH = "tanh.approx.f32"


@pytest.mark.skipif(not ON_CUDA, reason="the hardware tanh is PTX")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_soft_cap_uses_the_hardware_tanh(dtype):
    # Checked against the float64 golden with the usual three-way bound.
    code = compile_and_code(score_mod=mods.tanh_softcap(4.0), mask_mod=mods.causal_mask, dtype=dtype, L=256, S=256)
    assert HARDWARE_TANH in code and "libdevice.tanh" not in code
    torch._dynamo.reset()
    code = compile_and_code(score_mod=mods.tanh_softcap(4.0), dtype=dtype, options={"FAST_TANH": False})
    assert HARDWARE_TANH not in code and "libdevice.tanh" in code
    torch._dynamo.reset()
    code = compile_and_code(score_mod=mods.tanh_softcap(4.0), dtype=torch.float32, check=False)
    assert HARDWARE_TANH not in code
    torch._dynamo.reset()
    code = compile_and_code(score_mod=mods.tanh_softcap(4.0), dtype=torch.float32, options={"FAST_TANH": True},
                            check=False)
    assert HARDWARE_TANH in code


@pytest.mark.skipif(ON_CUDA, reason="the error is for CPU devices and the interpreter")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fast_tanh_off_gpu_is_an_error(compiled):
    q = torch.randn(1, 1, 16, 16)
    fn = torch.compile(flexattn.flex_attention) if compiled else flexattn.flex_attention
    with pytest.raises(ValueError, match="FAST_TANH=True needs an NVIDIA GPU"):
        fn(q, q, q, mods.tanh_softcap(4.0), kernel_options={"FAST_TANH": True})


def test_bad_block_override_raises():
    with pytest.raises(Exception, match="BLOCK_N=48"):
        compile_and_code(options={"BLOCK_N": 48})


def test_tiles_shrink_to_fit_small_sparse_blocks():
    code = compile_and_code(L=64, S=64, mask_mod=mods.causal_mask, block_size=16)
    assert constexpr(code, "BLOCK_M") == "16" and constexpr(code, "BLOCK_N") == "16"


def test_logger_reports_the_choice(caplog):
    with caplog.at_level(logging.INFO, logger="flexattn.lowering"):
        compile_and_code(mask_mod=mods.causal_mask)
    assert any("flexattn forward" in r.getMessage() and "BLOCK_M=" in r.getMessage() and "lowered in" in r.getMessage()
               for r in caplog.records)


def test_debug_option_logs_at_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="flexattn.lowering"):
        compile_and_code(options={"DEBUG_CONFIG": True})
    assert any(r.levelno == logging.WARNING and "BLOCK_N=" in r.getMessage() for r in caplog.records)


def test_max_autotune_benchmarks_several_configs(caplog):
    with torch._inductor.config.patch(max_autotune=True), \
            caplog.at_level(logging.INFO, logger="flexattn.lowering"):
        code = compile_and_code(L=32, S=32, E=16, mask_mod=mods.causal_mask)
    assert KERNEL_MARK in code
    message = next(r.getMessage() for r in caplog.records if "flexattn forward" in r.getMessage())
    n_candidates = int(message.split("(of ")[1].split(" ")[0])
    assert n_candidates > 1


@pytest.mark.skipif(ON_CUDA, reason="the C++ CPU path")
def test_cpu_without_triton_backend_uses_the_cpu_engine():
    with torch._inductor.config.patch(cpu_backend="cpp"):
        code = compile_and_code(L=40, S=56, mask_mod=mods.causal_mask, score_mod=mods.alibi(2),
                                dtype=torch.float32)
    assert KERNEL_MARK not in code
    assert "flexattn.cpu_flash_forward" in code


def test_register_is_idempotent():
    flexattn.lowering.register()
    flexattn.lowering.register()
    from torch._inductor.lowering import lowerings

    assert flex_attention_hop in lowerings


# --------------------------------------------------------------------------------------
# Config tables (pure Python)
# --------------------------------------------------------------------------------------
def test_config_table_defaults_and_autotune_list():
    cpu = torch.device("cpu")
    assert cfgs.candidate_configs(cpu, 64, torch.float16, False, {}) == [cfgs.default_config(cpu, 64, torch.float16)]
    assert len(cfgs.candidate_configs(cpu, 64, torch.float16, True, {})) > 4
    pinned = cfgs.candidate_configs(cpu, 128, torch.float32, True, {"fwd_BLOCK_M": 32, "num_warps": 8})
    assert all(c.block_m == 32 and c.num_warps == 8 for c in pinned)


def test_one_kv_loop_choice(monkeypatch):
    """One loop over both block lists where the table says so (D=128 16-bit on sm90),
    two where a mask_mod reads captured tensors, unless pinned either way."""
    monkeypatch.setattr(config_base, "gpu_generation", lambda device: "sm90")
    dev = torch.device("cpu")
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {})[0].one_kv_loop
    assert not cfgs.candidate_configs(dev, 256, torch.bfloat16, False, {})[0].one_kv_loop
    assert not cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True)[0].one_kv_loop
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {"ONE_KV_LOOP": True},
                                  mask_reads_memory=True)[0].one_kv_loop
    # ... except where MEMORY_MASK_TABLES has a tile of its own (sm90 D=64: one loop, 64x64);
    # pinned fields and the autotune candidates (two loops) as elsewhere.
    memory_tile = cfgs.candidate_configs(dev, 64, torch.bfloat16, True, {}, mask_reads_memory=True)
    assert memory_tile[0] == cfgs.ForwardConfig(64, 64, 4, 2, one_kv_loop=True)
    assert not any(c.one_kv_loop for c in memory_tile[1:])
    assert cfgs.candidate_configs(dev, 64, torch.bfloat16, False, {})[0] == cfgs.SM90[(64, "16bit")]
    assert cfgs.candidate_configs(dev, 64, torch.bfloat16, False, {"fwd_ONE_KV_LOOP": False},
                                  mask_reads_memory=True)[0] == cfgs.ForwardConfig(64, 64, 4, 2)
    assert not cfgs.candidate_configs(dev, 64, torch.float32, False, {}, mask_reads_memory=True)[0].one_kv_loop
    assert not cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {"fwd_ONE_KV_LOOP": False})[0].one_kv_loop
    # A memory-reading mask on nearly all partial blocks: 128x128, eight warps, two loops (sm90
    # D=128); elsewhere the flag changes nothing.
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True,
                                  partial_heavy=True)[0] == cfgs.ForwardConfig(128, 128, 8, 2)
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, partial_heavy=True)[0].one_kv_loop
    assert cfgs.candidate_configs(dev, 64, torch.bfloat16, False, {}, mask_reads_memory=True,
                                  partial_heavy=True)[0] == cfgs.ForwardConfig(64, 64, 4, 2, one_kv_loop=True)
    # A small call (B=2 H=8 S=4096 D=128, 2**35 of work) with such a mask: 64x64, one loop,
    # three stages, two on a partial-heavy BlockMask, and there two loops where the call
    # writes the log-sum-exp under a score_mod that reads no positions; at 2**36, or with a
    # symbolic size (work None), the tiles above; arithmetic masks and float32 keep their tables.
    small, bound = 2 * 8 * 4096 * 4096 * 128, cfgs.SMALL_CALL_WORK
    assert small == bound // 2
    one_loop_s3, one_loop, two_loops = (cfgs.ForwardConfig(64, 64, 4, 3, one_kv_loop=True),
                                        cfgs.ForwardConfig(64, 64, 4, 2, one_kv_loop=True),
                                        cfgs.ForwardConfig(64, 64, 4, 2))
    expected = {  # (partial_heavy, writes_lse, score_reads_positions): tile
        (False, False, False): one_loop_s3, (False, True, False): one_loop_s3, (False, True, True): one_loop_s3,
        (True, False, False): one_loop, (True, False, True): one_loop, (True, True, True): one_loop,
        (True, True, False): two_loops,
    }
    for (heavy, lse, positions), tile in expected.items():
        assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True, partial_heavy=heavy,
                                      work=small, writes_lse=lse, score_reads_positions=positions)[0] == tile
    # A mask_mod reading at most one value a key takes two loops and three stages whatever the
    # BlockMask, the log-sum-exp and the score_mod; two a key (or not known) keeps the tiles above.
    few_gathers = cfgs.ForwardConfig(64, 64, 4, 3)
    for heavy, lse, positions in expected:
        for gathers, tile in ((0, few_gathers), (1, few_gathers), (2, expected[heavy, lse, positions]),
                              (None, expected[heavy, lse, positions])):
            assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True,
                                          partial_heavy=heavy, work=small, writes_lse=lse,
                                          score_reads_positions=positions, mask_key_gathers=gathers)[0] == tile
    for work in (bound, None):
        assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True, work=work,
                                      mask_key_gathers=1)[0] == cfgs.ForwardConfig(128, 64, 4, 2)
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, work=small,
                                  mask_key_gathers=0)[0] == cfgs.SM90[(128, "16bit")]
    # The log-sum-exp changes nothing outside the small partial-heavy tile.
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True, partial_heavy=True,
                                  work=bound, writes_lse=True)[0] == cfgs.ForwardConfig(128, 128, 8, 2)
    for work in (bound, None):
        assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True, partial_heavy=True,
                                      work=work)[0] == cfgs.ForwardConfig(128, 128, 8, 2)
        assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, mask_reads_memory=True,
                                      work=work)[0] == cfgs.ForwardConfig(128, 64, 4, 2)
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {}, work=small)[0] == cfgs.SM90[(128, "16bit")]
    assert cfgs.candidate_configs(dev, 128, torch.float32, False, {}, mask_reads_memory=True,
                                  work=small)[0] == cfgs.ForwardConfig(32, 64, 4, 3)
    assert cfgs.candidate_configs(dev, 128, torch.bfloat16, False, {"BLOCK_M": 128}, mask_reads_memory=True,
                                  work=small)[0] == cfgs.ForwardConfig(128, 64, 4, 3, one_kv_loop=True)
    # float64 takes the float32 tiles (no tensor cores; its probability tile is staged
    # in shared memory, which the estimate counts).
    assert cfgs.default_config(dev, 64, torch.float64) == cfgs.default_config(dev, 64, torch.float32)
    cfg = cfgs.ForwardConfig(64, 64, 4, 2)
    assert cfgs.shared_memory_estimate(cfg, 64, 64, 8) - 4 * cfgs.shared_memory_estimate(cfg, 64, 64, 2) == 8 * 64 * 64


def test_gpu_model_tables_override_their_generation(monkeypatch):
    """An H100 reads the sm90-h100 entries where there are some, the sm90 table for the
    rest; any other sm90 GPU reads the sm90 table."""
    monkeypatch.setattr(config_base, "gpu_generation", lambda device: "sm90")
    dev = torch.device("cpu")
    h100_tiles = cfgs.ForwardConfig(32, 64, 4, 1)
    assert h100_tiles != cfgs.SM90[(64, "16bit")]
    monkeypatch.setitem(cfgs.SM90_H100, (64, "16bit"), h100_tiles)
    monkeypatch.setattr(config_base, "gpu_model", lambda device: "h100")
    assert cfgs.default_config(dev, 64, torch.bfloat16) == h100_tiles
    assert cfgs.default_config(dev, 128, torch.bfloat16) == cfgs.SM90[(128, "16bit")]
    monkeypatch.setattr(config_base, "gpu_model", lambda device: "h200")
    assert cfgs.default_config(dev, 64, torch.bfloat16) == cfgs.SM90[(64, "16bit")]
    monkeypatch.setattr(config_base, "gpu_model", lambda device: None)
    assert cfgs.default_config(dev, 64, torch.bfloat16) == cfgs.SM90[(64, "16bit")]


def test_config_filter():
    big = cfgs.ForwardConfig(128, 128, 8, 4)
    usable = cfgs.usable_configs([big, cfgs.ForwardConfig(64, 32, 4, 2)], {}, sparse_q=128, sparse_kv=128,
                                 qk_dim_pad=256, v_dim_pad=256, elem_bytes=2, smem_limit=227 * 1024)
    assert big not in usable and usable
    fitted = cfgs.usable_configs([big], {}, sparse_q=32, sparse_kv=64, qk_dim_pad=64, v_dim_pad=64,
                                 elem_bytes=2, smem_limit=None)
    assert fitted == [cfgs.ForwardConfig(32, 64, 8, 4)]
    with pytest.raises(config_base.ConfigError):
        cfgs.usable_configs([big], {"BLOCK_M": 256}, sparse_q=128, sparse_kv=128, qk_dim_pad=64,
                            v_dim_pad=64, elem_bytes=2, smem_limit=None)


# --------------------------------------------------------------------------------------
# Lookups in a sorted captured tensor (bucketize, searchsorted)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("out_int32", [False, True], ids=["int64", "int32"])
@pytest.mark.parametrize("right", [False, True], ids=["left", "right"])
@pytest.mark.parametrize("op", ["bucketize", "searchsorted"])
@pytest.mark.parametrize("n", [1, 2, 5, 8, 13])
def test_sorted_searches_unroll_to_the_same_positions(n, op, right, out_int32):
    """The unrolled binary search gives torch's position for every value below, between,
    on (repeated entries included) and above a sorted table's entries."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from flexattn.lowering.subgraph import unroll_sorted_searches

    table = torch.randint(0, 3 * n, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.int32).sort().values

    def search(value, table):
        if op == "bucketize":
            return torch.bucketize(value, table, right=right, out_int32=out_int32)
        return torch.searchsorted(table, value, right=right, out_int32=out_int32)

    graph = make_fx(search)(torch.tensor(0), table)
    unroll_sorted_searches(graph)
    searches = {torch.ops.aten.bucketize.Tensor, torch.ops.aten.searchsorted.Tensor}
    assert not any(node.target in searches for node in graph.graph.nodes)
    for value in range(-2, 3 * n + 2):
        got, want = graph(torch.tensor(value), table), search(torch.tensor(value), table)
        assert got.dtype == want.dtype and got.item() == want.item(), (value, table.tolist())


def test_a_searched_table_of_changing_length_is_refused_with_the_rewrite():
    """A start-offsets table whose length changes between calls turns dynamic; the search
    cannot be unrolled over a symbolic length, and the error says to pad the table."""
    compiled = torch.compile(flexattn.flex_attention)
    n = 128
    q = torch.randn(1, 2, n, 16, device=DEVICE)
    for count in (3, 4):
        starts = torch.tensor([0, 40, 90, 100][:count], device=DEVICE)

        def mask_mod(b, h, q_idx, kv_idx, starts=starts):
            return torch.searchsorted(starts, q_idx, right=True) == torch.searchsorted(starts, kv_idx, right=True)

        block_mask = create_block_mask(mask_mod, None, None, n, n, device=DEVICE)
        if count == 3:
            compiled(q, q, q, block_mask=block_mask)
        else:
            with pytest.raises(Exception, match="needs a table of static length.*pad it to one length"):
                compiled(q, q, q, block_mask=block_mask)
