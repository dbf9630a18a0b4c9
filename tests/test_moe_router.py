"""The MoE router flags of Megatron-LM's DeepSeek/Qwen/Mixtral recipes, against
megatron-core 0.16.1's own router on the same weights and inputs:

* ``--moe-router-score-function sigmoid`` (top-k sigmoid scores normalised to sum 1)
  and ``--moe-router-topk-scaling-factor``;
* ``--moe-router-enable-expert-bias`` / ``--moe-router-bias-update-rate``: the bias
  steers the choice, the tokens per expert are counted in forward and the bias is
  updated once per global batch from the counts summed over the data-parallel ranks;
* ``--moe-router-num-groups`` / ``--moe-router-group-topk`` (group-limited routing);
* ``--moe-router-load-balancing-type global_aux_loss`` (counts of the global batch, a
  running mean over the micro batches) and ``sinkhorn``.

Each case runs one MoE layer of ours and megatron-core's on both ranks of a 2-rank
gloo pool (each rank its own tokens, so the data-parallel reductions are exercised)
over two micro batches: routing weights and experts, outputs, balancing losses, every
gradient and the expert-bias counts and update. Then: the bias across ranks equals the
one a single process computes on the global batch; and short runs of
scripts/pretrain_gpt.py with the flags. megatron-core's CUDA calls are bridged as in
test_models_mcore.py.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import torch

from launcher_inprocess import run_launcher
from mcore_parity import mcore_device
from megatron_fsdp.models import GPT, GPTConfig, gpt_loss
from megatron_fsdp.models.config import MoELoadBalancing, ScoreFunction
from megatron_fsdp.models.router import finish_global_batch, group_limited_topk, sinkhorn
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args

SEQ, HIDDEN = 8, 32
LAYER = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, seq_length=SEQ, vocab_size=64,
             swiglu=True, ffn_hidden_size=24, normalization="RMSNorm", position_embedding_type="rope",
             add_bias_linear=False, num_moe_experts=8, moe_router_topk=2)
DEEPSEEK = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=1e-2, moe_router_topk_scaling_factor=2.5)
CASES = {
    "sigmoid": dict(moe_router_score_function="sigmoid", moe_aux_loss_coeff=0.05),
    "sigmoid_top1_seq_aux": dict(moe_router_score_function="sigmoid", moe_router_topk=1, moe_aux_loss_coeff=0.05,
                                 moe_router_load_balancing_type="seq_aux_loss"),
    "sigmoid_scaled_expert_bias": dict(DEEPSEEK),
    "deepseek_v3": dict(DEEPSEEK, moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk=4,
                        moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="seq_aux_loss"),
    "group_limited_softmax": dict(moe_router_num_groups=4, moe_router_group_topk=2, moe_aux_loss_coeff=0.05),
    "group_limited_pre_softmax": dict(moe_router_num_groups=2, moe_router_group_topk=1, moe_router_pre_softmax=True,
                                      moe_router_topk_scaling_factor=1.5),
    "global_aux_loss": dict(moe_aux_loss_coeff=0.05, moe_router_load_balancing_type="global_aux_loss"),
    "global_aux_loss_sigmoid_bias": dict(DEEPSEEK, moe_aux_loss_coeff=0.05,
                                         moe_router_load_balancing_type="global_aux_loss"),
    "sinkhorn": dict(moe_router_load_balancing_type="sinkhorn"),
    "sinkhorn_top1": dict(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1),
}


def _mcore_on_cpu():
    """test_models_mcore's CPU bridge (it empties megatron-core's aux-loss tracker)."""
    from test_models_mcore import _mcore_on_cpu as bridge

    return bridge()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def router_parity_worker(rank, world, *, name):
    """Our MoE layer 0 and megatron-core's, same weights (a random expert bias too), two
    training micro batches of this rank's own tokens, then the end of the global batch."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias, \
        reset_model_temporary_tensors
    from megatron.core.transformer.moe import moe_utils

    from megatron_fsdp.models.mcore import build_mcore_gpt, to_mcore_state_dict

    cfg = GPTConfig(**{**LAYER, **CASES[name]})
    device = mcore_device()
    torch.manual_seed(0)
    ours = GPT(cfg).to(device)
    mine = ours.blocks[0].mlp
    if mine.router.expert_bias is not None:  # a bias that changes the choice (sigmoid scores are within (0, 1))
        mine.router.expert_bias.copy_(0.05 * torch.randn(8, generator=torch.Generator().manual_seed(7)))
    gen = torch.Generator().manual_seed(100 + rank)
    inputs = [torch.randn(SEQ, 3, HIDDEN, generator=gen).to(device) for _ in range(2)]  # (s, b, h) per micro batch
    weights = [torch.randn(SEQ, 3, HIDDEN, generator=gen).to(device) for _ in range(2)]
    out = dict(routing=[], out=[], aux=[], grads=[])
    with _mcore_on_cpu():
        torch.manual_seed(0)
        theirs = build_mcore_gpt(cfg, allow_cpu=True).to(device)
        missing, unexpected = theirs.load_state_dict(to_mcore_state_dict(ours.state_dict(), cfg), strict=False)
        assert not unexpected and all(m.endswith("_extra_state") for m in missing), (missing, unexpected)
        megatron = theirs.decoder.layers[0].mlp
        moe_utils.MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0, device=device))
        moe_utils.clear_aux_losses_tracker()
        ours.train(), theirs.train()
        for x, w in zip(inputs, weights):
            # The routing itself (no grad: nothing counted, no loss, as in both routers).
            with torch.no_grad():
                tokens = x.transpose(0, 1).reshape(-1, HIDDEN)  # ours: batch-major rows
                probs, indices = mine.routing(mine.router(tokens))
                dense = torch.zeros(tokens.shape[0], 8, dtype=probs.dtype, device=device).scatter(1, indices, probs)
                their_probs, their_map = megatron.router(x)  # (s * b, E), sequence-major rows
                their_probs = their_probs.view(SEQ, 3, 8).transpose(0, 1).reshape(-1, 8)
                their_map = their_map.view(SEQ, 3, 8).transpose(0, 1).reshape(-1, 8)
            out["routing"].append((bool(torch.equal(dense != 0, their_map)), _max_diff(dense, their_probs)))
            # A training micro batch: outputs, balancing loss, gradients.
            x_ours, x_theirs = x.transpose(0, 1).clone().requires_grad_(), x.clone().requires_grad_()
            before = {k: v["values"].clone() for k, v in moe_utils.get_moe_layer_wise_logging_tracker().items()}
            out_ours, (out_theirs, _) = mine(x_ours).transpose(0, 1), megatron(x_theirs)
            out["out"].append(_max_diff(out_ours, out_theirs))
            (out_ours * w).sum().backward()
            (out_theirs * w).sum().backward()
            tracker = moe_utils.get_moe_layer_wise_logging_tracker()
            name_logged = cfg.moe_router_load_balancing_type.log_name
            if name_logged in tracker and mine.last_aux_loss is not None:
                theirs_aux = (tracker[name_logged]["values"] - before.get(name_logged, 0.0)).sum().item()
                out["aux"].append((mine.last_aux_loss.item() / cfg.moe_aux_loss_coeff, theirs_aux))
            our_grads = to_mcore_state_dict({f"blocks.0.mlp.{n}": p.grad for n, p in mine.named_parameters()}, cfg)
            pairs = [(x_ours.grad.transpose(0, 1), x_theirs.grad)]
            pairs += [(our_grads[f"decoder.layers.0.mlp.{n}"], p.grad) for n, p in megatron.named_parameters()]
            out["grads"].append(max(_max_diff(a, b) for a, b in pairs))
            out["router_grad"] = megatron.router.weight.grad.abs().sum().item()
        counts = None
        if mine.router.expert_bias is not None:
            counts = (mine.router.local_tokens_per_expert.tolist(), megatron.router.local_tokens_per_expert.tolist())
        finish_global_batch(ours)  # the data-parallel group is the default one here, as megatron-core's
        if megatron.router.expert_bias is not None:
            _update_router_expert_bias([theirs], theirs.config)
        reset_model_temporary_tensors(theirs.config, [theirs])
        if mine.router.expert_bias is not None:
            out["bias"] = (mine.router.expert_bias.tolist(), megatron.router.expert_bias.tolist())
            out["bias_in_state_dict"] = "decoder.layers.0.mlp.router.expert_bias" in theirs.state_dict() and \
                "blocks.0.mlp.router.expert_bias" in ours.state_dict()
        if mine.router.global_tokens_per_expert is not None:
            out["reset"] = (mine.router.ga_steps.item(), megatron.router.ga_steps.item(),
                            mine.router.global_tokens_per_expert.abs().sum().item())
    out["counts"] = counts
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_router_is_megatron_cores(pool2, name):
    pytest.importorskip("megatron.core")
    case = CASES[name]
    for result in pool2.run(router_parity_worker, name=name):
        for same_experts, prob_diff in result["routing"]:
            assert same_experts and prob_diff < 1e-6, result["routing"]
        assert max(result["out"]) < 1e-5 and max(result["grads"]) < 1e-6, result
        assert result["router_grad"] > 0
        if case.get("moe_aux_loss_coeff"):
            assert len(result["aux"]) == 2, result  # one balancing loss per micro batch, as megatron-core logs
            for ours, theirs in result["aux"]:
                assert abs(ours - theirs) < 1e-6 and ours > 0, result["aux"]
        else:
            assert result["aux"] == []
        if case.get("moe_router_enable_expert_bias"):
            ours_counts, their_counts = result["counts"]
            assert ours_counts == their_counts and sum(ours_counts) == 2 * 3 * SEQ * (case.get("moe_router_topk")
                                                                                        or 2)
            ours_bias, their_bias = result["bias"]
            assert ours_bias == their_bias, result["bias"]  # bit for bit
            assert result["bias_in_state_dict"]
        if case.get("moe_router_load_balancing_type") == "global_aux_loss":
            assert result["reset"] == (0.0, 0.0, 0.0)


# -- the pieces, in plain pytest ---------------------------------------------------------------
def test_group_limited_topk_keeps_each_token_within_its_best_groups():
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.6, 0.0, 0.8, 0.2, 0.3]])  # groups of 2: sums of best 1 = .9 .6 .8 .3
    values, indices = group_limited_topk(scores, topk=2, num_groups=4, group_topk=2)
    assert indices.tolist() == [[0, 5]] and values[0].tolist() == pytest.approx([0.9, 0.8])
    # One group per token: groups are scored by their best 2 (1.0, 1.1, 0.8, 0.5), so experts 2 and 3
    # (0.5, 0.6) win over the group holding the best single expert.
    _, one_group = group_limited_topk(scores, topk=2, num_groups=4, group_topk=1)
    assert one_group.tolist() == [[3, 2]]


def test_sinkhorn_balances_rows_and_columns():
    cost = torch.randn(64, 4, generator=torch.Generator().manual_seed(0)) * 3
    balanced = sinkhorn(cost)
    assert torch.allclose(balanced.sum(dim=0), torch.full((4,), 0.25), atol=1e-3)
    assert torch.allclose(balanced.sum(dim=1), torch.full((64,), 1 / 64), atol=1e-3)


def test_router_rules_are_megatron_cores():
    moe = dict(num_moe_experts=8, moe_router_topk=2)
    for bad, match in [
        (dict(moe_router_enable_expert_bias=True), "needs moe_router_score_function='sigmoid'"),
        (dict(moe_router_group_topk=2), "needs moe_router_num_groups"),
        (dict(moe_router_group_topk=2, moe_router_num_groups=3), "divisible by moe_router_num_groups=3"),
        (dict(moe_router_group_topk=4, moe_router_num_groups=4), "between 1 and min"),
        (dict(moe_router_group_topk=1, moe_router_num_groups=8, moe_router_topk=2), "fewer than"),
        (dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01), "takes no moe_aux_loss_coeff"),
        (dict(moe_router_topk=1), "needs moe_router_pre_softmax"),
        (dict(moe_router_score_function="tanh"), "'softmax', 'sigmoid'"),
    ]:
        with pytest.raises(ValueError, match=match):
            GPTConfig(**{**moe, **bad})
    cfg = GPTConfig(**moe, moe_router_score_function="sigmoid", moe_router_load_balancing_type="global_aux_loss")
    assert cfg.moe_router_score_function is ScoreFunction.SIGMOID
    assert cfg.moe_router_load_balancing_type.log_name == "global_load_balancing_loss"
    assert MoELoadBalancing.GLOBAL_AUX_LOSS.logged_as_rank_sum and not MoELoadBalancing.AUX_LOSS.logged_as_rank_sum
    GPTConfig(num_moe_experts=8, moe_router_topk=1, moe_router_score_function="sigmoid")  # sigmoid top-1 is fine


def test_expert_bias_stays_fp32_and_survives_recomputation():
    cfg = GPTConfig(**LAYER, **DEEPSEEK)
    torch.manual_seed(0)
    model = GPT(cfg).to(torch.bfloat16)
    router = model.blocks[0].mlp.router
    assert router.expert_bias.dtype == router.local_tokens_per_expert.dtype == torch.float32
    tokens = torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    counted = []
    for recompute in (None, "full"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**LAYER, **DEEPSEEK, recompute_granularity=recompute))
        gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()  # recomputed in backward: counted once
        with torch.no_grad():
            model(tokens[:, :-1])  # evaluation-style forward: not counted
        counted.append(model.blocks[0].mlp.router.local_tokens_per_expert.clone())
    assert counted[0].sum() == 2 * SEQ * 2 and torch.equal(counted[0], counted[1])


# -- across data-parallel ranks ------------------------------------------------------------------
def expert_bias_across_ranks_worker(rank, world):
    """3 iterations of 2 micro batches per rank (fixed weights: routing moves only through the
    bias) against one process on all 4 micro batches of the global batch."""
    import torch.distributed as dist

    cfg = GPTConfig(**{**LAYER, "num_layers": 2}, **DEEPSEEK, moe_router_num_groups=4, moe_router_group_topk=2,
                    moe_aux_loss_coeff=0.05, moe_router_load_balancing_type="global_aux_loss")
    singleton = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    torch.manual_seed(0)
    model = GPT(cfg)
    reference = copy.deepcopy(model)
    reference.set_moe_data_parallel_group(singleton[rank])
    batches = [torch.randint(0, 64, (2, SEQ + 1), generator=torch.Generator().manual_seed(it * 10 + m))
               for it in range(3) for m in range(2 * world)]  # the global batch: world ranks x 2 micro batches
    for it in range(3):
        glob = batches[it * 2 * world:(it + 1) * 2 * world]
        for tokens in glob[rank * 2:rank * 2 + 2]:
            gpt_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        finish_global_batch(model)
        for tokens in glob:
            gpt_loss(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
        finish_global_batch(reference, group=singleton[rank])
    biases = [block.mlp.router.expert_bias for block in model.blocks]
    gathered = [torch.zeros(2, 8) for _ in range(world)]
    dist.all_gather(gathered, torch.stack(biases))
    return dict(bias=torch.stack(biases).tolist(), reference=torch.stack(
        [block.mlp.router.expert_bias for block in reference.blocks]).tolist(),
        same_on_ranks=all(torch.equal(g, gathered[0]) for g in gathered))


def test_expert_bias_is_the_global_batchs_on_every_rank(pool2):
    for result in pool2.run(expert_bias_across_ranks_worker):
        assert result["same_on_ranks"]
        assert result["bias"] == result["reference"]  # exact: integer counts, sign steps
        assert any(v != 0 for row in result["bias"] for v in row)


# -- the launcher --------------------------------------------------------------------------------
LAUNCH = """
    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16
    --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope
    --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 3e-3 --log-interval 2 --eval-iters 0
    --plot-path none --hidden-dropout 0.0 --attention-dropout 0.0 --mock-data --tokenizer-type NullTokenizer
    --vocab-size 64 --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 24
"""
FSDP = " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor "
DEEPSEEK_FLAGS = ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                  "--moe-router-bias-update-rate 1e-2 --moe-router-topk-scaling-factor 2.5 "
                  "--moe-router-num-groups 4 --moe-router-group-topk 2")


def _parse(extra: str):
    return parse_args(shlex.split(LAUNCH + FSDP + extra), world_size=2)


def test_router_flags_reach_the_model_and_bad_combinations_fail_at_parse_time():
    from megatron_fsdp.training.model_setup import gpt_config_from_args

    cfg = gpt_config_from_args(_parse(DEEPSEEK_FLAGS + " --moe-router-load-balancing-type global_aux_loss "
                                      "--moe-aux-loss-coeff 1e-3"))
    assert cfg.moe_router_score_function is ScoreFunction.SIGMOID and cfg.moe_router_enable_expert_bias
    assert (cfg.moe_router_bias_update_rate, cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (1e-2, 4, 2)
    assert cfg.moe_router_load_balancing_type is MoELoadBalancing.GLOBAL_AUX_LOSS
    assert gpt_config_from_args(_parse("--moe-router-load-balancing-type sinkhorn")).moe_router_load_balancing_type \
        is MoELoadBalancing.SINKHORN
    for flags, match in [("--moe-router-enable-expert-bias", "--moe-router-score-function sigmoid"),
                         ("--moe-router-group-topk 2", "--moe-router-num-groups"),
                         ("--moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.01", "sinkhorn"),
                         ("--moe-router-topk 1", "--moe-router-pre-softmax"),
                         ("--moe-router-score-function sqrtsoftplus", "sqrtsoftplus")]:
        with pytest.raises(ArgumentError, match=match):
            _parse(flags)


def launcher_task(rank: int, world: int, *, flags: str) -> str:
    """The launcher's ``run`` on this pool rank; its log comes back."""
    return "\n".join(run_launcher(flags, world))


def _launch(pool, flags: str, tmp_path: Path, tag: str, extra: str = "") -> dict:
    """A 2-rank run of scripts/pretrain_gpt.py in the shared pool (no torchrun start-up)."""
    out = tmp_path / f"{tag}.json"
    stdout = pool.run(launcher_task, flags=" ".join([LAUNCH + FSDP + flags, "--log-json", str(out), "--save",
                                                    str(tmp_path / tag), "--save-interval", "4", extra]))[0]
    return dict(metrics=json.loads(out.read_text()), stdout=stdout)


def _saved_expert_bias(directory: Path) -> dict:
    """The expert biases of the iteration-4 checkpoint, read without a process group."""
    import torch.distributed.checkpoint as dcp

    from megatron_fsdp.training.checkpoint import dcp_checkpoint as checkpointing

    reader = dcp.FileSystemReader(checkpointing.checkpoint_dir(str(directory), 4))
    metadata = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(metadata[k].size) for k in metadata if k.endswith("expert_bias")}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def test_launcher_runs_deepseek_routing_and_global_aux_loss(pool2, tmp_path):
    """A DeepSeek-V3-style router (sigmoid, expert bias, group-limited, scaled) with the
    global aux loss trains; the loss is logged under megatron-core's name, summed over the
    ranks (about 1 for even routing, not 1/2); the expert bias is in the checkpoint, moved
    in steps of the update rate; and the flags change the run's numbers."""
    balancing = " --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2"
    deepseek = _launch(pool2, DEEPSEEK_FLAGS + balancing, tmp_path, "deepseek")
    plain = _launch(pool2, balancing, tmp_path, "softmax")
    assert "| global_load_balancing_loss: " in deepseek["stdout"]
    for run in (deepseek, plain):
        values = run["metrics"]["load_balancing_loss"]
        assert len(values) == 4 and all(0.9 < v < 3 for v in values), values
    assert deepseek["metrics"]["lm_loss"] != plain["metrics"]["lm_loss"]
    biases = _saved_expert_bias(tmp_path / "deepseek")
    assert len(biases) == 2, sorted(biases)  # one per MoE layer
    for bias in biases.values():
        steps = bias.float() / 1e-2  # 4 updates of +-1e-2 (or 0)
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 4 and steps.abs().sum() > 0
    # Stopped after iteration 2 and resumed from its checkpoint: the bias came back with the weights.
    _launch(pool2, DEEPSEEK_FLAGS + balancing, tmp_path, "first_half", "--exit-interval 2")
    resumed = _launch(pool2, DEEPSEEK_FLAGS + balancing, tmp_path, "resumed", f"--load {tmp_path / 'first_half'}")
    assert resumed["metrics"]["lm_loss"] == deepseek["metrics"]["lm_loss"][2:]
    for key, bias in _saved_expert_bias(tmp_path / "resumed").items():
        assert torch.equal(bias, biases[key]), key


def mcore_launcher_worker(rank, world, *, extra=""):
    """--use-mcore-models through the launcher's setup and train_step: megatron-core's routers
    get the same end-of-global-batch treatment (expert bias, global aux loss reset and its
    rank-summed log)."""
    import functools
    from unittest import mock

    import torch.distributed as dist

    from megatron_fsdp.comm import device as device_mod
    from megatron_fsdp.models import mcore as mcore_models
    from megatron_fsdp.training.data import BatchLayout, MockDataset
    from megatron_fsdp.training.optim.lr_schedule import LRSchedule
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer
    from megatron_fsdp.training.training_step import StepContext, TrainState, train_step

    flags = (LAUNCH + DEEPSEEK_FLAGS +
             " --moe-router-load-balancing-type global_aux_loss --moe-aux-loss-coeff 1e-2 --use-mcore-models"
             " --distributed-backend nccl " + extra)
    with mock.patch.object(device_mod, "cuda_available", lambda: True), \
            mock.patch.object(device_mod, "cuda_device_count", lambda: world):
        args = parse_args(shlex.split(flags), world_size=world)
    with _mcore_on_cpu(), mock.patch.object(mcore_models, "build_mcore_gpt",
                                            functools.partial(mcore_models.build_mcore_gpt, allow_cpu=True)):
        bundle = setup_model_and_optimizer(args, torch.device("cpu"))
        ctx = StepContext(bundle=bundle, schedule=LRSchedule.from_args(args), scaler=None, device=torch.device("cpu"),
                          layout=BatchLayout(micro_batch_size=2, num_microbatches=2, dp_rank=rank, dp_size=world),
                          clip_grad=1.0, per_token_loss=False, check_for_nan=True, seq_length=16)
        source, state = MockDataset(64, 16, seed=1), TrainState()
        logged = [train_step(ctx, state, source).load_balancing_loss for _ in range(3)]
    routers = [m for m in bundle.model.modules() if getattr(m, "expert_bias", None) is not None]
    bias = torch.stack([r.expert_bias for r in routers])
    gathered = [torch.zeros_like(bias) for _ in range(world)]
    dist.all_gather(gathered, bias)
    return dict(layers=len(routers), logged=logged, steps=(bias / 1e-2).tolist(),
                same_on_ranks=all(torch.equal(g, bias) for g in gathered),
                counts_reset=all(float(r.local_tokens_per_expert.abs().sum()) == 0 and float(r.ga_steps) == 0
                                 for r in routers))


def test_mcore_models_routers_are_finished_by_the_launcher(pool2):
    pytest.importorskip("megatron.core")
    for result in pool2.run(mcore_launcher_worker):
        assert result["layers"] == 2 and result["same_on_ranks"] and result["counts_reset"], result
        steps = torch.tensor(result["steps"])  # 3 updates of +-1e-2 (or 0) from zero
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 3 and steps.abs().sum() > 0
        assert all(0.9 < v < 3 for v in result["logged"]), result["logged"]  # summed over the 2 ranks
