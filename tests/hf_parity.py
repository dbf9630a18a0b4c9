"""Workers for tests/test_transformers_models.py: tiny ``transformers`` causal LMs
(tests/hf_models.py) trained through ``megatron_fsdp.fully_shard_model`` and through
``megatron_fsdp.experimental.fully_shard`` on the pool's ranks, against one process training
the same model on the whole global batch, each with the model's own loss
(``model(input_ids=..., labels=...).loss``).

[Note: the reference's loss rule] transformers' causal-LM loss is the mean over the label
tokens of one forward. Every microbatch here has the same shape and no ignored labels
(``ROWS`` rows of ``SEQ`` tokens, ``ROWS * (SEQ - 1)`` label tokens), each rank backpropagates
its microbatches' losses divided by ``MICROBATCHES`` and the engine averages over the ranks:
the step's gradient is that of the mean of the ``world * MICROBATCHES`` microbatch losses.
With equal token counts that mean is the one-forward loss of the whole global batch, which is
the reference (``per_microbatch=False``). Mixtral's router load-balancing loss
(``output_router_logits=True``) is a product of per-forward token means, not a token mean,
so no split of the batch has the global batch's value: its reference runs the same
``world * MICROBATCHES`` forwards and averages their losses (``per_microbatch=True``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from typing import Optional

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

import megatron_fsdp as mf
from megatron_fsdp.experimental import Placements, full_state_dict, fully_shard, fully_shard_context, \
    fully_shard_optimizer, microbatch
from megatron_fsdp.interop.hf_modules import hf_decoder_layer_classes, hf_decoder_layers
from hf_models import tiny_hf_model
from models import make_optimizer, max_param_diff

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
APIS = ("fully_shard_model", "experimental")
STEPS, MICROBATCHES, ROWS, SEQ = 3, 2, 2, 12


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One tiny model the tests wrap."""

    family: str
    """tests/hf_models.py's family name."""
    overrides: dict = dataclasses.field(default_factory=dict)
    """``tiny_hf_model`` keywords: ``tied``, or the family config's own fields."""
    per_microbatch: bool = False
    """The reference averages per-microbatch losses; see [Note: the reference's loss rule]."""
    attention: str = "eager"
    """transformers' attention implementation (``sdpa``: its default outside these tests)."""
    recompute: bool = False
    """transformers' own activation checkpointing of each decoder layer (non-reentrant)."""


CASES = {
    "llama": Case(family="llama"),
    "llama_tied": Case(family="llama", overrides={"tied": True}),
    "llama_sdpa_recompute": Case(family="llama", attention="sdpa", recompute=True),
    "qwen2": Case(family="qwen2"),
    "mixtral": Case(family="mixtral"),
    # The router's load-balancing loss on, with a coefficient large enough that a wrong
    # reduction of it shows.
    "mixtral_aux": Case(family="mixtral", overrides={"output_router_logits": True, "router_aux_loss_coef": 0.05},
                        per_microbatch=True),
    "gpt2": Case(family="gpt2"),
}


def build(case: str) -> torch.nn.Module:
    spec = CASES[case]
    model = tiny_hf_model(spec.family, seed=0, **spec.overrides)
    if spec.attention != "eager":
        model.set_attn_implementation(spec.attention)
    if spec.recompute:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model.train()  # dropout is 0: train() changes no number; recomputation needs it


def global_batches(world: int, vocab: int) -> list[torch.Tensor]:
    """One (world * MICROBATCHES * ROWS, SEQ) token batch per step, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (world * MICROBATCHES * ROWS, SEQ), generator=g) for _ in range(STEPS)]


def own_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's own causal-LM loss (labels shifted inside the model), plus Mixtral's router
    loss when its config turns it on."""
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


def train_reference(model, batches, optimizer: str, world: int, per_microbatch: bool):
    """One process, the whole global batch per step; see [Note: the reference's loss rule]."""
    model = copy.deepcopy(model)
    opt = make_optimizer(optimizer)(model.parameters())
    for tokens in batches:
        opt.zero_grad()
        if per_microbatch:
            pieces = tokens.chunk(world * MICROBATCHES)  # the ranks' microbatches, in rank order
            loss = sum(own_loss(model, piece) for piece in pieces) / len(pieces)
        else:
            loss = own_loss(model, tokens)
        loss.backward()
        opt.step()
    return model


def _rank_microbatches(tokens: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, ...]:
    return tokens.chunk(world)[rank].chunk(MICROBATCHES)  # MICROBATCHES x (ROWS, SEQ)


def train_fully_shard_model(model, strategy: str, optimizer: str, batches, rank: int, world: int):
    """``fully_shard_model`` with the decoder layers as units; all but the last microbatch
    under ``no_sync()``."""
    fsdp = mf.fully_shard_model(model, fsdp_unit_modules=hf_decoder_layer_classes(model), zero_dp_strategy=strategy)
    opt = mf.fully_shard_optimizer(make_optimizer(optimizer)(fsdp.parameters()))
    for tokens in batches:
        opt.zero_grad()
        pieces = _rank_microbatches(tokens, rank, world)
        for i, piece in enumerate(pieces):
            with fsdp.no_sync() if i < len(pieces) - 1 else contextlib.nullcontext():
                (own_loss(fsdp, piece) / len(pieces)).backward()
        opt.step()
    fsdp.finish_param_sync()
    return fsdp, mf.get_full_state_dict(fsdp)


def placements(strategy: str) -> Placements:
    """The experimental API's placements of each ZeRO strategy over one data-parallel axis."""
    parameter = [Shard(0)] if strategy == "optim_grads_params" else [Replicate()]
    gradient = [Shard(0)] if strategy in ("optim_grads", "optim_grads_params") else [Partial("avg")]
    optimizer = [Replicate()] if strategy == "no_shard" else [Shard(0)]
    return Placements(dp_axes=[0], parameter=parameter, gradient=gradient, optimizer=optimizer)


def train_experimental(model, strategy: str, optimizer: str, batches, rank: int, world: int):
    """``experimental.fully_shard`` per decoder layer, then the root (FSDP2's habit)."""
    mesh, where = init_device_mesh("cpu", (world,)), placements(strategy)
    with fully_shard_context() as context:
        for layer in hf_decoder_layers(model):
            fully_shard(layer, mesh=mesh, placements=where)
        fully_shard(model, mesh=mesh, placements=where)
    opt = make_optimizer(optimizer)(model.parameters())
    fully_shard_optimizer(opt)
    for tokens in batches:
        opt.zero_grad()
        pieces = _rank_microbatches(tokens, rank, world)
        for i, piece in enumerate(pieces):
            with microbatch(context, is_last=i == len(pieces) - 1):
                (own_loss(model, piece) / len(pieces)).backward()
        opt.step()
    return model, full_state_dict(model)


TRAINERS = {"fully_shard_model": train_fully_shard_model, "experimental": train_experimental}


def every_run(apis=APIS, strategies=STRATEGIES) -> list[tuple[str, str]]:
    """(api, strategy) for each API and strategy."""
    return [(api, strategy) for api in apis for strategy in strategies]


def parity_worker(rank, world, *, case: str, runs, optimizers=("adamw",)) -> dict:
    """Max parameter difference to the reference per ``api/strategy/optimizer`` for each
    (api, strategy) of ``runs``, each run from the same initial weights."""
    initial = build(case)
    batches = global_batches(world, initial.config.vocab_size)
    diffs = {}
    for optimizer in optimizers:
        reference = train_reference(initial, batches, optimizer, world, per_microbatch=CASES[case].per_microbatch)
        for api, strategy in runs:
            _, full = TRAINERS[api](copy.deepcopy(initial), strategy, optimizer, batches, rank, world)
            diffs[f"{api}/{strategy}/{optimizer}"] = max_param_diff(full, reference)
    return diffs


def control_worker(rank, world, *, case: str, optimizer: str = "adamw") -> dict:
    """How far from the reference the near misses land, to show the 1e-5 bar separates them:
    ``local_only``: one process trained on this rank's microbatches alone (a wrapper that never
    reduced gradients); ``global_loss``: the one-forward global-batch loss in place of the mean
    of the microbatch losses (equal for a token-mean loss, not for Mixtral's router loss)."""
    initial = build(case)
    batches = global_batches(world, initial.config.vocab_size)
    per_microbatch = CASES[case].per_microbatch
    reference = train_reference(initial, batches, optimizer, world, per_microbatch=per_microbatch)
    local = train_reference(initial, [tokens.chunk(world)[rank] for tokens in batches], optimizer, 1,
                            per_microbatch=per_microbatch)
    other_rule = train_reference(initial, batches, optimizer, world, per_microbatch=not per_microbatch)
    return {"local_only": max_param_diff(dict(local.named_parameters()), reference),
            "global_loss": max_param_diff(dict(other_rule.named_parameters()), reference)}


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens, use_cache=False).logits  # (b, t, vocab)


def export_worker(rank, world, *, case: str, api: str, out_dir: str, strategy: str = "optim_grads_params",
                  optimizer: str = "adamw", probe_seed: Optional[int] = 11) -> dict:
    """Train (world ranks), write a Hugging Face directory with ``save_hf_checkpoint``, reload
    it with ``from_pretrained`` on every rank: the reloaded logits against the trained
    (still sharded) model's, and the reloaded weights against the gathered ones."""
    from megatron_fsdp.interop.hf_checkpoint import save_hf_checkpoint

    initial = build(case)
    batches = global_batches(world, initial.config.vocab_size)
    trained, full = TRAINERS[api](copy.deepcopy(initial), strategy, optimizer, batches, rank, world)
    probe = torch.randint(0, initial.config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(probe_seed))
    trained.eval()
    expected = _logits(trained, probe)
    files = save_hf_checkpoint(trained, out_dir)
    reloaded = type(initial).from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    moved = max((p - initial.state_dict()[n]).abs().max().item() for n, p in full.items() if n in initial.state_dict())
    return {
        "logit_diff": (_logits(reloaded, probe) - expected).abs().max().item(),
        "param_diff": max_param_diff(full, reloaded),
        "trained_moved": moved,  # > 0: the export is of trained weights, not the initial ones
        "tied": reloaded.lm_head.weight is reloaded.get_input_embeddings().weight,
        "files": len(files),
        "architectures": _written_architectures(out_dir),
    }


def _written_architectures(out_dir: str) -> list:
    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as handle:
        return json.load(handle).get("architectures")
