"""bench/bench_user_masks.py on the CPU: its formulations say what they claim (the offsets
and ids forms of one set of documents are one mask, the three token orders of the 2-D
neighbourhood are one mask permuted, cross-attention has fewer queries than keys), and
its dry run writes a result with kernel and wall times beside torch's flex."""

import json

import pytest

from conftest import load_bench
import torch

from flexattn import create_mask


um = load_bench("bench_user_masks")
SHAPE = um.Shape(2, 4, 1024)
CPU = torch.device("cpu")


def _dense(name, shape=SHAPE):
    built = um.FORMULATIONS[name].build(shape, CPU)
    return create_mask(built.mask_mod, shape.B, shape.H, built.q_len, built.kv_len, device="cpu")


def test_the_suite_covers_at_least_a_dozen_formulations_each_with_a_mod_on_top():
    assert len(um.FORMULATIONS) >= 12
    assert {f.on_top for f in um.FORMULATIONS.values()} == {"alibi", "softcap"}
    cases = um.all_cases()
    assert len(cases) == len(um.FORMULATIONS) * 2 * 2 * 2
    assert len({c.name for c in cases}) == len(cases)


def test_document_offsets_and_ids_forms_are_one_mask():
    assert torch.equal(_dense("doc_offsets_causal"), _dense("doc_ids_causal"))
    assert torch.equal(_dense("doc_offsets_bounds"), _dense("doc_ids"))
    lengths = um.random_lengths(1024, 7)
    assert sum(lengths) == 1024 and min(lengths) > 0 and len(set(lengths)) > 1


@pytest.mark.parametrize("order", ["tiled", "morton"])
def test_neighbourhood_token_orders_are_one_mask_permuted(order):
    rows, cols = um.canvas_coordinates(SHAPE.S, order)
    W = um.math.isqrt(SHAPE.S)
    row_major = rows * W + cols  # each token's position in row-major order
    assert sorted(row_major.tolist()) == list(range(SHAPE.S))
    plain = _dense("neighbourhood_2d")[0, 0]
    permuted = _dense(f"neighbourhood_2d_{order}")[0, 0]
    assert torch.equal(permuted, plain[row_major][:, row_major])


def test_cross_attention_video_heads_and_prompts():
    built = um.FORMULATIONS["text_to_image"].build(SHAPE, CPU)
    assert (built.q_len, built.kv_len) == (SHAPE.S // 4, SHAPE.S)
    mask = _dense("text_to_image")
    assert mask.any(-1).all(), "every caption token sees its image"
    heads = _dense("video_heads")
    assert not torch.equal(heads[0, 0], heads[0, -1])
    prompts = _dense("prefix_lm_per_sequence")
    assert not torch.equal(prompts[0, 0], prompts[1, 0])


def test_dry_run_writes_kernel_and_wall_times_beside_torch(tmp_path):
    report = um.main(["--dry-run", "--out", str(tmp_path), "--formulations", "doc_offsets_causal,text_to_image",
                      "--tops", "both", "--mode", "fwd,fwdbwd",
                      "--impls", "torch_flex,flexattn,torch_flash,flexattn_triton"])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].startswith("user-masks-cpu-") and files[0].endswith(".json")
    saved = json.loads((tmp_path / files[0]).read_text())
    assert saved["results"] == report["results"] and len(saved["cases"]) == 4
    cells = {(r["case"], r["mode"], r["impl"]): r for r in saved["results"]}
    for case in saved["cases"]:
        fa = cells[(case["name"], "fwd", "flexattn")]
        tf = cells[(case["name"], "fwd", "torch_flex")]
        assert fa["wall_us"] > 0 and tf["wall_us"] > 0 and fa["kernel_us"] is None
        assert fa["max_abs_err"] < 1e-4
        assert cells[(case["name"], "fwdbwd", "flexattn")]["wall_us"] > 0
        assert "note" in cells[(case["name"], "fwdbwd", "torch_flex")]
        assert "note" in cells[(case["name"], "fwd", "torch_flash")]
        # The Triton template forced: the same results (on the CPU the engine runs both).
        assert cells[(case["name"], "fwd", "flexattn_triton")]["max_abs_err"] < 1e-4
        # The listing: a causal document mask lists fewer keys per query block than there are.
        assert 0 < case["walk_keys"] <= case["kv_len"] + 127
        assert case["partial_per_row"] > 0
    assert "doc_offsets_causal+alibi_b1h2s256_d16" in saved["markdown"]
    assert saved["summary"]["fwd"]["small_wall_cases"] == 4


@pytest.mark.parametrize("name", sorted(um.FORMULATIONS))
def test_masks_that_do_not_say_they_read_b_or_h_are_the_same_for_every_b_and_h(name):
    """The suite builds such masks once for the batch and the heads (B and H None)."""
    built = um.FORMULATIONS[name].build(SHAPE, CPU)
    dense = _dense(name)
    assert built.reads_b == any(not torch.equal(dense[b], dense[0]) for b in range(SHAPE.B))
    assert built.reads_h == any(not torch.equal(dense[:, h], dense[:, 0]) for h in range(SHAPE.H))


def test_a_case_past_its_timeout_ends_the_run_with_every_stack(tmp_path):
    """A hung case (here a sleep in place of the case) prints where each thread stands and
    ends the run instead of blocking it."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    script = (f"import sys, time; sys.path.insert(0, {str(bench)!r}); import bench_user_masks as um; "
              "um.run_case = lambda case, settings: time.sleep(60); "
              f"um.main(['--dry-run', '--out', {str(tmp_path)!r}, '--formulations', 'doc_ids', '--tops', 'plain', "
              "'--mode', 'fwd', '--case-timeout', '2'])")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "Timeout" in run.stderr and "<lambda>" in run.stderr
