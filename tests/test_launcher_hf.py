"""The launcher with Hugging Face weights: ``--load`` of a ``transformers`` directory (or
Megatron-LM's ``--pretrained-checkpoint``) starts a fine-tune, ``--export-hf-dir`` hands the
trained model back (training/checkpoint/hf_weights.py).

* Right after loading, the launcher's model computes the ``transformers`` model's logits (1e-5).
* A 10-iteration fine-tune at world 2 (ZeRO-3) and at world 1 exports directories that
  ``transformers`` loads; their logits are the trained model's (read back from the run's own
  checkpoint, 1e-5), and the two worlds' exports agree (1e-5).
* A run that did not start from Hugging Face (a ``HuggingFaceTokenizer`` run, family inferred
  from the flags) exports a directory ``transformers`` loads with the run's logits (1e-5) and
  the tokenizer's files, which ``AutoTokenizer`` reads.
* MFSDP_INTEROP_LONG=1: the other families (Mistral, Qwen2, Qwen3, Mixtral, GPT-2) load with
  the transformers logits and export what two iterations trained, each within 1e-5.
* An architecture flag that differs from ``config.json`` is refused naming the field; the
  paths the launcher cannot take are validation errors.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from conftest import get_pool  # noqa: E402
from hf_models import hf_logits, tiny_hf_model  # noqa: E402
from launcher_inprocess import launch_task  # noqa: E402
from megatron_fsdp.training.args.arguments import ArgumentError, parse_args  # noqa: E402

TOL = 1e-5
# tests/hf_models.py's tiny Llama, in the launcher's flags.
LLAMA = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 16 --max-position-embeddings 64 "
         "--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 96 ")
TRAIN = ("--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --adam-eps 1e-4 --log-interval 1 --eval-iters 0 "
         "--plot-path none --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
         "--ckpt-format fsdp_dtensor ")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "llama"
    tiny_hf_model("llama").save_pretrained(path)
    return path


def _transformers_logits(path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return hf_logits(AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").float().eval(), TOKENS)


def loaded_logits_task(rank: int, world: int, *, flags: str) -> torch.Tensor:
    """The launcher's model right after its start-up load (what ``restore`` reads), on TOKENS."""
    from launcher_inprocess import pretrain_script
    from megatron_fsdp.training.model_setup import gpt_config_from_args, setup_model_and_optimizer
    from megatron_fsdp.training.checkpoint import hf_weights

    script = pretrain_script()
    args = parse_args(shlex.split(flags), world_size=world)
    bundle = setup_model_and_optimizer(args, torch.device("cpu"))
    path, _ = script.checkpoint_source(args)
    hf_weights.load_hf_weights(bundle.model, path, gpt_config_from_args(args))
    with torch.no_grad():
        return bundle.model.eval()(TOKENS)[..., :96]


def checkpoint_logits_task(rank: int, world: int, *, root: str, vocab: int = 96) -> torch.Tensor:
    """A launcher checkpoint's weights in the embedded GPT (the converter's reader), on TOKENS."""
    from megatron_fsdp.convert.model_io import open_checkpoint

    model, _ = open_checkpoint(root)
    with torch.no_grad():
        return model.eval()(TOKENS)[..., :vocab]


def test_loaded_model_computes_the_transformers_logits(pool2, hf_dir):
    ours = pool2.run(loaded_logits_task, flags=LLAMA + TRAIN + f"--train-iters 1 --load {hf_dir}")[0]
    assert (ours - _transformers_logits(hf_dir)).abs().max() <= TOL


def _fine_tune(pool, hf_dir: Path, out: Path) -> list[str]:
    return pool.run(launch_task, flags=LLAMA + TRAIN + f"--train-iters 10 --load {hf_dir} --save {out / 'ckpt'} "
                                       f"--save-interval 10 --export-hf-dir {out / 'hf'}")[0]


def test_fine_tune_exports_what_it_trained_at_worlds_two_and_one(pool2, hf_dir, tmp_path):
    lines = _fine_tune(pool2, hf_dir, tmp_path / "w2")
    assert any("loaded Hugging Face weights from" in line for line in lines)
    assert any(" iteration       10/      10 |" in line for line in lines)
    assert any("exported the model as a Hugging Face llama directory" in line for line in lines)
    exported = _transformers_logits(tmp_path / "w2" / "hf")
    trained = pool2.run(checkpoint_logits_task, root=str(tmp_path / "w2" / "ckpt"))[0]
    assert (exported - trained).abs().max() <= TOL
    assert (exported - _transformers_logits(hf_dir)).abs().max() > 1e-3  # it did train
    _fine_tune(get_pool(1), hf_dir, tmp_path / "w1")
    assert (_transformers_logits(tmp_path / "w1" / "hf") - exported).abs().max() <= TOL


def _hf_tokenizer_dir(path: Path) -> Path:
    """A local HuggingFaceTokenizer directory: the shipped GPT-2 BPE as a fast tokenizer."""
    import json

    from megatron_fsdp.training.data import tokenizers as tk

    repo = Path(__file__).resolve().parents[1]
    bpe = tk.build_tokenizer("GPT2BPETokenizer", vocab_file=str(repo / "data" / "bpe" / "vocab.json"),
                             merge_file=str(repo / "data" / "bpe" / "merges.txt"))
    fast = tk._fast_bpe(bpe.encoder, bpe.merges)
    fast.add_special_tokens(["<|endoftext|>"])
    path.mkdir()
    fast.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}), encoding="utf-8")
    return path


def test_a_run_from_scratch_exports_its_family_and_tokenizer(pool2, tmp_path):
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    tokenizer = _hf_tokenizer_dir(tmp_path / "tok")
    flags = LLAMA.replace("--tokenizer-type NullTokenizer --vocab-size 96",
                          f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer}")
    lines = pool2.run(launch_task, flags=flags + TRAIN + f"--train-iters 2 --save {tmp_path / 'ckpt'} "
                                                         f"--save-interval 2 --export-hf-dir {tmp_path / 'hf'}")[0]
    assert any("exported the model as a Hugging Face llama directory" in line for line in lines)
    out = tmp_path / "hf"
    assert (out / "tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()
    assert AutoTokenizer.from_pretrained(out)("hello world")["input_ids"] == \
        AutoTokenizer.from_pretrained(tokenizer)("hello world")["input_ids"]
    exported = _transformers_logits(out)
    assert exported.shape[-1] == 2176  # the shipped vocabulary (2060) padded to a multiple of 128
    trained = pool2.run(checkpoint_logits_task, root=str(tmp_path / "ckpt"), vocab=2176)[0]
    assert (exported - trained).abs().max() <= TOL


def test_pretrained_checkpoint_is_read_when_load_holds_none(pool2, hf_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    lines = pool2.run(launch_task, flags=LLAMA + TRAIN + f"--train-iters 1 --load {tmp_path / 'empty'} "
                                                         f"--pretrained-checkpoint {hf_dir}")[0]
    assert any("fine-tuning from --pretrained-checkpoint" in line for line in lines)
    assert any("loaded Hugging Face weights from" in line for line in lines)
    with pytest.raises(Exception, match="nor in --pretrained-checkpoint"):  # Megatron-LM's FileNotFoundError
        pool2.run(launch_task, flags=LLAMA + TRAIN + f"--train-iters 1 --load {tmp_path / 'empty'} "
                                                     f"--pretrained-checkpoint {tmp_path / 'empty'}")


def test_an_architecture_flag_that_differs_is_refused_naming_the_field(pool2, hf_dir):
    with pytest.raises(Exception, match="num_layers"):
        pool2.run(launch_task, flags=LLAMA.replace("--num-layers 2", "--num-layers 3") + TRAIN +
                  f"--train-iters 1 --load {hf_dir}")


@pytest.mark.parametrize("extra, message", [
    ("--use-mcore-models", "maps Hugging Face names onto the embedded GPT only"),
    ("--export-hf-family llama4", "--export-hf-family 'llama4' is not one of"),
])
def test_what_the_hugging_face_paths_cannot_take_is_refused(hf_dir, extra, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(shlex.split(LLAMA + TRAIN + f"--train-iters 1 --load {hf_dir} " + extra), world_size=2)


# The other families' tiny models (tests/hf_models.py) in the launcher's flags.
_BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 64 "
         "--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 96 ")
_ROPE = ("--group-query-attention --num-query-groups 2 --ffn-hidden-size 48 --swiglu --normalization RMSNorm "
         "--norm-epsilon 1e-6 --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--disable-bias-linear ")
FAMILY_FLAGS = {
    "mistral": _BASE + _ROPE,
    "qwen2": _BASE + _ROPE + "--add-qkv-bias ",
    "qwen3": _BASE + _ROPE + "--qk-layernorm --kv-channels 16 ",
    "mixtral": _BASE + _ROPE + "--num-experts 4 --moe-router-topk 2 --rotary-base 1000000 ",
    "gpt2": _BASE + "--normalization LayerNorm --norm-epsilon 1e-5 --position-embedding-type learned_absolute "
                    "--ffn-hidden-size 128 ",
}


@pytest.mark.skipif(not os.environ.get("MFSDP_INTEROP_LONG"), reason="set MFSDP_INTEROP_LONG=1 for every family")
@pytest.mark.parametrize("family", list(FAMILY_FLAGS))
def test_each_family_loads_and_exports(pool2, tmp_path, family):
    source = tmp_path / family
    tiny_hf_model(family).save_pretrained(source)
    flags = FAMILY_FLAGS[family] + TRAIN
    ours = pool2.run(loaded_logits_task, flags=flags + f"--train-iters 1 --load {source}")[0]
    assert (ours - _transformers_logits(source)).abs().max() <= TOL
    lines = pool2.run(launch_task, flags=flags + f"--train-iters 2 --load {source} --save {tmp_path / 'ckpt'} "
                                                 f"--save-interval 2 --export-hf-dir {tmp_path / 'hf'}")[0]
    assert any(f"exported the model as a Hugging Face {family} directory" in line for line in lines)
    trained = pool2.run(checkpoint_logits_task, root=str(tmp_path / "ckpt"))[0]
    assert (_transformers_logits(tmp_path / "hf") - trained).abs().max() <= TOL
