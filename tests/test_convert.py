"""``python -m megatron_fsdp.convert``: checkpoints between Hugging Face, megatron-core
``torch_dist``, this project's ``fsdp_dtensor`` and Megatron-LM's legacy ``torch`` formats.

* Round trips with tiny ``transformers`` models built here: HF -> fsdp_dtensor -> torch_dist ->
  HF -> torch -> HF gives the same tensors bit for bit (Llama; Mixtral and GPT-2 through
  torch_dist; the other families with MFSDP_INTEROP_LONG=1), and ``transformers`` reloads the
  result with the original's logits.
* At world 2 (ZeRO-3, each rank reading its share) the output equals world 1's.
* A launcher checkpoint (ZeRO-3 at world 2) converts to a Hugging Face directory whose logits in
  ``transformers`` are the launcher model's; the launcher resumes a converted checkpoint as a
  weights-only one.
* The launcher's own ``setup_model_and_optimizer`` + ``dcp_checkpoint.load`` read a converted
  ``fsdp_dtensor`` checkpoint with the original's weights (equal) and logits (1e-5).
* --hf-config gives an hf output its family and token ids; saved args lacking some launcher
  flags take the launcher's defaults.
* Refusals: an unknown directory, the wrong --input-format, a non-empty output, --dtype or
  --hf-config for a Megatron format, a family that cannot hold the model, a model torch_dist
  cannot hold, a checkpoint that does not say its sizes.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("megatron.core")

from hf_models import FAMILIES, hf_logits, tiny_hf_model  # noqa: E402
from launcher_inprocess import launch_task  # noqa: E402
from megatron_fsdp.convert.architecture import Source  # noqa: E402
from megatron_fsdp.convert.cli import ConversionError, check_target, main  # noqa: E402
from megatron_fsdp.convert.formats import CheckpointFormat  # noqa: E402
from megatron_fsdp.interop.hf_config import HFConfigUnsupported, hf_family_for  # noqa: E402
from megatron_fsdp.models.gpt import GPTConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LONG = pytest.mark.skipif(not os.environ.get("MFSDP_INTEROP_LONG"), reason="every family: MFSDP_INTEROP_LONG=1")
TOKENS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(str(directory / "*.safetensors"))):
        out.update(load_file(path))
    return out


def _assert_same_tensors(a: Path, b: Path) -> None:
    ours, theirs = _tensors(a), _tensors(b)
    assert ours and sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
    for name, value in ours.items():
        assert value.dtype == theirs[name].dtype and torch.equal(value, theirs[name]), name


def _convert(*argv: str) -> None:
    assert main(list(argv)) == 0, argv


def _hf_dir(tmp_path: Path, family: str) -> tuple[Path, torch.nn.Module]:
    model = tiny_hf_model(family)
    model.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf", model


def _reloaded_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").float().eval()
    return hf_logits(model, TOKENS)


def test_every_format_round_trips_bit_for_bit(tmp_path):
    hf, original = _hf_dir(tmp_path, "llama")
    chain = [("fsdp_dtensor", "dt"), ("torch_dist", "td"), ("hf", "hf2"), ("torch", "pt"), ("hf", "hf3")]
    source = hf
    for fmt, name in chain:
        _convert("--input", str(source), "--output", str(tmp_path / name), "--output-format", fmt)
        source = tmp_path / name
    _assert_same_tensors(hf, tmp_path / "hf2")
    _assert_same_tensors(hf, tmp_path / "hf3")
    assert torch.equal(_reloaded_logits(tmp_path / "hf3"), hf_logits(original, TOKENS))
    assert sorted(os.listdir(tmp_path / "dt")) == ["iter_0000000", "latest_checkpointed_iteration.txt"]


@pytest.mark.parametrize("family", [f if f in ("mixtral", "gpt2") else pytest.param(f, marks=LONG)
                                    for f in FAMILIES if f != "llama"])
def test_each_family_round_trips_through_torch_dist(tmp_path, family):
    hf, _ = _hf_dir(tmp_path, family)
    _convert("--input", str(hf), "--output", str(tmp_path / "td"), "--output-format", "torch_dist")
    _convert("--input", str(tmp_path / "td"), "--output", str(tmp_path / "back"), "--output-format", "hf")
    _assert_same_tensors(hf, tmp_path / "back")


def test_the_module_runs_as_a_command(tmp_path):
    hf, _ = _hf_dir(tmp_path, "gpt2")
    done = subprocess.run([sys.executable, "-m", "megatron_fsdp.convert", "--input", str(hf), "--output",
                           str(tmp_path / "pt"), "--output-format", "torch"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "converted hf" in done.stdout and (tmp_path / "pt" / "iter_0000000" / "mp_rank_00").is_dir()


# -- world 2 -------------------------------------------------------------------------------------
def convert_task(rank: int, world: int, *, argv: list[str]) -> int:
    return main(argv)  # the pool's process group: each rank holds and reads a ZeRO-3 share


def test_world_two_writes_what_world_one_writes(pool2, tmp_path):
    hf, _ = _hf_dir(tmp_path, "mixtral")
    assert pool2.run(convert_task, argv=["--input", str(hf), "--output", str(tmp_path / "dt2"),
                                         "--output-format", "fsdp_dtensor"]) == [0, 0]
    assert pool2.run(convert_task, argv=["--input", str(tmp_path / "dt2"), "--output", str(tmp_path / "back2"),
                                         "--output-format", "hf"]) == [0, 0]
    _convert("--input", str(hf), "--output", str(tmp_path / "dt1"), "--output-format", "fsdp_dtensor")
    _convert("--input", str(tmp_path / "dt1"), "--output", str(tmp_path / "back1"), "--output-format", "hf")
    _assert_same_tensors(tmp_path / "back1", tmp_path / "back2")
    _assert_same_tensors(hf, tmp_path / "back2")


# -- the launcher's checkpoints ------------------------------------------------------------------
LAUNCH = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
          "--ffn-hidden-size 64 --swiglu --normalization RMSNorm --position-embedding-type rope "
          "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 16 --max-position-embeddings 16 "
          "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --log-interval 1 --eval-iters 0 --plot-path none "
          "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --use-megatron-fsdp --ckpt-format fsdp_dtensor ")


def logits_task(rank: int, world: int, *, root: str) -> torch.Tensor:
    """The launcher checkpoint's weights in the embedded GPT (read by the converter's loader,
    ZeRO-3 over the pool's ranks), on TOKENS."""
    from megatron_fsdp.convert.model_io import open_checkpoint

    model, _ = open_checkpoint(root)
    with torch.no_grad():
        return model.eval()(TOKENS % 64)  # the launcher's vocabulary (--vocab-size 64, padded to 128)


def test_a_launcher_checkpoint_becomes_a_transformers_model_and_back(pool2, tmp_path):
    ckpt = tmp_path / "ckpt"
    pool2.run(launch_task, flags=LAUNCH + f"--train-iters 3 --save {ckpt} --save-interval 3")
    _convert("--input", str(ckpt), "--output", str(tmp_path / "hf"), "--output-format", "hf")
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "hf").model_type == "llama"  # inferred from the architecture
    ours = pool2.run(logits_task, root=str(ckpt))[0]
    from transformers import AutoModelForCausalLM

    theirs = hf_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval(),
                       TOKENS % 64)
    assert (ours[..., :theirs.shape[-1]] - theirs).abs().max() <= 1e-5

    # The launcher starts from a converted (weights-only) checkpoint as from --finetune.
    _convert("--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back"), "--output-format", "fsdp_dtensor")
    lines = pool2.run(launch_task, flags=LAUNCH + f"--train-iters 2 --load {tmp_path / 'back'}")[0]
    assert any("a weights-only checkpoint" in line for line in lines), lines
    assert any(" iteration        1/       2 |" in line for line in lines)


# A converted Hugging Face Llama in the launcher's flags (the vocabulary of 96 rows kept unpadded).
LLAMA = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 16 --max-position-embeddings 64 "
         "--hidden-dropout 0 --attention-dropout 0 --mock-data --tokenizer-type NullTokenizer --vocab-size 96 "
         "--make-vocab-size-divisible-by 32 --micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 1 "
         "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor ")


def launcher_load_task(rank: int, world: int, *, root: str) -> tuple[dict, torch.Tensor, list[str]]:
    """A launcher-built model (``setup_model_and_optimizer``) after the launcher's own
    ``dcp_checkpoint.load`` of ``root``: its full weights, logits on TOKENS, the extra state's keys."""
    import megatron_fsdp as mf
    from megatron_fsdp.training.args.arguments import parse_args
    from megatron_fsdp.training.checkpoint import dcp_checkpoint
    from megatron_fsdp.training.model_setup import setup_model_and_optimizer

    bundle = setup_model_and_optimizer(parse_args(shlex.split(LLAMA), world_size=world), torch.device("cpu"))
    extra = dcp_checkpoint.load(root, bundle.model, None)
    weights = mf.get_full_state_dict(bundle.model)
    with torch.no_grad():
        logits = bundle.model.eval()(TOKENS)
    return weights, logits, sorted(extra)


def test_the_launcher_loads_a_converted_checkpoint_with_equal_weights(pool2, tmp_path):
    from megatron_fsdp.interop.hf_checkpoint import load_hf_checkpoint
    from megatron_fsdp.interop.hf_config import gpt_config_from_hf, read_hf_config
    from megatron_fsdp.models.gpt import GPT

    hf, original = _hf_dir(tmp_path, "llama")
    _convert("--input", str(hf), "--output", str(tmp_path / "dt"), "--output-format", "fsdp_dtensor")
    weights, logits, extra = pool2.run(launcher_load_task, root=str(tmp_path / "dt"))[0]
    assert "train_state" not in extra and "args" in extra  # weights only: the launcher starts a fine-tune
    config, _ = gpt_config_from_hf(read_hf_config(hf))
    reference = GPT(config)
    load_hf_checkpoint(reference, hf, config=config)
    expected = reference.state_dict()
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], value) for name, value in expected.items())
    assert (logits - hf_logits(original, TOKENS)).abs().max() <= 1e-5


# -- refusals -----------------------------------------------------------------------------------
def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_refusals_name_the_problem_and_the_fix(tmp_path, capsys):
    hf, _ = _hf_dir(tmp_path, "llama")
    (tmp_path / "empty").mkdir()
    err = _refused(capsys, "--input", str(tmp_path / "empty"), "--output", str(tmp_path / "o"), "--output-format", "hf")
    assert "holds no checkpoint this converter reads" in err and "mp_rank_00/model_optim_rng.pt" in err
    err = _refused(capsys, "--input", str(hf), "--input-format", "torch_dist", "--output", str(tmp_path / "o"),
                   "--output-format", "torch")
    assert "holds a hf checkpoint, not the --input-format torch_dist" in err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    err = _refused(capsys, "--input", str(hf), "--output", str(tmp_path / "full"), "--output-format", "torch")
    assert "is not empty" in err and "--overwrite" in err
    err = _refused(capsys, "--input", str(hf), "--output", str(tmp_path / "o"), "--output-format", "torch",
                   "--dtype", "bf16")
    assert "--dtype applies to --output-format hf" in err
    err = _refused(capsys, "--input", str(hf), "--output", str(tmp_path / "o"), "--output-format", "hf",
                   "--family", "gpt2")
    assert "gpt2" in err.lower() and "error" in err
    shutil.copytree(hf, tmp_path / "falcon")
    config = json.loads((tmp_path / "falcon" / "config.json").read_text())
    (tmp_path / "falcon" / "config.json").write_text(json.dumps({**config, "model_type": "falcon",
                                                                 "architectures": ["FalconForCausalLM"]}))
    err = _refused(capsys, "--input", str(tmp_path / "falcon"), "--output", str(tmp_path / "o"), "--output-format",
                   "torch")
    assert "model_type='falcon'" in err and "llama" in err  # the families it reads are listed
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")


def test_hf_config_gives_the_output_its_family_and_token_ids(tmp_path, capsys):
    hf, _ = _hf_dir(tmp_path, "llama")
    _convert("--input", str(hf), "--output", str(tmp_path / "td"), "--output-format", "torch_dist")
    _convert("--input", str(tmp_path / "td"), "--output", str(tmp_path / "back"), "--output-format", "hf",
             "--hf-config", str(hf / "config.json"))
    _assert_same_tensors(hf, tmp_path / "back")
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == "llama" and (written["bos_token_id"], written["eos_token_id"]) == (1, 2)
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 96}))
    err = _refused(capsys, "--input", str(tmp_path / "td"), "--output", str(tmp_path / "o"), "--output-format", "hf",
                   "--hf-config", str(gpt2))
    assert "cannot be written as a gpt2 config.json" in err
    err = _refused(capsys, "--input", str(hf), "--output", str(tmp_path / "o"), "--output-format", "torch",
                   "--hf-config", str(gpt2))
    assert "--hf-config applies to --output-format hf" in err
    assert not (tmp_path / "o").exists()


def test_torch_dist_refuses_a_model_it_cannot_hold_before_reading():
    config = GPTConfig(vocab_size=64, seq_length=16, num_layers=1, hidden_size=32, num_attention_heads=4,
                       mtp_num_layers=1)
    with pytest.raises(ConversionError, match="torch_dist cannot hold this model: mtp_num_layers=1"):
        check_target(CheckpointFormat.TORCH_DIST, Source(config, None, None, {}))
    check_target(CheckpointFormat.FSDP_DTENSOR, Source(config, None, None, {}))  # this project's layout holds it


def test_no_family_holds_a_gelu_model_with_rotary_positions():
    config = GPTConfig(vocab_size=64, seq_length=16, num_layers=1, hidden_size=32, num_attention_heads=4,
                       position_embedding_type="rope")
    with pytest.raises(HFConfigUnsupported, match="no Hugging Face family holds this model"):
        hf_family_for(config)
    assert hf_family_for(GPTConfig(vocab_size=64, seq_length=16, num_layers=1, hidden_size=32,
                                  num_attention_heads=4)).value == "gpt2"


def test_a_checkpoint_without_its_model_asks_for_model_flags(tmp_path, capsys):
    hf, _ = _hf_dir(tmp_path, "llama")
    _convert("--input", str(hf), "--output", str(tmp_path / "pt"), "--output-format", "torch")
    path = tmp_path / "pt" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(path, weights_only=False)
    saved.pop("megatron_fsdp_gpt_config")
    saved["args"] = None  # as a file another program wrote
    torch.save(saved, path)
    err = _refused(capsys, "--input", str(tmp_path / "pt"), "--output", str(tmp_path / "o"), "--output-format", "hf")
    assert "--model-flags" in err
    flags = shlex.join(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "48", "--swiglu",
                        "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
                        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--seq-length", "64",
                        "--max-position-embeddings", "64", "--vocab-size", "96"])
    _convert("--input", str(tmp_path / "pt"), "--output", str(tmp_path / "o"), "--output-format", "hf",
             "--model-flags", flags)
    _assert_same_tensors(hf, tmp_path / "o")

    # Saved args that lack some of the launcher's flags (as Megatron-LM's own): its defaults stand in.
    _convert("--input", str(tmp_path / "pt"), "--output", str(tmp_path / "pt2"), "--output-format", "torch",
             "--model-flags", flags)
    path = tmp_path / "pt2" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(path, weights_only=False)
    saved.pop("megatron_fsdp_gpt_config")
    assert saved["args"].num_layers == 2 and saved["args"].swiglu
    del saved["args"].rotary_base, saved["args"].qk_layernorm
    torch.save(saved, path)
    _convert("--input", str(tmp_path / "pt2"), "--output", str(tmp_path / "o2"), "--output-format", "hf")
    _assert_same_tensors(hf, tmp_path / "o2")
    del saved["args"].hidden_size
    torch.save(saved, path)
    err = _refused(capsys, "--input", str(tmp_path / "pt2"), "--output", str(tmp_path / "o3"), "--output-format",
                   "hf")
    assert "lack ['hidden_size']" in err and "--model-flags" in err


def test_a_padded_vocabulary_loads_with_the_launchers_default_flags(pool2, tmp_path, capsys):
    """--make-vocab-size-divisible-by 128 pads the Hugging Face vocabulary (96 rows) as the
    launcher's default pads it, so a run with the default flags starts from the output; with
    --hf-config the way back drops the padding again, bit for bit."""
    hf, _ = _hf_dir(tmp_path, "llama")
    _convert("--input", str(hf), "--output", str(tmp_path / "dt"), "--output-format", "fsdp_dtensor",
             "--make-vocab-size-divisible-by", "128")
    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
             "--ffn-hidden-size 48 --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --position-embedding-type rope "
             "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 16 --max-position-embeddings 64 "
             "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --train-iters 1 --log-interval 1 --eval-iters 0 "
             "--plot-path none --mock-data --tokenizer-type NullTokenizer --vocab-size 96 --use-megatron-fsdp "
             f"--load {tmp_path / 'dt'}")
    lines = pool2.run(launch_task, flags=flags)[0]
    assert any("a weights-only checkpoint" in line for line in lines), lines
    _convert("--input", str(tmp_path / "dt"), "--output", str(tmp_path / "back"), "--output-format", "hf",
             "--hf-config", str(hf))
    _assert_same_tensors(hf, tmp_path / "back")
    err = _refused(capsys, "--input", str(hf), "--output", str(tmp_path / "x"), "--output-format", "hf",
                   "--make-vocab-size-divisible-by", "128")
    assert "pads the vocabulary of an hf input in a Megatron-format output" in err
