"""Hugging Face checkpoints in and out (megatron_fsdp.interop): tiny ``transformers`` models of
each family, built locally and saved sharded, load into the embedded GPT with transformers'
logits (fp32, 1e-5); the GPT saved back loads in ``transformers`` with the same logits and
the same tensors bit for bit; at world 2 under ``fully_shard_model`` each rank reads only its
rows and the result equals world 1; every error names what is wrong.

Set MFSDP_INTEROP_LONG=1 for the bigger grid (Mixtral and GPT-2 at world 2, more strategies).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import megatron_fsdp as mf  # noqa: E402
from hf_models import FAMILIES, decoder_layer_class, hf_logits, tiny_hf_model  # noqa: E402
from megatron_fsdp.interop.hf_checkpoint import HFCheckpointError, load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from megatron_fsdp.interop.hf_config import (  # noqa: E402
    HFConfigMismatch,
    HFConfigUnsupported,
    HFFamily,
    check_gpt_config_against_hf,
    gpt_config_from_hf,
    hf_config_from_gpt,
    read_hf_config,
)
from megatron_fsdp.interop.hf_names import gpt_name_map  # noqa: E402
from megatron_fsdp.interop.safetensors_io import INDEX_FILE, SafetensorsReader, SafetensorsWriter  # noqa: E402
from megatron_fsdp.models import GPT, TransformerBlock  # noqa: E402

transformers.logging.set_verbosity_error()
LONG = pytest.mark.skipif(not os.environ.get("MFSDP_INTEROP_LONG"), reason="set MFSDP_INTEROP_LONG=1")
TOL = 1e-5
SHARD = "20KB"  # the tiny models' 75-200 KB then span 4-11 shards
CASES = {"llama": ("llama", False), "llama_tied": ("llama", True), **{f: (f, False) for f in FAMILIES if f != "llama"}}


def _tokens(vocab: int = 96, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))


def _save_hf(tmp_path, family: str, tied: bool = False, name: str = "hf"):
    model = tiny_hf_model(family, tied=tied)
    path = tmp_path / name
    model.save_pretrained(path, safe_serialization=True, max_shard_size=SHARD)
    return model, str(path)


def _gpt_from(path: str, *, seed: int = 11, **overrides) -> GPT:
    """The embedded GPT for a checkpoint, initialised under another seed than the checkpoint's."""
    cfg, _ = gpt_config_from_hf(read_hf_config(path), **overrides)
    torch.manual_seed(seed)
    return GPT(cfg).eval()


def _all_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, file)))
    return out


# -- every family: logits, export, bit-equal round trip ------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_family_loads_with_transformers_logits_and_round_trips(tmp_path, case):
    family, tied = CASES[case]
    hf, path = _save_hf(tmp_path, family, tied)
    assert os.path.isfile(os.path.join(path, INDEX_FILE))  # sharded input
    ours = _gpt_from(path)
    report = load_hf_checkpoint(ours, path)
    assert report.unused == () and report.padded_rows == 0
    tokens = _tokens()
    with torch.no_grad():
        diff = (ours(tokens) - hf_logits(hf, tokens)).abs().max().item()
    assert diff <= TOL, f"{case}: max |logits - transformers'| = {diff}"

    out = tmp_path / "out"
    files = save_hf_checkpoint(ours, out, hf_config=read_hf_config(path), max_shard_size=SHARD)
    assert len(files) > 1 and os.path.isfile(out / INDEX_FILE)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    assert torch.equal(hf_logits(reloaded, tokens), hf_logits(hf, tokens))
    before, after = _all_tensors(path), _all_tensors(str(out))
    assert sorted(before) == sorted(after)
    assert all(torch.equal(before[n], after[n]) for n in before), case


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gpt_built_here_exports_to_transformers(tmp_path, family):
    """A GPT configured and initialised here (not loaded) exports to a directory transformers
    loads with our logits; dtype= writes bf16 and says so in config.json."""
    from megatron_fsdp.models import GPTConfig

    if family == "llama":
        cfg = GPTConfig(vocab_size=128, seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4,
                        num_query_groups=2, ffn_hidden_size=40, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", add_bias_linear=False,
                        untie_embeddings_and_output_weights=True)
    else:
        cfg = GPTConfig(vocab_size=128, seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4)
    torch.manual_seed(0)
    ours = GPT(cfg).eval()
    save_hf_checkpoint(ours, tmp_path / "out", family=HFFamily(family), max_shard_size=SHARD)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    tokens = _tokens(vocab=128)
    with torch.no_grad():
        assert (ours(tokens) - hf_logits(theirs, tokens)).abs().max().item() <= TOL
    save_hf_checkpoint(ours, tmp_path / "bf16", family=HFFamily(family), dtype=torch.bfloat16)
    assert read_hf_config(tmp_path / "bf16")["dtype"] == "bfloat16"
    assert {v.dtype for v in _all_tensors(str(tmp_path / "bf16")).values()} == {torch.bfloat16}


def test_gpt2_file_without_transformer_prefix(tmp_path):
    """GPT-2 files saved from GPT2Model name their tensors h.0... (no transformer. prefix)."""
    hf, path = _save_hf(tmp_path, "gpt2")
    bare = tmp_path / "bare"
    bare.mkdir()
    save_file({k.removeprefix("transformer."): v for k, v in _all_tensors(path).items()},
              bare / "model.safetensors")
    (bare / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    ours = _gpt_from(str(bare))
    load_hf_checkpoint(ours, bare)
    with torch.no_grad():
        assert (ours(_tokens()) - hf_logits(hf, _tokens())).abs().max().item() <= TOL


def test_rope_layouts_agree():
    """[Note: rotary layout]: our non-interleaved RoPE is transformers' rotate-half RoPE."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from megatron_fsdp.models.rope import apply_rope, rope_angles

    hf = tiny_hf_model("llama")
    x = torch.randn(2, 4, 10, 8, generator=torch.Generator().manual_seed(0))
    cos, sin = LlamaRotaryEmbedding(hf.config)(x, torch.arange(10)[None])
    theirs, _ = apply_rotary_pos_emb(x, x, cos, sin)
    ours = apply_rope(x, rope_angles(10, 8, 10000, x.device))
    assert (ours - theirs).abs().max().item() <= 1e-6


def test_config_round_trip_and_padding(tmp_path):
    """config.json -> GPTConfig -> config.json; a padded vocabulary reads zeros and saves unpadded."""
    for family in FAMILIES:
        hf_config = tiny_hf_model(family).config.to_dict()
        cfg, fam = gpt_config_from_hf(hf_config)
        assert fam is HFFamily(family)
        assert gpt_config_from_hf(hf_config_from_gpt(cfg, fam))[0] == cfg
    hf, path = _save_hf(tmp_path, "qwen2")
    ours = _gpt_from(path, vocab_size=128)
    report = load_hf_checkpoint(ours, path)
    assert report.padded_rows == 2 * 32  # embedding and output layer, 32 rows each
    assert torch.count_nonzero(ours.wte.weight[96:]) == 0 and torch.count_nonzero(ours.lm_head.weight[96:]) == 0
    tokens = _tokens()
    with torch.no_grad():
        assert (ours(tokens)[..., :96] - hf_logits(hf, tokens)).abs().max().item() <= TOL
    save_hf_checkpoint(ours, tmp_path / "out", hf_config=read_hf_config(path))
    assert read_hf_config(tmp_path / "out")["vocab_size"] == 96
    assert _all_tensors(str(tmp_path / "out"))["model.embed_tokens.weight"].shape == (96, 32)


def test_safetensors_reader_reads_slices_and_writer_shards(tmp_path):
    tensors = {f"t{i}": torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6) + i for i in range(5)}
    writer = SafetensorsWriter(tmp_path, max_shard_size=40 * 6 * 4 * 2)  # two tensors a shard
    for name, value in tensors.items():
        writer.add(name, value)
    files = writer.close()
    assert [os.path.basename(f) for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 5 * 40 * 6 * 4 and index["weight_map"]["t4"].endswith("3.safetensors")
    with SafetensorsReader(tmp_path) as reader:
        assert torch.equal(reader.read("t3", (5, 9)), tensors["t3"][5:9])
        assert torch.equal(reader.read("t1", (2, 4), columns=(1, 3)), tensors["t1"][2:4, 1:3])
        assert reader.stats.rows == 6 and reader.stats.bytes == (4 * 6 + 2 * 2) * 4


# -- errors ---------------------------------------------------------------------------------------
def test_errors_name_what_is_wrong(tmp_path):
    hf, path = _save_hf(tmp_path, "llama")
    ours = _gpt_from(path)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    _, gpt2_path = _save_hf(tmp_path, "gpt2", name="gpt2")
    with pytest.raises(HFConfigMismatch, match="normalization: ours"):  # a Llama config against GPT-2's
        load_hf_checkpoint(ours, gpt2_path)
    with pytest.raises(HFCheckpointError, match="name map is mistral's, the checkpoint .* llama's"):
        load_hf_checkpoint(ours, path, name_map=gpt_name_map(ours.config, HFFamily.MISTRAL))
    with pytest.raises(HFConfigUnsupported, match="model_type='phi3'"):
        HFFamily.from_hf_config({"model_type": "phi3"})
    tensors = _all_tensors(path)

    def rewrite(name: str, values: dict) -> str:
        target = tmp_path / name
        target.mkdir()
        save_file(values, target / "model.safetensors")
        (target / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        return str(target)

    missing = rewrite("missing", {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.weight"})
    with pytest.raises(HFCheckpointError, match=r"missing tensor model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_hf_checkpoint(ours, missing)
    bad = dict(tensors, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)})
    with pytest.raises(HFCheckpointError, match=r"shape mismatch for model\.layers\.0\.mlp\.up_proj\.weight: "
                                                r"checkpoint \(40, 32\), the model's .* needs \(48, 32\)"):
        load_hf_checkpoint(ours, rewrite("shape", bad))
    extra = rewrite("extra", dict(tensors, **{"model.layers.0.extra.weight": torch.ones(3)}))
    with pytest.raises(HFCheckpointError, match=r"leaves unused: \['model\.layers\.0\.extra\.weight'\]"):
        load_hf_checkpoint(ours, extra)
    bf16 = rewrite("bf16", {k: v.bfloat16() for k, v in tensors.items()})
    with pytest.raises(HFCheckpointError, match=r"stored as torch\.bfloat16.*pass dtype=torch\.float32"):
        load_hf_checkpoint(ours, bf16)
    assert all(torch.equal(before[k], v) for k, v in ours.state_dict().items())  # nothing was loaded
    report = load_hf_checkpoint(ours, extra, strict=False)
    assert report.unused == ("model.layers.0.extra.weight",)
    load_hf_checkpoint(ours, bf16, dtype=torch.float32)
    assert torch.equal(ours.wte.weight, tensors["model.embed_tokens.weight"].bfloat16().float())


@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
    ("sliding_window", 16, "sliding_window=16"),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
    ("router_jitter_noise", 0.1, "router_jitter_noise=0.1"),
])
def test_unrepresentable_configs_are_refused(field, value, match):
    family = "mixtral" if field in ("router_jitter_noise", "sliding_window") else "llama"
    hf_config = dict(tiny_hf_model(family).config.to_dict(), **{field: value})
    with pytest.raises(HFConfigUnsupported, match=match):
        gpt_config_from_hf(hf_config)


def test_config_mismatch_names_field_and_values():
    hf_config = tiny_hf_model("qwen3").config.to_dict()
    cfg, _ = gpt_config_from_hf(hf_config)
    with pytest.raises(HFConfigMismatch, match=r"qk_layernorm: ours False, the checkpoint's True"):
        check_gpt_config_against_hf(dataclasses.replace(cfg, qk_layernorm=False), hf_config)
    with pytest.raises(HFConfigMismatch, match="cannot be written as a llama config.json.*qk_layernorm"):
        hf_config_from_gpt(cfg, HFFamily.LLAMA)


# -- sharded: world 2 ---------------------------------------------------------------------------
def sharded_worker(rank, world, *, path, out, strategy, family, vocab):
    """Load a checkpoint into a sharded GPT; its full state must equal the world-1 load."""
    padding = {"vocab_size": vocab} if vocab else {}
    single = _gpt_from(path, **padding)
    load_hf_checkpoint(single, path)
    model = _gpt_from(path, seed=12, **padding)
    kwargs = {}
    if model.config.num_moe_experts:
        from torch.distributed.device_mesh import init_device_mesh

        kwargs["expt_device_mesh"] = init_device_mesh("cpu", (world, 1), mesh_dim_names=("fsdp", "tp"))
    fsdp = mf.fully_shard_model(model, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=strategy, **kwargs)
    report, diff, logit_diff = _load_compare_export(fsdp, single, path, out)
    return diff, report.read.bytes, report.read.rows, logit_diff


def _load_compare_export(fsdp, single, path, out):
    """Load ``path`` into the wrapped ``fsdp`` and export it to ``out``: (the load's report, the
    largest weight difference to ``single`` loaded alone, the largest logit difference)."""
    report = load_hf_checkpoint(fsdp, path)
    full = mf.get_full_state_dict(fsdp)
    diff = max((full[n] - p).abs().max().item() for n, p in single.state_dict().items())
    fsdp.eval()
    with torch.no_grad():
        logits = fsdp(_tokens())
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    save_hf_checkpoint(fsdp, out, hf_config=read_hf_config(path), max_shard_size=SHARD)
    return report, diff, (logits - single(_tokens())).abs().max().item()


def _check_sharded(pool2, tmp_path, family, strategy, vocab=None):
    hf, path = _save_hf(tmp_path, family)
    out = str(tmp_path / "out")
    results = pool2.run(sharded_worker, path=path, out=out, strategy=strategy, family=family, vocab=vocab)
    total = sum(v.numel() * v.element_size() for v in _all_tensors(path).values())
    for diff, read_bytes, _, logits_diff in results:
        assert diff == 0.0 and logits_diff <= TOL
        if strategy in ("no_shard", 0):
            assert read_bytes == total  # every rank keeps the whole model
        else:
            assert read_bytes < total  # each rank read only its rows...
    if strategy not in ("no_shard", 0):
        assert sum(r[1] for r in results) == total  # ...and between them every byte once
    before, after = _all_tensors(path), _all_tensors(out)
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    return [r[1] for r in results], total


@pytest.mark.parametrize("strategy", [3, "optim"])
def test_sharded_load_and_save_world2(pool2, tmp_path, strategy):
    per_rank, total = _check_sharded(pool2, tmp_path, "llama", strategy, vocab=128)
    assert min(per_rank) > 0 and max(per_rank) < total


@LONG
@pytest.mark.parametrize("family", ["mixtral", "gpt2", "qwen3"])
@pytest.mark.parametrize("strategy", [3, "optim_grads", "no_shard"])
def test_sharded_families_world2_long(pool2, tmp_path, family, strategy):
    _check_sharded(pool2, tmp_path, family, strategy)


# -- a wrapped transformers model (identity map) -----------------------------------------------
def wrapped_hf_worker(rank, world, *, path, out, family):
    config = transformers.AutoConfig.from_pretrained(path)
    config._attn_implementation = "eager"
    torch.manual_seed(5)  # other weights than the checkpoint's
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    fsdp = mf.fully_shard_model(model, fsdp_unit_modules=[decoder_layer_class(model)], zero_dp_strategy=3)
    report = load_hf_checkpoint(fsdp, path)
    full = mf.get_full_state_dict(fsdp)
    if not set(reference.state_dict()) <= set(full):
        raise AssertionError(f"not loaded: {set(reference.state_dict()) - set(full)}")
    diff = max((full[n] - p).abs().max().item() for n, p in reference.state_dict().items())
    save_hf_checkpoint(fsdp, out, max_shard_size=SHARD)
    return diff, report.read.bytes


def test_wrapped_transformers_model_world2(pool2, tmp_path):
    hf, path = _save_hf(tmp_path, "llama", tied=True)
    out = str(tmp_path / "out")
    results = pool2.run(wrapped_hf_worker, path=path, out=out, family="llama")
    total = sum(v.numel() * v.element_size() for v in _all_tensors(path).values())
    assert all(diff == 0.0 and read < total for diff, read in results)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert torch.equal(hf_logits(reloaded, _tokens()), hf_logits(hf, _tokens()))


# -- experimental.fully_shard --------------------------------------------------------------------
def experimental_worker(rank, world, *, path, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from megatron_fsdp.experimental import Placements, full_state_dict, fully_shard, fully_shard_context

    single = _gpt_from(path, vocab_size=128)
    load_hf_checkpoint(single, path)
    model = _gpt_from(path, seed=12, vocab_size=128)
    mesh = init_device_mesh("cpu", (world,))
    zero3 = Placements(dp_axes=[0], parameter=[Shard(0)], gradient=[Shard(0)], optimizer=[Shard(0)])
    with fully_shard_context():
        for block in model.blocks:
            fully_shard(block, mesh=mesh, placements=zero3)
        fully_shard(model, mesh=mesh, placements=zero3)
    report = load_hf_checkpoint(model, path)
    full = full_state_dict(model)
    diff = max((full[n] - p).abs().max().item() for n, p in single.state_dict().items())
    save_hf_checkpoint(model, out, hf_config=read_hf_config(path), max_shard_size=SHARD)
    return diff, report.read.bytes


def test_experimental_fully_shard_world2(pool2, tmp_path):
    hf, path = _save_hf(tmp_path, "llama")
    out = str(tmp_path / "out")
    results = pool2.run(experimental_worker, path=path, out=out)
    before, after = _all_tensors(path), _all_tensors(out)
    total = sum(v.numel() * v.element_size() for v in before.values())
    assert all(diff == 0.0 and read < total for diff, read in results)
    assert sum(read for _, read in results) == total
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)


# -- tensor parallelism (under fully_shard_model) ------------------------------------------------
def tensor_parallel_worker(rank, world, *, path, out, tp):
    from megatron_fsdp.models.tensor_parallel import apply_tensor_parallel
    from megatron_fsdp.parallel_dims import ParallelDims

    single = _gpt_from(path, vocab_size=128)
    load_hf_checkpoint(single, path)
    dims = ParallelDims(world=world, tp=tp)
    mesh = dims.build_mesh("cpu")
    model = apply_tensor_parallel(_gpt_from(path, seed=12, vocab_size=128), dims.tp_mesh(mesh),
                                  sequence_parallel=False)
    fsdp = mf.fully_shard_model(model, fsdp_unit_modules=[TransformerBlock], zero_dp_strategy=3,
                                **dims.wrap_kwargs(mesh, dims.data_parallel_group(mesh)))
    report, diff, logit_diff = _load_compare_export(fsdp, single, path, out)
    return diff, report.read.bytes, logit_diff


def _check_tensor_parallel(pool, tmp_path, tp):
    hf, path = _save_hf(tmp_path, "llama")
    out = str(tmp_path / "out")
    results = pool.run(tensor_parallel_worker, path=path, out=out, tp=tp)
    before, after = _all_tensors(path), _all_tensors(out)
    total = sum(v.numel() * v.element_size() for v in before.values())
    for diff, read, logits_diff in results:
        assert diff == 0.0 and read < total and logits_diff <= TOL
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    return [r[1] for r in results], total


def test_tensor_parallel_world2(pool2, tmp_path):
    """TP 2 (data-parallel size 1): each rank reads its tensor-parallel piece only."""
    per_rank, total = _check_tensor_parallel(pool2, tmp_path, tp=2)
    assert sum(per_rank) < 2 * total  # replicated norms are read by both, the rest split


@LONG
def test_tensor_and_data_parallel_world4(pool4, tmp_path):
    """TP 2 x ZeRO-3 over 2 data-parallel ranks: every rank reads a quarter of the split tensors."""
    per_rank, total = _check_tensor_parallel(pool4, tmp_path, tp=2)
    norms = sum(v.numel() * 4 for n, v in _all_tensors(str(tmp_path / "hf")).items() if n.endswith("norm.weight"))
    # The norms are replicated over TP (each TP rank's data-parallel pair reads them once); the rest split 4 ways.
    assert sum(per_rank) == total + norms and max(per_rank) < total / 3
