"""megatron-core ``torch_dist`` checkpoints in and out (megatron_fsdp.interop.torch_dist).

* What ``save_torch_dist`` writes from a model sharded at world 2 (ZeRO-3) is read by
  megatron-core's own ``dist_checkpointing.load`` into megatron-core's GPTModel's
  ``sharded_state_dict()``: its tensors equal ``to_mcore_state_dict`` of our weights and
  both models compute the same logits. The reverse: megatron-core's model saved by
  ``dist_checkpointing.save`` loads here (sharded at world 2) with equal logits.
* Resharding with Adam: saved at world 2 (ZeRO-3) after two steps, loaded at world 1 (plain
  model, plain AdamW) and at world 2 under ZeRO-2; two more steps equal four uninterrupted.
* Errors: another architecture, a missing tensor, a shape mismatch, optimizer state that is
  not there, a bad spec, a non-empty directory, each before any weight changes.

megatron-core's GPT forward runs under tests/mcore_cpu_shim.py (tests only). Dense GPT-2 and
Llama (GQA) and an MoE config are covered; MTP/MLA are refused by the library.
"""

from __future__ import annotations

import copy
import os

import pytest

pytest.importorskip("megatron.core")

import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import megatron_fsdp as mf  # noqa: E402
from conftest import get_pool  # noqa: E402
from mcore_parity import LLAMA, SEQ, SMALL, VOCAB  # noqa: E402
from megatron.core.safe_globals import register_safe_globals  # noqa: E402
from megatron_fsdp.interop.torch_dist import (  # noqa: E402
    TorchDistMismatchError, is_torch_dist_checkpoint, load_torch_dist, save_torch_dist,
)
from megatron_fsdp.models import GPT, GPTConfig, TransformerBlock, gpt_loss  # noqa: E402
from models import make_optimizer  # noqa: E402

CONFIGS = {
    "gpt2": dict(),
    "llama_gqa": dict(LLAMA),
    "moe": dict(LLAMA, num_moe_experts=4, moe_router_topk=2),
}
LONG = pytest.mark.skipif(not os.environ.get("MFSDP_INTEROP_LONG"), reason="set MFSDP_INTEROP_LONG=1 for the grid")


def _cfg(name: str, **changes) -> GPTConfig:
    return GPTConfig(**{**SMALL, **CONFIGS[name], **changes})


def _tokens(batch: int = 2, seed: int = 1):
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _wrap(model: GPT, cfg: GPTConfig, strategy: str, world: int):
    options = dict(fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy)
    if cfg.num_moe_experts:
        options["expt_device_mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    return mf.fully_shard(model, make_optimizer("adamw"), **options)


def _mcore(cfg: GPTConfig, seed: int):
    """megatron-core's GPTModel for ``cfg`` (local spec), built under the CPU shim."""
    from megatron_fsdp.models.mcore import build_mcore_gpt

    torch.manual_seed(seed)
    return build_mcore_gpt(cfg, allow_cpu=True).eval()


def _mcore_logits(theirs, inputs):
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(inputs)
    with torch.no_grad():
        return theirs(inputs, positions, None)


def _our_logits(cfg: GPTConfig, full_state: dict, inputs):
    ours = GPT(cfg).eval()
    ours.load_state_dict(full_state)
    with torch.no_grad():
        return ours(inputs)


# -- the key map and the pieces (pure) ----------------------------------------------------------
def test_key_map_follows_megatron_cores_specs():
    from megatron_fsdp.interop.torch_dist_keys import mcore_target, our_name

    moe, dense = _cfg("moe"), _cfg("llama_gqa")
    assert our_name("module._orig_mod.blocks.1.ln_2.weight") == "blocks.1.ln_2.weight"
    qkv = mcore_target("blocks.1.attn.qkv.weight", dense, "te")
    assert (qkv.key, qkv.index, qkv.counts, qkv.grouped_qkv) == (
        "decoder.layers.self_attention.linear_qkv.weight", (1,), (2,), True)
    fused_input_norm = "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    assert mcore_target("blocks.0.ln_1.weight", dense, "te").key == fused_input_norm
    assert mcore_target("blocks.0.ln_2.weight", dense, "te").key == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    # An MoE layer: TransformerEngine's spec keeps its pre-MLP norm; the local spec fuses the name.
    assert mcore_target("blocks.0.ln_2.weight", moe, "te").key == "decoder.layers.pre_mlp_layernorm.weight"
    assert mcore_target("blocks.0.ln_2.weight", moe, "local").key == "decoder.layers.mlp.linear_fc1.layer_norm_weight"
    expert = mcore_target("blocks.1.mlp.experts.3.fc.weight", moe, "te")
    assert (expert.key, expert.index, expert.counts) == ("decoder.layers.mlp.experts.experts.linear_fc1.weight",
                                                         (1, 3), (2, 4))
    assert mcore_target("lm_head.weight", _cfg("gpt2"), "te") is None  # tied: the embedding is stored once
    assert mcore_target("lm_head.weight", dense, "te").key == "output_layer.weight"


def test_megatron_cores_expert_parallel_moe_is_refused():
    from megatron_fsdp.interop.torch_dist_keys import check_mcore_experts

    names = [f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight" for i in range(2) for j in range(2)]
    with pytest.raises(ValueError, match=r"hold \[2\] of 4 experts on this rank"):
        check_mcore_experts(names, _cfg("moe"))
    check_mcore_experts(names + [n.replace("experts.0.", "experts.2.").replace("experts.1.", "experts.3.")
                                 for n in names], _cfg("moe"))  # all four: fine


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_qkv_pieces_cover_megatron_cores_rows_once(world):
    from megatron_fsdp.interop.torch_dist_keys import mcore_target
    from megatron_fsdp.interop.torch_dist_shards import LocalBlock, piece_values, row_pieces
    from megatron_fsdp.models.mcore import _grouped_qkv

    cfg = _cfg("llama_gqa")
    target = mcore_target("blocks.0.attn.qkv.weight", cfg, "te")
    full = torch.randn(64, 32)
    assembled, seen = torch.full_like(full, float("nan")), torch.zeros(64, dtype=torch.int64)
    for rank in range(world):
        rows = full.tensor_split(world)[rank]  # uneven blocks for world 3 and 5
        start = sum(len(r) for r in full.tensor_split(world)[:rank])
        block = LocalBlock(rows, (start, 0), (64, 32), True)
        for piece in row_pieces(target, block, cfg):
            values = piece_values(rows, piece)
            assembled[piece.first_row:piece.first_row + len(values)] = values
            seen[piece.first_row:piece.first_row + len(values)] += 1
    assert torch.equal(seen, torch.ones_like(seen))
    assert torch.equal(assembled, _grouped_qkv(full, cfg))


# -- ours -> megatron-core --------------------------------------------------------------------
def megatron_core_reads_worker(rank, world, *, name, directory):
    from megatron.core import dist_checkpointing

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.models.mcore import to_mcore_state_dict

    cfg = _cfg(name)
    torch.manual_seed(0)
    model, _ = _wrap(GPT(cfg), cfg, "optim_grads_params", world)
    full = mf.get_full_state_dict(model)
    save_torch_dist(model, directory, config=cfg, spec="local", common_state={"iteration": 3})
    inputs, _ = _tokens()
    register_safe_globals()  # torch_dist_io.py [Note: common.pt's classes]: what Megatron-LM's start-up does
    with cpu_shim():
        theirs = _mcore(cfg, seed=7)
        loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, directory)
        missing, unexpected = theirs.load_state_dict(loaded["model"], strict=False)
        logits = _mcore_logits(theirs, inputs)
    want = to_mcore_state_dict(full, cfg)
    got = theirs.state_dict()
    return dict(tensor_diff=max((got[k] - v).abs().max().item() for k, v in want.items()), compared=len(want),
                missing=[m for m in missing if not m.endswith("_extra_state")], unexpected=list(unexpected),
                logit_diff=(logits - _our_logits(cfg, full, inputs)).abs().max().item(),
                iteration=loaded["iteration"], files=sorted(os.listdir(directory)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_core_reads_what_we_write(pool2, tmp_path, name):
    result = pool2.run(megatron_core_reads_worker, name=name, directory=str(tmp_path / "iter_0000003"))[0]
    assert result["missing"] == [] and result["unexpected"] == [], result  # every weight read
    assert result["compared"] >= 10 and result["tensor_diff"] == 0.0, result
    assert result["logit_diff"] < 1e-6, result
    assert result["iteration"] == 3
    assert {"metadata.json", "common.pt", ".metadata"} <= set(result["files"])
    assert any(f.endswith(".distcp") for f in result["files"]), result["files"]
    assert is_torch_dist_checkpoint(tmp_path / "iter_0000003")


# -- megatron-core -> ours --------------------------------------------------------------------
def we_read_megatron_core_worker(rank, world, *, name, directory, strategy):
    from megatron.core import dist_checkpointing

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.interop.torch_dist_io import host_save_strategy

    cfg = _cfg(name)
    inputs, _ = _tokens()
    with cpu_shim():
        theirs = _mcore(cfg, seed=11)
        if rank == 0:
            os.makedirs(directory)
        torch.distributed.barrier()
        dist_checkpointing.save({"model": theirs.sharded_state_dict(), "iteration": 9}, directory,
                                sharded_strategy=None if torch.cuda.is_available() else host_save_strategy())
        logits = _mcore_logits(theirs, inputs)
    torch.manual_seed(0)  # other weights than megatron-core's
    model, _ = _wrap(GPT(cfg), cfg, strategy, world)
    common = load_torch_dist(model, directory, config=cfg, spec="local")
    full = mf.get_full_state_dict(model)
    return dict(logit_diff=(logits - _our_logits(cfg, full, inputs)).abs().max().item(),
                iteration=common["iteration"])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_we_read_what_megatron_core_writes(pool2, tmp_path, name):
    results = pool2.run(we_read_megatron_core_worker, name=name, directory=str(tmp_path / "iter_0000009"),
                        strategy="optim_grads_params")
    for result in results:
        assert result["logit_diff"] < 1e-6 and result["iteration"] == 9, results


# -- expert parallelism ------------------------------------------------------------------------
def expert_parallel_worker(rank, world, *, directory):
    """Experts split over 2 expert-parallel ranks: each rank writes its own experts; megatron-core
    reads all of them; a fresh expert-parallel model reads them back."""
    from megatron.core import dist_checkpointing

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.models.expert_parallel import apply_expert_parallel
    from megatron_fsdp.models.mcore import to_mcore_state_dict

    cfg = _cfg("moe")
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("fsdp", "ep"))

    def build(seed):
        torch.manual_seed(seed)
        model = GPT(cfg)
        apply_expert_parallel(model, mesh["ep"])
        return mf.fully_shard(model, make_optimizer("adamw"), fsdp_unit_modules=[TransformerBlock],
                              zero_dp_strategy="optim_grads_params", expt_device_mesh=mesh)[0]

    model = build(0)
    full = mf.get_full_state_dict(model)
    save_torch_dist(model, directory, config=cfg, spec="local")
    register_safe_globals()  # torch_dist_io.py [Note: common.pt's classes]: what Megatron-LM's start-up does
    with cpu_shim():
        theirs = _mcore(cfg, seed=7)
        loaded = dist_checkpointing.load({"model": theirs.sharded_state_dict()}, directory)
        theirs.load_state_dict(loaded["model"], strict=False)
    want = to_mcore_state_dict(full, cfg)
    got = theirs.state_dict()
    again = build(5)
    load_torch_dist(again, directory, config=cfg, spec="local")
    back = mf.get_full_state_dict(again)
    return dict(to_mcore=max((got[k] - v).abs().max().item() for k, v in want.items()),
                back=max((back[k] - v).abs().max().item() for k, v in full.items()),
                experts=sum(".experts." in k for k in full))


def test_expert_parallel_model_round_trips(pool2, tmp_path):
    results = pool2.run(expert_parallel_worker, directory=str(tmp_path / "iter_0000001"))
    for result in results:
        assert result["experts"] == 2 * 4 * 2 and result["to_mcore"] == 0.0 and result["back"] == 0.0, results


# -- megatron-core's GPTModel wrapped by FullyShardedDataParallel (--use-mcore-models) ----------
def wrapped_mcore_worker(rank, world, *, name, directory):
    """megatron-core's own model, sharded by the adapter at world 2 (ZeRO-3): what it saves is
    what megatron-core's plain model reads, and it reads megatron-core's own checkpoint."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallelConfig as McoreDDPConfig

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.interop.torch_dist_io import host_save_strategy
    from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    cfg = _cfg(name)
    with cpu_shim():
        source = _mcore(cfg, seed=0)
        weights = {k: v.clone() for k, v in source.state_dict().items() if torch.is_tensor(v)}
        ddp = McoreDDPConfig(use_megatron_fsdp=True, use_distributed_optimizer=True,
                             data_parallel_sharding_strategy="optim_grads_params")
        wrapped = FullyShardedDataParallel(source.config, ddp, source)
        save_torch_dist(wrapped, f"{directory}/ours", config=cfg, spec="local")
        reader = _mcore(cfg, seed=3)
        register_safe_globals()
        loaded = dist_checkpointing.load({"model": reader.sharded_state_dict()}, f"{directory}/ours")
        reader.load_state_dict(loaded["model"], strict=False)
        read = max((reader.state_dict()[k] - v).abs().max().item() for k, v in weights.items())
        other = _mcore(cfg, seed=4)
        if rank == 0:
            os.makedirs(f"{directory}/theirs")
        torch.distributed.barrier()
        dist_checkpointing.save({"model": other.sharded_state_dict()}, f"{directory}/theirs",
                                sharded_strategy=None if torch.cuda.is_available() else host_save_strategy())
        load_torch_dist(wrapped, f"{directory}/theirs", config=cfg, spec="local")
        full = mf.get_full_state_dict(wrapped.module)  # the adapter's MegatronFSDP
    back = max((full[k] - v).abs().max().item() for k, v in other.state_dict().items() if torch.is_tensor(v))
    return dict(read=read, back=back, compared=len(weights))


@pytest.mark.parametrize("name", ["llama_gqa"] + (["gpt2", "moe"] if os.environ.get("MFSDP_INTEROP_LONG") else []))
def test_wrapped_megatron_core_model_round_trips(pool2, tmp_path, name):
    for result in pool2.run(wrapped_mcore_worker, name=name, directory=str(tmp_path)):
        assert result["read"] == 0.0 and result["back"] == 0.0 and result["compared"] >= 9, result


# -- resharding with the optimizer --------------------------------------------------------------
STEPS_BEFORE, STEPS_AFTER, BATCH_PER_RANK = 2, 2, 2


def _global_batches(cfg: GPTConfig, world: int = 2):
    g = torch.Generator().manual_seed(5)
    steps = STEPS_BEFORE + STEPS_AFTER
    return [torch.randint(0, cfg.vocab_size, (BATCH_PER_RANK * world, SEQ + 1), generator=g) for _ in range(steps)]


def _train(model, opt, batches, rank: int, world: int) -> None:
    """Each rank its share of every global batch (world 1: the whole batch)."""
    for tokens in batches:
        opt.zero_grad()
        share = tokens.chunk(world)[rank]
        gpt_loss(model(share[:, :-1]), share[:, 1:]).backward()
        opt.step()


def _uninterrupted(cfg: GPTConfig) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = make_optimizer("adamw")(model.parameters())
    _train(model, opt, _global_batches(cfg), 0, 1)
    return model.state_dict()


def save_trained_worker(rank, world, *, name, directory):
    cfg = _cfg(name)
    torch.manual_seed(0)
    model, opt = _wrap(GPT(cfg), cfg, "optim_grads_params", world)
    _train(model, opt, _global_batches(cfg)[:STEPS_BEFORE], rank, world)
    save_torch_dist(model, directory, config=cfg, optimizer=opt, common_state={"iteration": STEPS_BEFORE})


def resume_worker(rank, world, *, name, directory, strategy):
    cfg = _cfg(name)
    torch.manual_seed(123)  # other weights: everything must come from the checkpoint
    if strategy is None:  # one process, a plain model and a plain AdamW
        model = GPT(cfg)
        opt = make_optimizer("adamw")(model.parameters())
    else:
        model, opt = _wrap(GPT(cfg), cfg, strategy, world)
    common = load_torch_dist(model, directory, config=cfg, optimizer=opt)
    _train(model, opt, _global_batches(cfg)[STEPS_BEFORE:], rank, world)
    full = model.state_dict() if strategy is None else mf.get_full_state_dict(model)
    reference = _uninterrupted(cfg)
    return dict(diff=max((full[k] - v).abs().max().item() for k, v in reference.items()),
                iteration=common["iteration"])


@pytest.mark.parametrize("name", ["llama_gqa"])
def test_resharded_resume_equals_uninterrupted_training(pool2, tmp_path, name):
    directory = str(tmp_path / "iter_0000002")
    pool2.run(save_trained_worker, name=name, directory=directory)
    one = get_pool(1).run(resume_worker, name=name, directory=directory, strategy=None)[0]
    two = pool2.run(resume_worker, name=name, directory=directory, strategy="optim_grads")
    for result in [one, *two]:
        assert result["diff"] < 1e-6 and result["iteration"] == STEPS_BEFORE, (one, two)


@LONG
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads_params"])
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_resharded_resume_grid(pool2, tmp_path, name, strategy):
    directory = str(tmp_path / "iter_0000002")
    pool2.run(save_trained_worker, name=name, directory=directory)
    results = pool2.run(resume_worker, name=name, directory=directory, strategy=strategy)
    assert max(r["diff"] for r in results) < 1e-6, results


# -- errors -----------------------------------------------------------------------------------
def _raises(fn, exc_type) -> str:
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def errors_worker(rank, world, *, root):
    from megatron.core import dist_checkpointing

    from mcore_cpu_shim import cpu_shim
    from megatron_fsdp.interop.torch_dist_io import host_save_strategy
    from megatron_fsdp.models.mcore import mcore_args

    cfg = _cfg("llama_gqa")
    torch.manual_seed(0)
    saved = GPT(cfg)
    ours_dir, theirs_dir = f"{root}/ours", f"{root}/theirs"
    save_torch_dist(saved, ours_dir, config=cfg)
    with cpu_shim():  # megatron-core's own checkpoint: no saved config, only tensors
        os.makedirs(theirs_dir)
        dist_checkpointing.save({"model": _mcore(_cfg("gpt2"), seed=1).sharded_state_dict()}, theirs_dir,
                                sharded_strategy=host_save_strategy())
        os.makedirs(f"{root}/with_args")  # as Megatron-LM saves: its argument namespace in common.pt
        dist_checkpointing.save({"model": _mcore(_cfg("gpt2"), seed=1).sharded_state_dict(),
                                 "args": mcore_args(_cfg("gpt2"))}, f"{root}/with_args",
                                sharded_strategy=host_save_strategy())
    torch.manual_seed(1)
    target = GPT(cfg)
    before = copy.deepcopy(target.state_dict())
    untied = _cfg("gpt2", untie_embeddings_and_output_weights=True)
    messages = {
        "layers": _raises(lambda: load_torch_dist(GPT(_cfg("llama_gqa", num_layers=3)), ours_dir,
                                                  config=_cfg("llama_gqa", num_layers=3)), TorchDistMismatchError),
        "heads": _raises(lambda: load_torch_dist(target, ours_dir, config=_cfg("llama_gqa", num_attention_heads=8)),
                         TorchDistMismatchError),
        "missing": _raises(lambda: load_torch_dist(GPT(untied), theirs_dir, config=untied), TorchDistMismatchError),
        "shape": _raises(lambda: load_torch_dist(GPT(_cfg("gpt2", ffn_hidden_size=64)), theirs_dir,
                                                 config=_cfg("gpt2", ffn_hidden_size=64)), TorchDistMismatchError),
        "no_optimizer": _raises(lambda: load_torch_dist(target, ours_dir, config=cfg,
                                                        optimizer=torch.optim.AdamW(target.parameters())),
                                ValueError),
        "spec": _raises(lambda: save_torch_dist(saved, f"{root}/bad", config=cfg, spec="apex"), ValueError),
        "not_empty": _raises(lambda: save_torch_dist(saved, ours_dir, config=cfg), FileExistsError),
        "not_a_checkpoint": _raises(lambda: load_torch_dist(target, root, config=cfg), FileNotFoundError),
        "megatron_args": _raises(lambda: load_torch_dist(GPT(_cfg("gpt2", num_layers=3)), f"{root}/with_args",
                                                         config=_cfg("gpt2", num_layers=3)), TorchDistMismatchError),
    }
    partial = GPT(untied)  # strict=False: the output layer the checkpoint lacks stays as it was
    head = partial.lm_head.weight.detach().clone()
    load_torch_dist(partial, theirs_dir, config=untied, strict=False)
    kept_head = torch.equal(partial.lm_head.weight, head) and not torch.equal(partial.wte.weight, head)
    unchanged = all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    load_torch_dist(target, ours_dir, config=cfg)  # the right config loads
    loaded = all(torch.equal(v, target.state_dict()[k]) for k, v in saved.state_dict().items())
    return dict(messages=messages, unchanged=unchanged, loaded=loaded, kept_head=kept_head,
                detected=(is_torch_dist_checkpoint(ours_dir), is_torch_dist_checkpoint(root)))


def test_errors_name_the_problem_and_change_nothing(tmp_path):
    result = get_pool(1).run(errors_worker, root=str(tmp_path))[0]
    m = result["messages"]
    assert "num_layers: checkpoint 2, model 3" in m["layers"] and "config=" in m["layers"], m["layers"]
    assert "num_attention_heads: checkpoint 4, model 8" in m["heads"], m["heads"]
    assert "missing 1 tensor(s): output_layer.weight (for lm_head.weight)" in m["missing"], m["missing"]
    assert "decoder.layers.mlp.linear_fc1.weight (for blocks.0.mlp.fc.weight): checkpoint (2, 128, 32), " \
           "model (2, 64, 32)" in m["shape"], m["shape"]
    assert "no optimizer state" in m["no_optimizer"] and "optimizer=None" in m["no_optimizer"], m["no_optimizer"]
    assert "spec='apex'" in m["spec"] and "not empty" in m["not_empty"], m
    assert "not a torch_dist checkpoint" in m["not_a_checkpoint"], m
    assert "num_layers (GPTConfig.num_layers): checkpoint 2, model 3" in m["megatron_args"], m["megatron_args"]
    assert result["unchanged"] and result["loaded"] and result["detected"] == (True, False), result
    assert result["kept_head"], result
