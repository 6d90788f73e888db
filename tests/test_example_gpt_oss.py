"""examples/gpt_oss_train.py at its --tiny size on the CPU, in-process.

The example checks a gpt-oss-style model (learned sinks, GQA, sliding-window and causal
layers) against dense attention in float64, then trains it with attention dropout under
torch.compile on a task only attention can learn, checking that dropout draws a new mask
per call and repeats under the same seed. Here: it passes, and its check does fail when
flexattn's attention drops the sinks.
"""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, load_example

gpt_oss = load_example("gpt_oss_train.py")
pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU run of the example; on a GPU run it with --device cuda")


def test_tiny_run_passes():
    summary = gpt_oss.run(["--tiny"])
    assert summary["ok"], summary
    assert summary["recompiles"] == 0 and summary["sinks_moved"] > 0
    assert summary["dropout"] == {"repeats": True, "differs": True}
    assert summary["last_loss"] < 0.5 * summary["first_loss"]
    assert summary["tensors"] == 26  # logits and the gradients of all 25 parameters


def test_check_fails_without_the_sinks(monkeypatch):
    real = gpt_oss.flexattn_attend

    def without_sinks(cfg, seq, device):
        attend = real(cfg, seq, device)
        return lambda q, k, v, layer, sinks, p: attend(q, k, v, layer, None, p)

    monkeypatch.setattr(gpt_oss, "flexattn_attend", without_sinks)
    torch.manual_seed(0)
    cfg = gpt_oss.Config(dim=32, layers=2, window=8)
    model = gpt_oss.Model(cfg)
    for block in model.blocks:
        block.attn.sinks.data.normal_()
    tokens = gpt_oss.toy_batch(cfg.vocab, 2, 25, torch.Generator().manual_seed(1))
    assert gpt_oss.check(model, cfg, tokens, torch.float32)["failures"]
