"""A Llama-style GPT and a mixture-of-experts GPT trained through megatron_fsdp on 2
gloo ranks equal single-process training (dropout 0, fp32, within 1e-5), and the
expert parameters live on the expert data-parallel group.

The MoE reference runs the global batch as the ranks do, one forward per rank's
share with the loss averaged over shares: the load-balancing loss is a
per-forward statistic (as in Megatron-core), so only this split gives the same
numbers; the cross-entropy part is the global mean either way.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import megatron_fsdp as mf
from megatron_fsdp.param_marks import is_expert_param
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock, gpt_loss
from models import make_optimizer, max_param_diff

TOL = 1e-5
STEPS, SEQ, BATCH_PER_RANK = 3, 16, 2

LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=40,
             seq_length=SEQ, vocab_size=96, swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False)
MOE = dict(LLAMA, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.05)
FAMILIES = {"llama": LLAMA, "llama_qk_norm": dict(LLAMA, qk_layernorm=True), "moe": MOE,
            "moe_recompute_shared": dict(MOE, recompute_granularity="full", recompute_method="uniform",
                                         recompute_num_layers=2, moe_shared_expert_intermediate_size=16)}


def _batches(world: int, vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (BATCH_PER_RANK * world, SEQ + 1), generator=g) for _ in range(STEPS)]


def _reference(model: GPT, batches, optimizer: str, world: int) -> GPT:
    """Single process; each step averages the losses of the ranks' shares of the batch."""
    model = copy.deepcopy(model)
    opt = make_optimizer(optimizer)(model.parameters())
    model.set_moe_aux_loss_scale(1.0 / world)
    for tokens in batches:
        opt.zero_grad()
        for share in tokens.chunk(world):
            (gpt_loss(model(share[:, :-1]), share[:, 1:]) / world).backward()
        opt.step()
    return model


def parity_worker(rank, world, *, family, strategy, optimizer, meta=False):
    cfg = GPTConfig(**FAMILIES[family])
    torch.manual_seed(0)
    model = GPT(cfg)
    batches = _batches(world, cfg.vocab_size)
    reference = _reference(model, batches, optimizer, world)
    if meta:  # built on the meta device, materialised module by module inside megatron_fsdp
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)
    # Expert parallel size 1: every rank holds every expert, and the expert
    # data-parallel group spans all ranks, on a mesh of its own.
    expt_mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    fsdp_model, opt = mf.fully_shard(model, make_optimizer(optimizer), fsdp_unit_modules=[TransformerBlock],
                                     zero_dp_strategy=strategy, expt_device_mesh=expt_mesh,
                                     init_model_with_meta_device=meta)
    for tokens in batches:
        opt.zero_grad()
        share = tokens.chunk(world)[rank]
        gpt_loss(fsdp_model(share[:, :-1]), share[:, 1:]).backward()
        opt.step()
    expert_groups = _expert_group_placement(fsdp_model, expt_mesh)
    return max_param_diff(mf.get_full_state_dict(fsdp_model), reference), expert_groups


def _expert_group_placement(fsdp_model, expt_mesh) -> dict:
    """Which data-parallel groups the expert and the dense parameters went to."""
    index = fsdp_model.dist_index
    expert_dp = index.groups_for(True) if index.expt_device_mesh is not None else None
    placement = {"expert_params": 0, "dense_params": 0, "mixed_groups": 0, "expert_on_expert_group": True,
                 "dense_on_dense_group": True}
    for group in fsdp_model.param_and_grad_buffer.groups:
        kinds = {is_expert_param(p) for p in group.params}
        placement["mixed_groups"] += len(kinds) > 1
        if True in kinds:
            placement["expert_params"] += len(group.params)
            placement["expert_on_expert_group"] &= (group.dp is expert_dp
                                                    and group.dp.shard_group is expt_mesh["fsdp"].get_group())
        else:
            placement["dense_params"] += len(group.params)
            placement["dense_on_dense_group"] &= group.dp is index.groups_for(False)
    return placement


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_models_train_like_a_single_process(pool2, family, strategy, optimizer):
    if family in ("llama_qk_norm", "moe_recompute_shared") and optimizer == "sgd":
        pytest.skip("variants run with AdamW only (the CPU budget is shared)")
    results = pool2.run(parity_worker, family=family, strategy=strategy, optimizer=optimizer)
    diffs = [diff for diff, _ in results]
    assert max(diffs) < TOL, diffs
    placement = results[0][1]
    assert placement["mixed_groups"] == 0 and placement["dense_on_dense_group"], placement
    if family.startswith("moe"):
        # 2 layers x 4 experts x (fc, proj) weights
        assert placement["expert_params"] == 16 and placement["expert_on_expert_group"], placement
    else:
        assert placement["expert_params"] == 0


def test_moe_model_built_on_the_meta_device(pool2):
    results = pool2.run(parity_worker, family="moe", strategy="optim_grads_params", optimizer="adamw", meta=True)
    assert max(diff for diff, _ in results) < TOL, results
    assert results[0][1]["expert_params"] == 16 and results[0][1]["expert_on_expert_group"]


def no_expert_mesh_worker(rank, world):
    torch.manual_seed(0)
    try:
        mf.fully_shard_model(GPT(GPTConfig(**MOE)), fsdp_unit_modules=[TransformerBlock])
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_moe_model_needs_an_expert_mesh(pool2):
    assert "expt_device_mesh" in pool2.run(no_expert_mesh_worker)[0]
