"""Megatron-LM flags that kept its functional-test recipes and example scripts from
running here, each accepted only where it provably changes no
value, or refused as Megatron-LM refuses it:

* ``--fine-grained-activation-offloading`` and its knobs (a host copy of saved
  activations), ``--use-transformer-engine-op-fuser`` (kernel fusion),
  ``--error-injection-rate/-type`` with ``--rerun-mode disabled`` (megatron-core never
  consults the injector then), ``--no-position-embedding`` with rotary positions, and
  ``--async-save`` with ``--disable-gloo-process-groups`` (written synchronously): a run
  with all of them trains the very same numbers and writes the very same checkpoint as
  the run without them, and each warns once;
* the recipe runner's ``"[a b c]"`` list values become separate tokens, as Megatron-LM's
  ``_run_training.sh`` passes them;
* what Megatron-LM or megatron-core refuse, or what would change a value here (a
  positive error-injection rate while results are validated), is refused with the fix.
"""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from launcher_inprocess import run_launcher
from megatron_fsdp.training.args.arg_types import ArgumentError
from megatron_fsdp.training.args.arguments import parse_args

BASE = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 4 --lr 3e-3 --adam-eps 1e-4 --seed 7 "
        "--position-embedding-type rope --clip-grad 1.0 --mock-data --tokenizer-type NullTokenizer "
        "--vocab-size 64 --log-interval 1 --eval-iters 0 --plot-path none --save-interval 2 ")
NEUTRAL = {
    "--transformer-impl transformer_engine": None,  # noop-only, warns (already in the table)
    "--fine-grained-activation-offloading": "--fine-grained-activation-offloading",
    "--offload-modules core_attn attn_proj mlp_norm qkv_linear": "--offload-modules",
    "--min-offloaded-tensor-size 0": "--min-offloaded-tensor-size",
    "--activation-offload-fraction 0.5": "--activation-offload-fraction",
    "--fine-grained-offloading-max-inflight-offloads 2": "--fine-grained-offloading-max-inflight-offloads",
    "--use-transformer-engine-op-fuser": "--use-transformer-engine-op-fuser",
    "--rerun-mode disabled --error-injection-rate 100": "--error-injection-rate",
    "--error-injection-type persistent_error": "--error-injection-type",
    "--no-position-embedding": "--no-position-embedding",
    "--async-save --disable-gloo-process-groups": "--async-save with --disable-gloo-process-groups",
}


def run_task(rank: int, world: int, *, flags: str) -> list[str]:
    return run_launcher(BASE + flags, world)


def _weights(directory) -> dict:
    """The model tensors of a torch.distributed.checkpoint directory, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = directory.parent / (directory.name + ".pt")
    dcp_to_torch_save(str(directory), str(target))
    state = torch.load(target, weights_only=False)
    flat = {}

    def walk(prefix, node):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(f"{prefix}{key}.", value)
        elif isinstance(node, torch.Tensor):
            flat[prefix[:-1]] = node

    walk("", state)
    return flat


def test_value_neutral_flags_train_and_save_the_same(pool2, tmp_path):
    plain, flagged = tmp_path / "plain", tmp_path / "flagged"
    pool2.run(run_task, flags=f"--save {plain} --log-json {tmp_path / 'plain.json'}")
    lines = pool2.run(run_task, flags=" ".join(NEUTRAL) + f" --save {flagged} --log-json {tmp_path / 'flagged.json'}")
    runs = [json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "flagged")]
    for key in ("lm_loss", "grad_norm"):
        assert runs[1][key] == runs[0][key], key  # the same computation: bit for bit
    assert runs[0]["iterations"] == [1, 2, 3, 4]
    # Saved synchronously (the background writer needs gloo), published as usual, the same tensors.
    assert not any("asynchronous" in line for line in lines[0]), lines[0]
    for root in (plain, flagged):
        assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    a, b = _weights(plain / "iter_0000004"), _weights(flagged / "iter_0000004")
    assert a.keys() == b.keys() and len(a) > 4
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_each_value_neutral_flag_warns_once():
    args = parse_args(shlex.split(BASE + "--save /tmp/unused " + " ".join(NEUTRAL)), world_size=2)
    for flag in filter(None, NEUTRAL.values()):
        hits = [w for w in args.flag_warnings if w.startswith(flag + " ") or w.startswith(flag + ":")]
        assert len(hits) == 1, (flag, args.flag_warnings)
    assert args.async_save is False  # Megatron-LM's way: the flag turned off, with the warning


def test_recipe_bracket_lists_become_tokens(tmp_path):
    """Megatron-LM's recipe runner strips "[...]" and passes the words (``_run_training.sh``)."""
    config = tmp_path / "model_config.yaml"
    body = "".join(f"  {flag}: {value}\n" for flag, value in (
        ("--fine-grained-activation-offloading", "true"),
        ("--offload-modules", '"[expert_fc1 moe_act core_attn attn_proj]"'),
        ("--recompute-modules", '"[moe_act]"'),
        ("--num-experts", "4"), ("--moe-layer-freq", '"[1,0]"')))
    config.write_text("MODEL_ARGS:\n" + body)
    args = parse_args(["--config", str(config)] + shlex.split(BASE), world_size=1)
    assert args.offload_modules == ["expert_fc1", "moe_act", "core_attn", "attn_proj"]
    assert args.recompute_modules == ["moe_act"]
    assert args.moe_layer_freq == [1, 0]  # a single-valued flag's list expression stays as written
    # A plain config file (this launcher's form) keeps the value as written.
    config.write_text('recompute-modules: "[moe_act]"\n')
    assert parse_args(["--config", str(config)] + shlex.split(BASE), world_size=1).recompute_modules == ["[moe_act]"]


OFFLOAD = "--fine-grained-activation-offloading --offload-modules "


@pytest.mark.parametrize("flags, message", [
    (OFFLOAD + "core_attn --transformer-impl local", "offloads through TransformerEngine layers only"),
    ("--fine-grained-activation-offloading", "needs --offload-modules"),
    (OFFLOAD + "core_attn mlp", "--offload-modules mlp: not a module megatron-core offloads"),
    (OFFLOAD + "attn_proj", "attn_proj without core_attn"),
    (OFFLOAD + "moe_act --recompute-granularity selective --recompute-modules moe", "recomputed whole"),
    (OFFLOAD + "fused_group_mlp", "needs --use-transformer-engine-op-fuser"),
    (OFFLOAD + "fused_group_mlp expert_fc1 --use-transformer-engine-op-fuser", "already covers them"),
    (OFFLOAD + "core_attn --min-offloaded-tensor-size -1", "must be >= 0"),
    (OFFLOAD + "core_attn --activation-offload-fraction 1.5", r"must be in \[0, 1\]"),
    (OFFLOAD + "core_attn --delta-offload-bytes-across-pp-ranks -4", "must be >= 0"),
    ("--error-injection-rate 100", "--error-injection-rate 100 with --rerun-mode validate_results"),
    ("--error-injection-rate 5 --rerun-mode validate_results --error-injection-type correct_result",
     "pass --error-injection-rate 0 or --rerun-mode disabled"),
    ("--position-embedding-type learned_absolute --no-position-embedding",
     "--no-position-embedding with --position-embedding-type learned_absolute"),
])
def test_refused_combinations(flags, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(shlex.split(BASE + flags), world_size=1)
