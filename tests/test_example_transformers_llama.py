"""examples/transformers_llama.py on the CPU, in-process.

The example registers flexattn with transformers in one call, then generates greedily
and takes a training step with a tiny Llama, checking both against transformers' eager
attention. Here: it passes, and its check does fail when flexattn's mask drops the
padding.
"""

from __future__ import annotations

import pytest

from conftest import DEVICE, load_example

pytest.importorskip("transformers")
llama = load_example("transformers_llama.py")
pytestmark = [pytest.mark.skipif(DEVICE != "cpu", reason="the CPU run of the example; on a GPU run it with --device cuda"),
              pytest.mark.workflow]


def test_example_passes(flexattn_kernels, capsys):
    summary = llama.run(["--new-tokens", "5"])
    assert summary["ok"], summary
    assert len(summary["generated"]) == 3 and all(len(row) == 5 for row in summary["generated"])
    assert summary["grad_err"] <= llama.TOLERANCE
    assert "OK" in capsys.readouterr().out


def test_example_fails_when_the_padding_is_dropped(flexattn_kernels, monkeypatch):
    import flexattn.integrations.transformers as flexattn_hf

    monkeypatch.setattr(flexattn_hf, "_with_padding", lambda pattern, padding: pattern)
    summary = llama.run(["--new-tokens", "5"])
    assert not summary["ok"]
    assert summary["grad_err"] > llama.TOLERANCE
