"""Context parallelism: one sequence sharded across the ranks of a torch.distributed group.

    plan = plan_context_parallel(block_mask, world_size)        # the same on every rank
    q, k, v = (plan.shard(t, rank) for t in (q_full, k_full, v_full))
    out = context_parallel_attention(q, k, v, block_mask, plan, score_mod)

``plan`` balances the blocks each rank computes (causal masks get the zigzag split);
keys and values travel by a peer-to-peer ring or one all-gather (``strategy``); gradients
of keys and values go back to the ranks that own them. See the guide's "Context
parallelism" section for a training loop under torchrun and what it costs.
"""

from .attention import ContextParallelAttention, context_parallel_attention
from .plan import ShardInputs, ShardPlan, plan_context_parallel, plan_shards

__all__ = [
    "ContextParallelAttention",
    "ShardInputs",
    "ShardPlan",
    "context_parallel_attention",
    "plan_context_parallel",
    "plan_shards",
]
