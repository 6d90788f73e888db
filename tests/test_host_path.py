"""What a compiled call costs the host besides its kernels (issue #49's host-time item):
no host-device synchronisation anywhere in a compiled forward and backward, and a small
call's kernels launched by Inductor's static launcher (descriptor kernels need Triton's
own, bench/DECISIONS.md#tma-small-forward-calls, #tma-small-backward-calls).

GPU only: the CPU path has neither a device queue to wait on nor a static launcher.
"""

from __future__ import annotations

import pytest
import torch

import flexattn
from flexattn import mods
from flexattn.lowering.configs import tma as tma_configs

from conftest import DEVICE

pytestmark = [pytest.mark.skipif(DEVICE != "cuda", reason="host-device synchronisation and kernel launchers are "
                                                          "GPU matters"),
              pytest.mark.usefixtures("inductor_runs_flexattn_kernels")]


def _documents_causal(S: int):
    """A mask_mod reading a captured tensor (packed documents), causal within each."""
    doc = (torch.arange(S, device=DEVICE) * 5 // S).to(torch.int32)
    return flexattn.and_masks(mods.document_mask(doc), mods.causal_mask)


def _training_call(B: int, H: int, S: int, D: int):
    block_mask = flexattn.create_block_mask(_documents_causal(S), None, None, S, S, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16, generator=gen, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    score_mod = mods.alibi(H, device=DEVICE)
    compiled = torch.compile(flexattn.flex_attention, fullgraph=True, dynamic=False)

    def step():
        for t in (q, k, v):
            t.grad = None
        out = compiled(q, k, v, block_mask=block_mask, score_mod=score_mod)
        out.backward(grad_out)
        return out

    return step


@pytest.mark.parametrize("D", [64, 128])
def test_compiled_forward_and_backward_never_wait_for_the_device(D):
    step = _training_call(2, 4, 1024, D)
    step()  # compiles
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            step()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()


def test_small_call_kernels_take_the_static_launcher():
    """Below the descriptor bound at a length where descriptors are otherwise the default
    (D=128, 4096 keys), every kernel of the forward and the backward launches statically:
    Inductor's strict mode raises for any kernel its static launcher refuses."""
    B, H, S, D = 1, 2, tma_configs.TMA_MIN_KV_LENGTH, 128
    assert B * H * S * S * D < min(tma_configs.TMA_MIN_FORWARD_WORK, tma_configs.TMA_MIN_BACKWARD_WORK)
    with torch._inductor.config.patch(use_static_cuda_launcher=True, strict_static_cuda_launcher=True):
        step = _training_call(B, H, S, D)
        out = step()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
