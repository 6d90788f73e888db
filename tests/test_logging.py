"""Feedback on long work: FLEXATTN_LOG=info prints what flexattn compiles and how long it
took; without it flexattn prints nothing but the CPU engine's one-time build notice."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import torch
    import flexattn
    torch._inductor.config.force_disable_caches = True  # a cached graph would lower nothing
    q = torch.randn(1, 2, 64, 16)
    flexattn.flex_attention(q, q, q)
    flexattn.flex_attention(q, q, q)  # the same signature: no second compile line
    torch.compile(flexattn.flex_attention)(q, q, q, score_mod=flexattn.mods.alibi(2))
""")


def _run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "FLEXATTN_LOG"}
    env["TRITON_INTERPRET"] = "0"
    if env_value is not None:
        env["FLEXATTN_LOG"] = env_value
    return subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)


def test_flexattn_log_info_reports_compiles_with_their_time():
    done = _run("info")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("[flexattn ")]
    compiled = [line for line in lines if "compiled the operator for q [1, 2, 64, 16]" in line]
    assert len(compiled) == 1 and " s; later calls" in compiled[0], lines
    assert any("the C++ engine" in line and "lowered in" in line for line in lines), lines
    # The C++ libraries' own times: the engine built or loaded, the alibi mod library.
    assert any("CPU engine" in line and line.endswith(" s") for line in lines), lines
    assert any("the C++ of a call's score_mod/mask_mod in" in line for line in lines), lines


def test_silent_by_default_and_bad_values_warn():
    """Silent apart from the CPU engine's one-time build notice (tests/test_cpu_build.py),
    which a cached engine does not print."""
    done = _run(None)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not [line for line in done.stderr.splitlines() if line.startswith("[flexattn ")]
    done = _run("loud")
    assert done.returncode == 0 and "FLEXATTN_LOG must be one of" in done.stderr


def test_long_create_block_mask_builds_are_logged(caplog, monkeypatch):
    import logging

    import flexattn
    import flexattn.block_mask as block_mask

    monkeypatch.setattr(block_mask, "LONG_BUILD_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="flexattn.block_mask"):
        flexattn.create_block_mask(flexattn.mods.causal_mask, 2, 1, 96, 96, device="cpu", BLOCK_SIZE=32)
    assert any("create_block_mask(causal_mask) for B=2 H=1 Q_LEN=96 KV_LEN=96" in r.getMessage() and " s" in
               r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
