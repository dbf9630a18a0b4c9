"""``--ckpt-format torch_dist`` writes megatron-core's own format (training/checkpoint/
mcore_dist.py): megatron-core's ``dist_checkpointing`` reads the launcher's checkpoint, the
launcher resumes from it as from its own, and runs the map does not cover keep the
fsdp_dtensor layout and say so. (The library's round trips with megatron-core's GPTModel,
tensors and logits, are tests/test_torch_dist_interop.py's.)

* 2 ranks, ZeRO-3, AdamW: a run resumed from the iteration-2 checkpoint repeats the
  uninterrupted run's iterations 3-4 (losses within 1e-6); resumed at world 1, within 1e-5.
* The directory is megatron-core's: ``metadata.json`` of the torch_dist backend, ``common.pt``
  with Megatron-LM's ``args`` and ``iteration``, the model under GPTModel's keys, Adam's
  moments in the ``fully_reshardable`` layout.
* megatron-core's own reader (``load_plain_tensors``, i.e. ``dist_checkpointing.load`` of the
  whole tensors) reads every weight of the launcher's torch_dist checkpoint equal to the same
  run saved in the fsdp_dtensor layout, put under GPTModel's names by ``models.mcore``
  (TransformerEngine spec names, layers stacked), within 1e-5.
* A converted (weights-only) torch_dist checkpoint starts a fine-tune; SGD keeps the
  fsdp_dtensor layout with one line saying why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from conftest import get_pool  # noqa: E402
from launcher_inprocess import launch_task  # noqa: E402
from megatron_fsdp.interop.torch_dist_io import common_state  # noqa: E402

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
         "--ffn-hidden-size 64 --swiglu --normalization RMSNorm --position-embedding-type rope "
         "--untie-embeddings-and-output-weights --disable-bias-linear --seq-length 16 --max-position-embeddings 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --adam-eps 1e-4 --clip-grad 1.0 --weight-decay 0.1 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-iters 0 --plot-path none --mock-data "
         "--tokenizer-type NullTokenizer --vocab-size 64 --use-megatron-fsdp "
         "--data-parallel-sharding-strategy optim_grads_params --ckpt-format torch_dist ")


def _losses(path: Path) -> dict[int, float]:
    record = json.loads(path.read_text())
    return dict(zip(record["iterations"], record["lm_loss"]))


def test_resume_from_megatron_core_format_repeats_the_run(pool2, tmp_path):
    root = tmp_path / "ckpt"
    lines = pool2.run(launch_task, flags=FLAGS + f"--train-iters 4 --save {root} --save-interval 2 "
                                                 f"--log-json {tmp_path / 'full.json'}")[0]
    assert any("(torch_dist format)" in line for line in lines)
    from megatron.core import dist_checkpointing

    directory = root / "iter_0000002"
    metadata = json.loads((directory / "metadata.json").read_text())
    assert metadata["sharded_backend"] == "torch_dist"
    # megatron-core's reader, with its common.pt classes allowed again ([Note: common.pt's classes]:
    # a safe_globals block elsewhere in this process may have dropped them).
    common = common_state(directory)
    assert common["iteration"] == 2 and common["args"].num_layers == 2
    keys = set(dist_checkpointing.load_tensors_metadata(str(directory)))
    assert "embedding.word_embeddings.weight" in keys and "decoder.layers.self_attention.linear_qkv.weight" in keys
    assert "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight" in keys

    pool2.run(launch_task, flags=FLAGS + f"--train-iters 4 --load {root} --ckpt-step 2 "
                                         f"--log-json {tmp_path / 'resumed.json'}")
    full, resumed = _losses(tmp_path / "full.json"), _losses(tmp_path / "resumed.json")
    assert sorted(resumed) == [3, 4]
    for it in (3, 4):
        assert abs(resumed[it] - full[it]) <= 1e-6, (it, resumed[it], full[it])
    get_pool(1).run(launch_task, flags=FLAGS + f"--train-iters 4 --load {root} --ckpt-step 2 "
                                               f"--log-json {tmp_path / 'world1.json'}")
    world1 = _losses(tmp_path / "world1.json")
    for it in (3, 4):
        assert abs(world1[it] - full[it]) <= 1e-5, (it, world1[it], full[it])


def test_a_converted_checkpoint_starts_a_fine_tune_and_sgd_keeps_the_dtensor_layout(pool2, tmp_path):
    first = tmp_path / "first"
    pool2.run(launch_task, flags=FLAGS + f"--train-iters 2 --save {first} --save-interval 2")
    # fsdp_dtensor is a faithful second copy of the weights; its torch_dist conversion holds weights only.
    convert_args = ["--input", str(first), "--output", str(tmp_path / "dt"), "--output-format", "fsdp_dtensor"]
    assert pool2.run(convert_task, argv=convert_args) == [0, 0]
    assert pool2.run(convert_task, argv=["--input", str(tmp_path / "dt"), "--output", str(tmp_path / "td"),
                                         "--output-format", "torch_dist"]) == [0, 0]
    lines = pool2.run(launch_task, flags=FLAGS + f"--train-iters 1 --load {tmp_path / 'td'}")[0]
    assert any("a weights-only checkpoint" in line for line in lines), lines

    sgd = pool2.run(launch_task, flags=FLAGS + f"--optimizer sgd --train-iters 2 --save {tmp_path / 'sgd'} "
                                               "--save-interval 2")[0]
    assert any("saved in the fsdp_dtensor layout instead" in line and "--optimizer sgd" in line for line in sgd)
    assert (tmp_path / "sgd" / "iter_0000002" / ".metadata").is_file()
    assert not (tmp_path / "sgd" / "iter_0000002" / "metadata.json").exists()


def convert_task(rank: int, world: int, *, argv: list[str]) -> int:
    from megatron_fsdp.convert.cli import main

    return main(argv)


# TransformerEngine's spec fuses the norms into the next linear: models.mcore names the local spec's.
_TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
             "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def _stacked_key(name: str) -> tuple[str, int | None]:
    """models.mcore's per-layer name -> (the torch_dist key with layers stacked, layer index)."""
    if not name.startswith("decoder.layers."):
        return name, None
    _, _, index, rest = name.split(".", 3)
    return f"decoder.layers.{_TE_NORMS.get(rest, rest)}", int(index)


def megatron_core_reads_task(rank: int, world: int, *, torch_dist_dir: str, dtensor_root: str) -> dict:
    import megatron_fsdp as mf
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors
    from megatron_fsdp.convert.model_io import open_checkpoint
    from megatron_fsdp.models.mcore import to_mcore_state_dict

    theirs = load_plain_tensors(torch_dist_dir)  # whole tensors, with common.pt's entries beside
    model, source = open_checkpoint(dtensor_root)
    want = to_mcore_state_dict(mf.get_full_state_dict(model), source.config)
    diffs = {}
    for name, tensor in want.items():
        key, layer = _stacked_key(name)
        got = theirs[key] if layer is None else theirs[key][layer]
        diffs[name] = (got.float() - tensor.float()).abs().max().item() if got.shape == tensor.shape else float("inf")
    model_keys = {k for k, v in theirs.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer.")}
    covered = {_stacked_key(name)[0] for name in want}
    return dict(max_diff=max(diffs.values()), compared=len(diffs), uncovered=sorted(model_keys - covered))


def test_megatron_core_reads_the_weights_the_run_trained(pool2, tmp_path):
    pool2.run(launch_task, flags=FLAGS + f"--train-iters 2 --save {tmp_path / 'td'} --save-interval 2")
    pool2.run(launch_task, flags=FLAGS.replace("--ckpt-format torch_dist", "--ckpt-format fsdp_dtensor") +
              f"--train-iters 2 --save {tmp_path / 'dt'} --save-interval 2")
    result = pool2.run(megatron_core_reads_task, torch_dist_dir=str(tmp_path / "td" / "iter_0000002"),
                       dtensor_root=str(tmp_path / "dt"))[0]
    assert result["compared"] == 2 * 6 + 3 and result["uncovered"] == [], result
    assert result["max_diff"] <= 1e-5, result
