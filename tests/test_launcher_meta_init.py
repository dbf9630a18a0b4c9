"""``--init-model-with-meta-device`` on the PyTorch DDP path (model_setup._materialize).

``nn.Module.to_empty`` gives every module slot a new Parameter: the output layer tied
to the embedding came back as a second matrix (29 parameters instead of 28, trained
untied), and ``is_embedding_or_output_parameter`` (--decoupled-lr's groups) was
dropped. The materialised model must be the eager build: the same parameters, tied
the same way, with their attributes, bit for bit the same values.
"""

from __future__ import annotations

import shlex

import torch

from megatron_fsdp.training.args.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 2 --train-iters 1 --lr 1e-3 --decoupled-lr 2e-3 --seed 3 "
        "--mock-data --vocab-size 64 --tokenizer-type NullTokenizer ")


def _built(world: int, extra: str):
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer

    torch.manual_seed(3)
    bundle = setup_model_and_optimizer(parse_args(shlex.split(BASE + extra), world_size=world), torch.device("cpu"))
    return bundle.model.module, bundle.optimizer


def meta_ddp_worker(rank: int, world: int, *, extra: str) -> dict:
    eager, eager_opt = _built(world, extra)
    meta, meta_opt = _built(world, extra + " --init-model-with-meta-device")
    eager_state, meta_state = eager.state_dict(), meta.state_dict()
    return {
        "params": (len(list(eager.parameters())), len(list(meta.parameters()))),
        "tied": (eager.lm_head.weight is eager.wte.weight, meta.lm_head.weight is meta.wte.weight),
        "marked": getattr(meta.wte.weight, "is_embedding_or_output_parameter", False),
        "lrs": ([g["lr"] for g in eager_opt.param_groups], [g["lr"] for g in meta_opt.param_groups]),
        "diff": max((eager_state[k] - meta_state[k]).abs().max().item() for k in eager_state),
    }


def test_meta_device_init_on_the_ddp_path_is_the_eager_build(pool2):
    for result in pool2.run(meta_ddp_worker, extra=""):
        assert result["params"] == (28, 28) and result["tied"] == (True, True), result
        assert result["marked"] and result["lrs"][0] == result["lrs"][1], result
        assert result["diff"] == 0.0, result
