"""examples/llama_paged.py at its --tiny size, in-process: on the CPU, and on a GPU with
CUDA graphs.

The example prefills a batch of prompts, decodes greedily with the paged KV cache (the
decode step under torch.compile) and checks its logits against a float64 run of the same
model on contiguous per-sequence caches. Here: it passes, its decode step compiles once,
the pages all come back, and it does fail when the paged attention is wrong or when the
step recompiles.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, load_example

llama = load_example("llama_paged.py")
on_cpu = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU run of the example")


@on_cpu
def test_tiny_run_passes_eager_backend(capsys):
    summary = llama.run(["--tiny", "--backend", "eager"])
    assert summary["ok"], summary
    assert summary["recompiles"] == 0 and summary["max_abs_err"] <= summary["bound"]
    assert len(summary["generated"]) == 3 and all(len(row) == 6 for row in summary["generated"])
    text = capsys.readouterr().out
    assert "max |paged - float64|" in text and "tokens/s" in text
    assert llama.main(["--tiny", "--backend", "eager"]) == 0


@on_cpu
@pytest.mark.parametrize("layout", ["pages", "heads"])
def test_tiny_run_passes_inductor(layout):
    """The decode step through Inductor (C++ for the model, flexattn's CPU lowering), on
    the default page-major pools and on head-major ones."""
    summary = llama.run(["--tiny", "--new-tokens", "4", "--prompt-lengths", "17,3", "--pool-layout", layout])
    assert summary["ok"], summary
    assert summary["max_abs_err"] < 1e-4


@on_cpu
def test_wrong_paged_attention_fails(monkeypatch, capsys):
    """A decode mask that hides the token's own key: the logits no longer match."""
    def hides_current_token(self, slots, positions):
        pos = positions[:, 0]

        def before_position(b, h, q_idx, kv_idx):
            return kv_idx < pos[b]

        logical = llama.flexattn.create_block_mask(before_position, pos.shape[0], None, 1, int(pos.max()) + 1,
                                                   device=pos.device, BLOCK_SIZE=(self.q_block, self.cache.page_size))
        return self.cache.block_mask_on_pages(logical, slots)

    monkeypatch.setattr(llama.PagedServer, "decode_block_mask", hides_current_token)
    assert llama.main(["--tiny", "--backend", "eager"]) == 1
    assert "logit error" in capsys.readouterr().err


@on_cpu
def test_recompiling_step_fails(monkeypatch, capsys):
    """A mask that closes over a Python int changing every step recompiles the step."""
    original = llama.PagedServer.decode_block_mask
    calls = []

    def with_changing_int(self, slots, positions):
        paged = original(self, slots, positions)
        calls.append(None)
        step, inner = len(calls), paged.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return inner(b, h, q_idx, kv_idx) & (kv_idx > -step)

        paged.mask_mod = mask_mod
        return paged

    monkeypatch.setattr(llama.PagedServer, "decode_block_mask", with_changing_int)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        assert llama.main(["--tiny", "--backend", "eager", "--new-tokens", "3"]) == 1
    assert "recompiled" in capsys.readouterr().err


@on_cpu
def test_fused_step_matches_the_unfused_step_token_for_token():
    """Decoding through flex_attention_with_kvcache (rotary, append and attention in one
    call) generates the tokens the unfused step generates, compiles once and passes the
    float64 check."""
    argv = ["--tiny", "--new-tokens", "5", "--prompt-lengths", "17,3,9"]
    unfused = llama.run(argv)
    fused = llama.run(argv + ["--fused-step"])
    assert fused["ok"] and unfused["ok"], (fused, unfused)
    assert fused["recompiles"] == 0 and fused["fused_step"]
    assert fused["generated"] == unfused["generated"]


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_fused_step_under_cuda_graphs_matches_the_unfused_step():
    """The decode step compiled with mode="reduce-overhead": the fused step (rotary,
    in-place append and attention through flex_attention_with_kvcache) is captured and
    replayed as a CUDA graph, with no skip and no recompile, and generates the unfused
    step's tokens."""
    argv = ["--device", "cuda", "--cuda-graphs", "--tiny", "--new-tokens", "6", "--prompt-lengths", "17,3,9"]
    unfused = llama.run(argv)
    fused = llama.run(argv + ["--fused-step"])
    assert fused["ok"] and unfused["ok"], (fused, unfused)
    assert fused["cudagraph_skips"] == 0 and fused["recompiles"] == 0
    assert fused["generated"] == unfused["generated"]
