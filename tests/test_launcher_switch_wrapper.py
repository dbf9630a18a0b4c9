"""Resuming across wrappers: a checkpoint saved by a PyTorch DDP run resumes under
Megatron-FSDP and the other way round (checkpoint.py ``_wrapper_renames``).

Megatron-FSDP's state dict keys its entries ``module.<name>`` (upstream's
convention), DDP's checkpoint holds the model's own names; the load used to stop at
"missing keys ... Build the same architecture". Both directions now continue as the
uninterrupted run did: losses and gradient norms within 1e-5 at every resumed
iteration (DDP and ZeRO-3 differ only in reduction order). The runs call the
script's ``run`` inside the shared gloo pool.
"""

from __future__ import annotations

import json

import pytest

from launcher_inprocess import run_launcher

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --seed 7 "
        "--lr-decay-style cosine --lr-warmup-iters 1 --clip-grad 1.0 "
        "--log-interval 1 --eval-iters 0 --plot-path none ")
FSDP = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "


def run_task(rank: int, world: int, *, flags: str) -> None:
    run_launcher(BASE + flags, world)


@pytest.mark.parametrize("first, second", [("", FSDP), (FSDP, "")], ids=["ddp_to_fsdp", "fsdp_to_ddp"])
def test_resume_under_the_other_wrapper(pool2, tmp_path, first, second):
    saved = tmp_path / "saved"
    pool2.run(run_task, flags=first + f"--save {saved} --save-interval 2 --log-json {tmp_path / 'full.json'}")
    pool2.run(run_task, flags=second + f"--load {saved} --ckpt-step 2 --log-json {tmp_path / 'resumed.json'}")
    full, resumed = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("full", "resumed"))
    assert resumed["iterations"] == [3, 4]
    for key in ("lm_loss", "grad_norm"):
        assert resumed[key] == pytest.approx(full[key][2:], rel=0, abs=1e-5), key
    # The resumed run did continue from the saved weights, not from a fresh init.
    assert abs(resumed["lm_loss"][0] - full["lm_loss"][0]) > 1e-3
