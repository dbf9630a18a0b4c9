"""Shared pieces of the expert-parallel tests (test_expert_parallel.py): the MoE
configurations, the global batches, the single-process reference trainer and the meshes
of each layout in Megatron-LM's rank order."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_fsdp.models import GPT, GPTConfig, MoELoadBalancing, finish_global_batch, gpt_loss
from megatron_fsdp.models.expert_parallel import set_expert_capacity
from models import make_optimizer

STEPS, MICRO, MBS, SEQ = 3, 2, 1, 16
"""Optimizer steps, micro batches per step, sequences per micro batch and rank, tokens each."""

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
            seq_length=SEQ, vocab_size=96, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
            untie_embeddings_and_output_weights=True, add_bias_linear=False, moe_router_topk=2,
            moe_ffn_hidden_size=24)
VARIANTS = {
    "aux": dict(moe_aux_loss_coeff=0.05),
    "bias": dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=1e-2, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4,
                 moe_router_group_topk=2),
    "seq_aux": dict(moe_aux_loss_coeff=0.05, moe_router_load_balancing_type="seq_aux_loss"),
    "global_aux": dict(moe_aux_loss_coeff=0.05, moe_router_load_balancing_type="global_aux_loss",
                       moe_shared_expert_intermediate_size=16),
    "aux_recompute": dict(moe_aux_loss_coeff=0.05, recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1),
}
"""(a) the Switch aux loss; (b) DeepSeek-V3's aux-loss-free expert bias (sigmoid scores,
group-limited routing); and the other two
balancing losses (the last with a shared expert); the first under full recomputation."""


def moe_config(variant: str, experts: int, **changes) -> GPTConfig:
    return GPTConfig(**{**BASE, **VARIANTS[variant], "num_moe_experts": experts, **changes})


def global_batches(world: int, vocab: int) -> list[torch.Tensor]:
    """Per step (world x MICRO x MBS, SEQ + 1) tokens: rank r trains on chunk r."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (world * MICRO * MBS, SEQ + 1), generator=g) for _ in range(STEPS)]


def train_reference(model: GPT, batches, optimizer: str, world: int, group: dist.ProcessGroup,
                    capacity: Optional[dict] = None) -> GPT:
    """One process, the whole EP-1 model: every step runs each rank's micro batches as that
    rank does (the balancing loss and the capacity are per forward), each loss divided by
    world x MICRO, then updates the expert bias from all of them. ``group``: a one-rank group
    for the counts the parallel run sums over the data-parallel ranks.

    The global aux loss is the exception: its counts are the sum over the ranks' forwards of
    one micro batch, and the ranks' losses add up to one Switch loss of all their tokens with
    those counts; so there micro batch m of every rank runs as one forward."""
    model = copy.deepcopy(model)
    if capacity is not None:
        set_expert_capacity(model, **capacity)
    opt = make_optimizer(optimizer)(model.parameters())
    model.set_moe_aux_loss_scale(1.0 / (world * MICRO))
    model.set_moe_data_parallel_group(group)
    joint = model.config.moe_router_load_balancing_type is MoELoadBalancing.GLOBAL_AUX_LOSS
    for tokens in batches:
        opt.zero_grad()
        micros = [share.chunk(MICRO) for share in tokens.chunk(world)]  # [rank][m]
        if joint:
            for m in range(MICRO):
                micro = torch.cat([rank_micros[m] for rank_micros in micros])
                (gpt_loss(model(micro[:, :-1]), micro[:, 1:]) / MICRO).backward()
        else:
            for micro in (micro for rank_micros in micros for micro in rank_micros):
                (gpt_loss(model(micro[:, :-1]), micro[:, 1:]) / (world * MICRO)).backward()
        finish_global_batch(model, group=group)
        opt.step()
    return model


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Dense FSDP over every rank (``outer`` > 1: HSDP, ``outer`` replicas of a shard group of
    consecutive ranks) and experts over ``ep`` consecutive ranks, Megatron-LM's order."""

    world: int
    ep: int
    outer: int = 1

    def expert_mesh(self) -> DeviceMesh:
        """Expert data-parallel rank x EP + EP rank; with HSDP its outer dimension splits the
        expert data-parallel ranks into consecutive blocks (megatron-core's partial expert
        data-parallel groups with ``num_distributed_optimizer_instances`` = outer)."""
        edp = self.world // self.ep
        if self.outer == 1:
            return init_device_mesh("cpu", (edp, self.ep), mesh_dim_names=("fsdp", "ep"))
        return init_device_mesh("cpu", (self.outer, edp // self.outer, self.ep),
                                mesh_dim_names=("dp_outer", "dp_shard", "ep"))

    def dense_kwargs(self) -> dict:
        """``fully_shard``'s dense mesh arguments (none: the default mesh, every rank shards)."""
        if self.outer == 1:
            return {}
        mesh = init_device_mesh("cpu", (self.outer, self.world // self.outer, 1),
                                mesh_dim_names=("dp_outer", "dp_shard", "tp"))
        return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", tp_dim="tp",
                    hybrid_fsdp_group=dist.group.WORLD)
