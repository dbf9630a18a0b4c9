"""``--expert-model-parallel-size`` and ``--context-parallel-size`` in the launcher.

* Validation: the batch arithmetic uses the data-parallel size world / (TP x CP), and
  what the models or the launcher cannot run with EP / CP is refused by name before any
  process group (Megatron-LM's rules: experts divisible by EP, a MoE model for EP > 1,
  --seq-length a multiple of 2 x CP; megatron-core's capacity-factor rules).
* Runs on 4 gloo ranks (the script's ``run`` inside the shared pool), fp32, dropout 0,
  every iteration's lm loss, load-balancing loss, gradient norm and validation loss
  within 1e-5 of the run at size 1:
  - a Mixtral-style MoE (8 experts top-2, aux loss, SwiGLU, RMSNorm, RoPE, GQA) at EP 2,
    its logged params norm too;
  - a DeepSeek-V3-style MoE (a dense first layer, sigmoid router with expert bias,
    group-limited routing, a shared expert, seq_aux_loss) at EP 4;
  - a dense Llama-style model at CP 2 x DP 2, also with --calculate-per-token-loss
    (whose gradient is the same one: every micro batch has as many tokens).
* torch_dist checkpoints: saved at EP 2 and resumed at EP 1, at CP 2 resumed at CP 1 and
  the other way round: the resumed run continues with the uninterrupted run's numbers.
  EP 1 -> EP 2 is an expected failure until the engine's load accepts checkpoint keys of
  experts a rank does not hold.
* With ``MFSDP_EPCP_LONG=1``: MoE with context parallelism (CP 2, EP 2 x CP 2, per-token
  loss), the global aux loss and per-token loss at EP 2, EP 4 under ZeRO-1, HSDP,
  meta-device init, Megatron-core DDP on the engine, TP 2 x CP 2 with sequence
  parallelism, and token dropping (--moe-expert-capacity-factor) the same at EP 2 as at EP 1.
"""

from __future__ import annotations

import json
import os
import re
import shlex

import pytest

from launcher_inprocess import run_launcher
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args

TOL = 1e-5
COMMON = ("--seq-length 16 --max-position-embeddings 16 --micro-batch-size 1 --global-batch-size 8 "
          "--train-iters 4 --lr 3e-3 --adam-eps 1e-4 --seed 7 --lr-decay-style cosine --lr-warmup-iters 1 "
          "--clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 1 "
          "--eval-interval 2 --plot-path none --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
          "--make-vocab-size-divisible-by 16 --use-megatron-fsdp --data-parallel-sharding-strategy "
          "optim_grads_params ")
LLAMA = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 64 --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear ")
MIXTRAL = LLAMA + ("--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 1e-2 "
                   "--moe-router-load-balancing-type aux_loss ")
DEEPSEEK = LLAMA + ("--num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-layer-freq ([0]+[1]) "
                    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
                    "--moe-router-bias-update-rate 1e-2 --moe-router-num-groups 4 --moe-router-group-topk 2 "
                    "--moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 32 "
                    "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3 ")
LONG = pytest.mark.skipif(not os.environ.get("MFSDP_EPCP_LONG"),
                          reason="a longer launcher grid: MFSDP_EPCP_LONG=1 (the suite's time budget)")


def _parse(flags: str, world: int = 4, model: str = LLAMA):
    return parse_args(shlex.split(model + COMMON + flags), world_size=world)


# -- validation ------------------------------------------------------------------------------
def test_batches_are_counted_per_data_parallel_rank_of_tp_x_cp():
    args = _parse("--context-parallel-size 2 --global-batch-size 6")
    assert (args.world_size, args.data_parallel_size, args.num_microbatches) == (4, 2, 3)
    args = _parse("--expert-model-parallel-size 2", model=MIXTRAL)  # EP is carved out of the DP ranks
    assert (args.data_parallel_size, args.num_microbatches) == (4, 2)
    with pytest.raises(ArgumentError, match=r"not divisible by --micro-batch-size=1 x data-parallel size 2"):
        _parse("--context-parallel-size 2 --global-batch-size 5")


def test_dispatcher_flags_warn_and_expert_tensor_parallel_one_is_accepted():
    args = _parse("--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                  "--expert-tensor-parallel-size 1", model=MIXTRAL)
    assert args.expert_model_parallel_size == 2
    assert any(w.startswith("--moe-token-dispatcher-type alltoall: accepted, no effect here") and "dropless" in w
               for w in args.flag_warnings)


CP2, EP2 = "--context-parallel-size 2 ", "--expert-model-parallel-size 2 "


@pytest.mark.parametrize("flags, model, world, words", [
    (CP2 + "--seq-length 18 --max-position-embeddings 18 ", LLAMA, 4, "must be a multiple of 2 x CP = 4"),
    ("--context-parallel-size 3 --seq-length 18 --max-position-embeddings 18 ", LLAMA, 4,
     "does not divide the world size 4"),
    ("--context-parallel-size 0 ", LLAMA, 4, "must be a positive integer"),
    (CP2 + "--attention-dropout 0.1 ", LLAMA, 4, "attention_dropout=0.1"),
    (CP2 + "--mtp-num-layers 1 ", LLAMA, 4, "multi-token prediction"),
    (CP2 + "--tensor-model-parallel-size 4 --sequence-parallel --seq-length 20 --max-position-embeddings 20 ", LLAMA,
     8, "--seq-length / CP must be a multiple of TP"),
    (CP2.replace("--", "--use-torch-fsdp2 --no-gradient-accumulation-fusion --", 1), LLAMA, 4,
     "does not lay out the context-parallel mesh"),
    (EP2, LLAMA, 4, "needs a mixture-of-experts model"),
    ("--expert-model-parallel-size 3 ", MIXTRAL, 3, "does not divide --num-experts 8"),
    ("--expert-model-parallel-size 8 ", MIXTRAL, 4, "does not divide the data x context-parallel size 4"),
    (EP2 + "--moe-layer-freq ([0]+[0]) ", MIXTRAL, 4, "makes no layer a mixture of experts"),
    (EP2 + "--tensor-model-parallel-size 2 ", MIXTRAL, 4, "not supported together with tensor parallelism"),
    (EP2 + "--expert-tensor-parallel-size 2 ", MIXTRAL, 4, "--expert-tensor-parallel-size 2 is not supported"),
    (EP2 + "--use-mcore-models ", MIXTRAL, 4, "the embedded GPT's here"),
    (EP2.replace("--", "--ckpt-format torch --", 1), MIXTRAL, 4, "holds only its own block of experts"),
    (EP2 + "--data-parallel-sharding-strategy optim --check-weight-hash-across-dp-replicas-interval 2 ", MIXTRAL, 4,
     "EP ranks hold different experts"),
], ids=lambda value: value if isinstance(value, str) and len(value) < 60 and not value.startswith("--num-") else "")
def test_unsupported_combinations_are_refused_by_name(flags, model, world, words):
    with pytest.raises(ArgumentError) as info:
        _parse(flags, world, model)
    assert words in str(info.value)


def test_capacity_flags_follow_megatron_core_rules():
    with pytest.raises(ArgumentError, match="--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"):
        _parse("--moe-pad-expert-input-to-capacity", model=MIXTRAL)
    with pytest.raises(ArgumentError, match="sinkhorn: megatron-core drops tokens only"):
        _parse("--moe-expert-capacity-factor 1.0 --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0",
               model=MIXTRAL)
    args = _parse("--moe-token-drop-policy position", model=MIXTRAL)  # dropless: the policy changes nothing
    assert any("--moe-token-drop-policy position: no effect without" in w for w in args.flag_warnings)
    assert _parse("--moe-expert-capacity-factor -1", model=MIXTRAL).moe_expert_capacity_factor == -1  # dropless


def test_pytorch_ddp_is_refused_with_expert_parallelism():
    with pytest.raises(ArgumentError, match="would average different experts across ranks"):
        parse_args(shlex.split(MIXTRAL + COMMON.replace("--use-megatron-fsdp", "") + EP2), world_size=4)


# -- runs ------------------------------------------------------------------------------------
def run_task(rank: int, world: int, *, flags: str) -> tuple[list[str], list[float]]:
    """The launcher's layout line(s), and the logged params norms (--log-params-norm)."""
    lines = run_launcher(flags, world)
    norms = [float(m.group(1)) for m in map(_PARAMS_NORM.search, lines) if m]
    return [line for line in lines if "parallel layout" in line], norms


_PARAMS_NORM = re.compile(r"params norm: ([0-9.]+)")


def _run(pool, tmp_path, name: str, flags: str, layout: bool) -> dict:
    path = tmp_path / f"{name}.json"
    lines, norms = pool.run(run_task, flags=flags + f"--log-json {path} ")[0]
    assert bool(lines) == layout, (name, lines)  # the layout line names the plan applied
    return dict(json.loads(path.read_text()), params_norm=norms)


def _assert_same(got: dict, reference: dict, name: str, keys=("lm_loss", "grad_norm", "load_balancing_loss")) -> None:
    for key in keys:
        assert len(got[key]) == len(reference[key]), (name, key)
        assert got[key] == pytest.approx(reference[key], rel=TOL, abs=TOL), (name, key, got[key], reference[key])
    assert [v for _, v in got["validation"]] == pytest.approx([v for _, v in reference["validation"]],
                                                               rel=TOL, abs=TOL), name


def _resume_flags(saved, step: int = 2) -> str:
    return f"--load {saved} --ckpt-step {step} "


RESUMES = (("one_from_parallel", "parallel"), ("parallel_from_one", "one"))
"""(resumed run, the run whose checkpoint it loads)."""


def _parity_and_resume(pool, tmp_path, model: str, parallel: str, resumes=RESUMES) -> None:
    """Size 1 and ``parallel`` runs (each saving at iteration 2) are equal, and each of
    ``resumes`` continues from the other's checkpoint with the uninterrupted iterations 3, 4."""
    base = model + COMMON + "--ckpt-format torch_dist --save-interval 2 "
    full = {name: _run(pool, tmp_path, name, base + flags + f"--save {tmp_path / name} ", layout=bool(flags))
            for name, flags in (("one", ""), ("parallel", parallel)) if name in {"one"} | {s for _, s in resumes}}
    assert full["one"]["iterations"] == [1, 2, 3, 4] and full["one"]["lm_loss"][-1] < full["one"]["lm_loss"][0]
    if "parallel" in full:
        _assert_same(full["parallel"], full["one"], "parallel")
        assert full["parallel"]["params_norm"] == full["one"]["params_norm"]
        assert len(full["one"]["params_norm"]) == (4 if "--log-params-norm" in model else 0)
    for name, source in resumes:
        flags = parallel if name.startswith("parallel") else ""
        resumed = _run(pool, tmp_path, name, base + flags + "--eval-iters 0 " + _resume_flags(tmp_path / source),
                       layout=bool(flags))
        assert resumed["iterations"] == [3, 4], name
        for key in ("lm_loss", "grad_norm", "load_balancing_loss"):
            assert resumed[key] == pytest.approx(full[source][key][2:], rel=TOL, abs=TOL), (name, key)
        assert abs(resumed["lm_loss"][0] - full["one"]["lm_loss"][0]) > 1e-3  # it continued from saved weights


def test_mixtral_ep2_equals_ep1_and_resumes_at_ep1(pool4, tmp_path):
    """Also the weights' norm (--log-params-norm, logged to 3 decimals): each EP rank's experts
    are added up over the EP group, not counted once per rank (nor left out)."""
    _parity_and_resume(pool4, tmp_path, MIXTRAL + "--log-params-norm ", EP2, resumes=RESUMES[:1])


def test_ep1_checkpoint_resumes_at_ep2(pool4, tmp_path):
    _parity_and_resume(pool4, tmp_path, MIXTRAL, EP2, resumes=RESUMES[1:])


def test_llama_cp2_equals_cp1_and_resumes_across_cp_sizes(pool4, tmp_path):
    _parity_and_resume(pool4, tmp_path, LLAMA, CP2)


def test_deepseek_ep4_equals_ep1(pool4, tmp_path):
    one = _run(pool4, tmp_path, "one", DEEPSEEK + COMMON, layout=False)
    got = _run(pool4, tmp_path, "ep4", DEEPSEEK + COMMON + "--expert-model-parallel-size 4 ", layout=True)
    assert len(one["load_balancing_loss"]) == 4  # the seq aux loss is logged
    _assert_same(got, one, "ep4")


def test_llama_cp2_per_token_loss_equals_cp1(pool4, tmp_path):
    """Every micro batch holds as many tokens, so per-token mode trains the same gradients;
    a token count summed over the data-parallel ranks only (not x CP) would double them."""
    one = _run(pool4, tmp_path, "one", LLAMA + COMMON, layout=False)
    got = _run(pool4, tmp_path, "cp2", LLAMA + COMMON + CP2 + "--calculate-per-token-loss ", layout=True)
    _assert_same(got, one, "cp2_per_token", keys=("lm_loss", "grad_norm"))


# -- the long grid ---------------------------------------------------------------------------
LONG_RUNS = {
    "mixtral_cp2": (MIXTRAL, CP2),
    "mixtral_ep2_cp2": (MIXTRAL, EP2 + CP2),
    "mixtral_ep2_global_aux": (MIXTRAL.replace("aux_loss ", "global_aux_loss "), EP2),
    "mixtral_ep2_per_token": (MIXTRAL + "--calculate-per-token-loss ", EP2),
    "mixtral_cp2_per_token": (MIXTRAL + "--calculate-per-token-loss ", CP2),
    "mixtral_ep4_optim": (MIXTRAL + "--data-parallel-sharding-strategy optim ", "--expert-model-parallel-size 4 "),
    "deepseek_ep2_cp2_no_shard": (DEEPSEEK + "--data-parallel-sharding-strategy no_shard ", EP2 + CP2),
    "mixtral_ep2_hsdp": (MIXTRAL + "--num-distributed-optimizer-instances 2 ", EP2),
    "mixtral_ep2_meta": (MIXTRAL + "--init-model-with-meta-device ", EP2),
    "deepseek_ep2_capacity_probs": (DEEPSEEK + "--moe-expert-capacity-factor 1.0 ", EP2),
    "llama_cp2_meta": (LLAMA + "--init-model-with-meta-device ", CP2),
    "mixtral_ep2_mcore_ddp": (MIXTRAL + "--use-distributed-optimizer ", EP2),
    "llama_cp2_mcore_ddp": (LLAMA + "--use-distributed-optimizer ", CP2),
    "llama_cp2_hsdp": (LLAMA + "--num-distributed-optimizer-instances 2 ", CP2),
    "llama_tp2_cp2_sp": (LLAMA, CP2 + "--tensor-model-parallel-size 2 --sequence-parallel "),
}


@LONG
@pytest.mark.parametrize("name", sorted(LONG_RUNS))
def test_long_grid_equals_size_one(pool4, tmp_path, name):
    model, parallel = LONG_RUNS[name]
    flags = model + COMMON
    if "--use-distributed-optimizer" in model:
        flags = flags.replace("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params ", "")
    one = _run(pool4, tmp_path, "one", flags, layout=False)
    got = _run(pool4, tmp_path, name, flags + parallel, layout=True)
    _assert_same(got, one, name)


@LONG
def test_capacity_drops_tokens_the_same_at_ep2(pool4, tmp_path):
    capacity = ("--moe-expert-capacity-factor 1.0 --moe-token-drop-policy position "
                "--moe-pad-expert-input-to-capacity ")
    dropless = _run(pool4, tmp_path, "dropless", MIXTRAL + COMMON, layout=False)
    one = _run(pool4, tmp_path, "one", MIXTRAL + COMMON + capacity, layout=False)
    got = _run(pool4, tmp_path, "ep2", MIXTRAL + COMMON + capacity + EP2, layout=True)
    # tokens were dropped: the losses part from the dropless run's by far more than the tolerance
    assert max(abs(a - b) for a, b in zip(one["lm_loss"], dropless["lm_loss"])) > 10 * TOL, (one, dropless)
    _assert_same(got, one, "ep2_capacity")
