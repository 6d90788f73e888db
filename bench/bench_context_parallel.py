"""Benchmark: context-parallel attention (flexattn.distributed) on several GPUs.

Run under torchrun, one process per GPU (NCCL):

    torchrun --nproc-per-node 4 bench/bench_context_parallel.py --lengths 32768,131072 --masks causal,document

For each total length S and mask (bfloat16, B=1, H=16, D=128, BLOCK 128), it times a
forward + backward of the sharded sequence on the W ranks:

* flexattn with each strategy (``ring``, ``allgather``; ``auto``'s choice is noted);
  masks ``causal``, ``document`` (16 unequal documents, causal inside) and ``sliding`` (a
  causal window of 4096 keys, at most S / 4);
* with ``--peer``, torch's DTensor context parallel (``_ContextParallel`` with its
  FlexAttention and head-tail load balancing), where torch has it;
* flexattn on one GPU over the whole sequence (each rank on its own GPU), whose output
  and gradients the sharded runs are also compared with (``max_diff_vs_1gpu``).

With ``--profile``, each rank also profiles three steps of every strategy and prints where
its GPU time went: attention kernels, NCCL kernels (which include waiting for peers), other
kernels (copies, casts, sums), and the rest of the step (the stream idle: host, syncs).

It reports the median ms per step (the slowest rank's), the strong-scaling efficiency
T_1(S) / (W * T_W(S)), the plan's imbalance, and flexattn's speed over the peer. Rank 0
writes ``context-parallel-<gpu>-x<W>-<stamp>.json`` (to ``--out``, default bench/results)
and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import flexattn  # noqa: E402
from flexattn import mods  # noqa: E402
from flexattn.distributed import ContextParallelAttention  # noqa: E402
from flexattn.distributed.attention import choose_strategy  # noqa: E402  (what "auto" picks)
from flexattn.distributed.local import LocalMasks  # noqa: E402

H, D, BLOCK = 16, 128, 128
#: CUDA with NCCL; without a GPU, the CPU with gloo (a smoke test of the script).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DOCUMENTS = 16
#: The sliding mask's window (causal): a rank's queries read one neighbour's last keys.
WINDOW = 4096


def mask_mod(name: str, S: int, device):
    if name == "causal":
        return mods.causal_mask
    if name == "document":
        # Unequal documents (lengths in a fixed pseudo-random ratio), causal inside each.
        weights = torch.tensor([(7 * i) % 11 + 1 for i in range(DOCUMENTS)], dtype=torch.float64)
        ends = (weights.cumsum(0) / weights.sum() * S).round().long().clamp(max=S)
        ids = torch.bucketize(torch.arange(S), ends, right=True).clamp(max=DOCUMENTS - 1).to(device)
        return flexattn.and_masks(mods.causal_mask, mods.document_mask(ids))
    if name == "sliding":
        return mods.sliding_window(min(WINDOW, S // 4))
    raise ValueError(name)


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(step, reps: int, warmup: int, group=None) -> float:
    """Median ms of ``step`` over ``reps`` runs after ``warmup``; the slowest rank's."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        if group is not False:
            dist.barrier(group)
        _sync()
        start = time.perf_counter()
        step()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    median = torch.tensor([statistics.median(times)], device=DEVICE)
    if group is not False:
        dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median)


def fwd_bwd(attend, q, k, v, grad):
    def step():
        out = attend(q, k, v)
        torch.autograd.backward(out, grad)
        q.grad = k.grad = v.grad = None

    return step


def full_inputs(S: int, seed: int):
    """The whole sequence's q, k, v and output gradient, the same on every rank."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    return [torch.randn(1, H, S, D, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(4)]


def results(attend, q, k, v, grad):
    """(out, dq, dk, dv) of one forward + backward."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return out.detach(), dq, dk, dv


def run_single(name, S, full, args):
    """flexattn on one GPU over the whole sequence (every rank on its own GPU, at once):
    the time and the results the sharded runs are compared with."""
    bm = flexattn.create_block_mask(mask_mod(name, S, DEVICE), None, None, S, S, device=DEVICE, BLOCK_SIZE=BLOCK)
    attend = lambda q, k, v: flexattn.flex_attention(q, k, v, block_mask=bm)  # noqa: E731
    expected = results(attend, *full)
    q, k, v = (t.detach().requires_grad_() for t in full[:3])
    return timed(fwd_bwd(attend, q, k, v, full[3]), args.reps, args.warmup), expected


def run_flexattn(name, S, strategy, rank, full, expected, args):
    """The sharded run: time, plan imbalance, and the largest difference of this rank's
    out, dq, dk, dv from the one-GPU run's (the max over ranks)."""
    bm = flexattn.create_block_mask(mask_mod(name, S, DEVICE), None, None, S, S, device=DEVICE, BLOCK_SIZE=BLOCK)
    attention = ContextParallelAttention(bm, strategy=strategy)
    local = [attention.plan.shard(t, rank) for t in full]
    got = results(attention, *local)
    diff = torch.tensor([max(float((g.float() - attention.plan.shard(e, rank).float()).abs().max())
                             for g, e in zip(got, expected))], device=DEVICE)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    q, k, v = (t.detach().requires_grad_() for t in local[:3])
    ms = timed(fwd_bwd(attention, q, k, v, local[3]), args.reps, args.warmup)
    if args.profile:
        profile_steps(fwd_bwd(attention, q, k, v, local[3]), f"{name} {S} {strategy}", rank)
    masks = LocalMasks(bm, attention.plan, None, torch.device(DEVICE))
    return ms, attention.plan.imbalance, float(diff), masks.received_fraction(), choose_strategy("auto")


def profile_steps(step, label: str, rank: int, steps: int = 3) -> None:
    """Print this rank's GPU time per step of ``step`` by kind of kernel (see --profile)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _sync()
        wall = (time.perf_counter() - start) * 1e3 / steps
    kinds = {"attention": 0.0, "nccl": 0.0, "other": 0.0}
    others = []
    for event in prof.key_averages():
        ms = event.self_device_time_total / 1e3 / steps
        # Kernels only: a CPU op's self device time repeats its kernels'.
        if ms <= 0 or event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.key
        kind = "nccl" if "nccl" in name.lower() else "attention" if "flexattn" in name or "triton_tem" in name \
            else "other"
        kinds[kind] += ms
        if kind == "other":
            others.append((ms, name[:60]))
    top = ", ".join(f"{name} {ms:.2f}" for ms, name in sorted(others, reverse=True)[:5])
    print(f"[profile {label} rank {rank}] step {wall:.2f} ms: attention {kinds['attention']:.2f}, "
          f"nccl {kinds['nccl']:.2f}, other {kinds['other']:.2f} ({top})", flush=True)


def run_peer(name, S, world, full, args):
    """torch's DTensor context parallel with torch's FlexAttention, or the error it gave."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._attention import (
            _context_parallel_shard,
            _ContextParallel,
            _HeadTailLoadBalancer,
        )
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.nn.attention import flex_attention as torch_flex
    except ImportError as error:
        return f"{type(error).__name__}: {error}"
    try:
        mesh = init_device_mesh(DEVICE, (world,), mesh_dim_names=("cp",))
        # _compile: torch's eager mask builder materialises the S x S mask (128 GiB at 131072).
        bm = torch_flex.create_block_mask(mask_mod(name, S, DEVICE), None, None, S, S, device=DEVICE,
                                          BLOCK_SIZE=BLOCK, _compile=True)
        compiled = torch.compile(torch_flex.flex_attention)

        class Attention(torch.nn.Module):
            def forward(self, q, k, v, block_mask):
                return compiled(q, k, v, block_mask=block_mask)

        module = Attention()
        parallelize_module(module, mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
        balancer = _HeadTailLoadBalancer(S, world, torch.device(DEVICE))
        *local, local_mask = _context_parallel_shard(mesh, [*full, bm], [2] * 5, load_balancer=balancer)
        q, k, v = (t.detach().requires_grad_() for t in local[:3])
        return timed(fwd_bwd(lambda q, k, v: module(q, k, v, local_mask), q, k, v, local[3]), args.reps, args.warmup)
    except Exception as error:  # recorded in the results, not fatal to the run
        message = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        return message


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--masks", default="causal,document")
    parser.add_argument("--strategies", default="ring,allgather")
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--profile", action="store_true", help="per rank: where each strategy's GPU time goes")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()

    if DEVICE == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for S in (int(x) for x in args.lengths.split(",")):
        for name in args.masks.split(","):
            full = full_inputs(S, seed=S)
            single, expected = run_single(name, S, full, args)
            row = {"S": S, "mask": name, "world": world, "single_gpu_ms": single}
            for strategy in args.strategies.split(","):
                ms, imbalance, diff, received, auto = run_flexattn(name, S, strategy, rank, full, expected, args)
                row["auto_choice"] = auto
                # The share of a whole all-gather's keys the ranks' queries list (the gather
                # moves only those where it is at most GATHER_ALL_FRACTION).
                row["listed_kv_fraction"] = received
                row[f"{strategy}_ms"] = ms
                row[f"{strategy}_efficiency"] = single / (world * ms)
                row[f"{strategy}_max_diff_vs_1gpu"] = diff
                row["imbalance"] = imbalance
            del expected
            if args.peer:
                row["torch_cp_ms"] = run_peer(name, S, world, full, args)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
            del full
            if DEVICE == "cuda":
                torch.cuda.empty_cache()

    if rank == 0:
        gpu = torch.cuda.get_device_name().lower().replace(" ", "-") if DEVICE == "cuda" else "cpu"
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
        command = "torchrun --nproc-per-node {} bench/bench_context_parallel.py {}".format(
            world, shlex.join(sys.argv[1:]))
        meta = {"command": command, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "world": world, "torch": torch.__version__,
                "H": H, "D": D, "BLOCK": BLOCK, "dtype": "bfloat16", "rows": rows}
        path = Path(args.out) / f"context-parallel-{gpu}-x{world}-{stamp}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=1))
        strategies = args.strategies.split(",")
        print("| S | mask | W | 1 GPU ms | " + " | ".join(f"{s} ms | {s} eff" for s in strategies)
              + " | torch CP ms | best / torch CP | imbalance |")
        print("| --- " * (5 + 2 * len(strategies) + 2) + "|")
        for row in rows:
            best = min(row[f"{s}_ms"] for s in strategies)
            peer = row.get("torch_cp_ms", "-")
            ratio = f"{peer / best:.2f}x" if isinstance(peer, float) else "-"
            peer_cell = f"{peer:.1f}" if isinstance(peer, float) else str(peer)[:60]
            cells = " | ".join(f"{row[f'{s}_ms']:.1f} | {row[f'{s}_efficiency']:.0%}" for s in strategies)
            print(f"| {row['S']} | {row['mask']} | {row['world']} | {row['single_gpu_ms']:.1f} | {cells} | "
                  f"{peer_cell} | {ratio} | {row['imbalance']:.1%} |")
        print(f"results: {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
