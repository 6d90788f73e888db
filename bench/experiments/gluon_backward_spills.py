"""Does a Gluon backward variant spill on sm90, and is it the Triton release or ptxas? (issue #50)

    TRITON_INTERPRET=1 PYTHONPATH=. python bench/experiments/gluon_backward_spills.py [PYTHON ...] \
        [--other-ptxas PATH] [--dims 64,128] [--configs '{"NAME": {"dq_before_dk": true}, ...}']

No GPU needed. Renders the Gluon backward of a causal call (B=2 H=4 L=256, fp16, no
score_mod; ``--masks`` names others) through flexattn's lowering on the CPU in each order of
the dQ product (`GluonBackwardConfig.dq_before_dk`; ``--configs`` names other sets of the
config's fields), then compiles each rendered module for sm90 under each PYTHON given (each
with its own Triton: e.g. this one and a venv holding the GPU machine's Triton 3.6) and prints
ptxas's spill bytes (stores and loads), registers and shared memory; ``--other-ptxas`` also
runs that ptxas on the same PTX (to tell the Triton release's code generation from its ptxas).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, "tests")
import flexattn  # noqa: E402
from flexattn import _compat, mods  # noqa: E402
from flexattn.lowering.configs import gluon_backward as configs  # noqa: E402

_compat.enable_triton_interpreter()
_compat.use_interpreter_libdevice()
from _gluon_offline import compile_offline_for_sm90, rendered_gluon_sources  # noqa: E402


#: The calls rendered: name -> (score_mod, mask_mod) at H=4, L=256.
MASKS = {
    "causal": lambda: (None, mods.causal_mask),
    # Document ids read at the query and at the key (a mask_mod reading a captured tensor).
    "documents": lambda: (None, mods.document_mask(torch.arange(256) // 97)),
    "alibi_causal": lambda: (mods.alibi(4), mods.causal_mask),
    # A 2-D neighbourhood on a 16-wide canvas: divisions by a non-power of two.
    "neighbourhood_2d": lambda: (None, lambda b, h, qi, ki: ((qi // 12 - ki // 12).abs() <= 2)
                                 & ((qi % 12 - ki % 12).abs() <= 2)),
}


def rendered(head_dim: int, fields: dict, mask: str = "causal") -> list[str]:
    B, H, L = 2, 4, 256
    q, k, v = (torch.randn(B, H, L, head_dim, dtype=torch.float16, requires_grad=True) for _ in range(3))
    score_mod, mask_mod = MASKS[mask]()
    block_mask = flexattn.create_block_mask(mask_mod, B, None, L, L, device="cpu")

    def run():
        torch.compile(flexattn.flex_attention)(q, k, v, score_mod=score_mod, block_mask=block_mask).sum().backward()

    with pytest.MonkeyPatch.context() as patches:
        config = dataclasses.replace(configs.SM90[head_dim], **fields)
        patches.setattr(configs, "SM90", {**configs.SM90, head_dim: config})
        sources = rendered_gluon_sources(patches, pathlib.Path(tempfile.mkdtemp()), run, kernel="backward")
    sources = [s for s in sources if "def consume_keys(" in open(s).read()]
    # (The lowering sets LATE_DP by the mods where BWD_LATE_DP does not.)
    assert sources and all(f"{name} : tl.constexpr = {value}" in open(s).read() for s in sources
                           for name, value in config.constexprs().items() if name != "LATE_DP")
    return sources[:1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("pythons", nargs="*", default=[sys.executable])
    parser.add_argument("--other-ptxas", default="")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--masks", default="causal", help=f"comma-separated, of {sorted(MASKS)}")
    parser.add_argument("--configs", default='{"dq_after_dk": {"dq_before_dk": false}, "dq_before_dk": {"dq_before_dk": true}}')
    args = parser.parse_args()
    for head_dim in map(int, args.dims.split(",")):
        for mask, (name, fields) in itertools.product(args.masks.split(","), json.loads(args.configs).items()):
            paths = rendered(head_dim, fields, mask)
            for python in args.pythons:
                for report in compile_offline_for_sm90(paths, python, args.other_ptxas):
                    print(f"D={head_dim} {mask} {name} triton {report['triton']}: spill bytes (stores + loads) "
                          f"{report['spills']}, with the other ptxas {report['other_ptxas_spills']}; "
                          f"registers {report['registers']}, shared memory {report['shared']} bytes")


if __name__ == "__main__":
    main()
