"""Megatron-LM's legacy ``--ckpt-format torch``: one ``torch.save`` file per checkpoint,

    <save>/iter_0000010/mp_rank_00/model_optim_rng.pt
    <save>/iter_0000010/mp_rank_00/distrib_optim.pt      (--use-distributed-optimizer)
    <save>/latest_checkpointed_iteration.txt

written by data-parallel rank 0 (``mp_rank_00``: tensor and pipeline rank 0, the only
ones here). The file holds Megatron-LM's keys: ``args`` (an ``argparse.Namespace``,
with the consumed-sample counters Megatron-LM resumes from), ``checkpoint_version``,
``iteration``, ``model`` (the unwrapped model's ``state_dict`` in its compute dtype:
bf16/fp16 weights for --bf16/--fp16 runs, as Megatron-LM's module holds them),
``optimizer``, ``opt_param_scheduler``, ``rng_state`` (a list indexed by
data-parallel rank), ``num_floating_point_operations_so_far``; plus ``megatron_fsdp``,
this launcher's exact progress (``TrainState``, loss scale, the optimizer's form and
parameter names).

[Note: torch format optimizer forms] ``optimizer`` takes the form of the Megatron-LM
optimizer class the run's flags select (``OptimizerForm``), so the keys are where
Megatron-LM puts them; the tensors are this launcher's (torch.optim's AdamW state, one
entry per parameter; Megatron-LM's own optimizer internals, e.g. its distributed
optimizer's bucket layout, are not reproduced, and its optimizer state is not read:
``load`` refuses a file without the ``megatron_fsdp`` entry unless --finetune):

* ``FP32`` (fp32 runs without a distributed optimizer; Megatron-LM's FP32Optimizer):
  ``torch.optim``'s ``state_dict``; the main weights are the model's.
* ``FLOAT16`` (--bf16/--fp16; Float16OptimizerWithFloat16Params): ``{"optimizer":
  torch.optim's state_dict, "fp32_from_fp16_params": per param group, the fp32 main
  weights of its bf16/fp16 parameters, "grad_scaler": the loss scaler (--fp16)}``.
* ``DISTRIBUTED`` (--use-distributed-optimizer; DistributedOptimizer): the file holds
  ``{"optimizer": {"param_groups": hyper-parameters without "params"}, "grad_scaler"}``
  and ``distrib_optim.pt`` beside it the parameter state: ``param`` (the fp32 main
  weights, per param group) and ``state`` (torch.optim's per-parameter state), every
  tensor whole, tagged ``"format": "megatron_fsdp"`` (Megatron-LM's has its bucket
  layout instead).

[Note: torch format on the sharded engine] The Megatron-core DDP path (--bf16,
--fp16, --use-distributed-optimizer, --ddp-average-in-collective) trains on Megatron-
FSDP's ``no_shard``/``optim`` strategies, whose main weights and optimizer state are
DTensor pieces. The writer (global rank 0) collects them whole into its host memory
shard by shard, one parameter group and state key at a time
(``gather_items_to`` in ``megatron_fsdp/state/gather.py``, over a gloo group as Megatron-LM's
distributed-optimizer save does): no rank holds a group unsharded on the device and
only rank 0's host holds the checkpoint; under ``no_shard`` every rank has it all and
rank 0 copies its own. Loading: every rank reads the model file (as in Megatron-LM)
and ``distrib_optim.pt`` memory-mapped, and the engine's ``load_state_dict`` hooks cut
each whole tensor into this rank's piece where it lies (only the piece's pages are
read), so the data-parallel size may differ from the saving run's. Each file's form
loads into any run of the same model: the main weights come from the fp32 entries
(``fp32_from_fp16_params`` / ``param``, else the fp32 model entry) when the
optimizer state is loaded, from the model entry otherwise (--no-load-optim,
--finetune: Megatron-LM's ``reload_model_params``); the model weights are their cast.
Megatron-FSDP (--use-megatron-fsdp) and FSDP2 stay refused (Megatron-LM's rules:
fsdp_dtensor / torch_dist).

[Note: torch format integrity] As the DCP checkpoints here, the files are staged in
``iter_X.tmp`` and renamed once complete, their SHA-256 digests are recorded beside
them (``checksums.json``, absent from Megatron-LM-written checkpoints) and checked
before they are read, and the tracker names the iteration only after that
(``publish_checkpoint``). A load checks the model's keys and shapes and the
optimizer's groups, parameter names and state shapes before anything changes.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import shutil
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron_fsdp.state import CheckpointReadError, CheckpointWriteError, StateDictMismatchError, file_sha256

from .dcp_checkpoint import checkpoint_dir, checkpoint_module, publish_checkpoint, read_tracker

logger = logging.getLogger(__name__)

MODEL_FILE = os.path.join("mp_rank_00", "model_optim_rng.pt")
"""Megatron-LM's ``get_checkpoint_name`` for tensor rank 0 without pipeline parallelism."""
DISTRIB_OPTIM_FILE = os.path.join("mp_rank_00", "distrib_optim.pt")
"""Megatron-LM's ``get_distributed_optimizer_checkpoint_name``: beside the model file."""
CHECKSUM_FILE = "checksums.json"
CHECKPOINT_VERSION = 3.0
"""Megatron-LM's current ``checkpoint_version`` (its loader fixes up older QKV layouts)."""
LAUNCHER_KEY = "megatron_fsdp"
"""This launcher's own progress entry: what a resumed run needs to match an
uninterrupted one exactly, which Megatron-LM's keys spread over ``args``."""
DISTRIB_FORMAT = "megatron_fsdp"
"""``distrib_optim.pt``'s ``format`` tag: whole tensors per parameter (Megatron-LM's
file has its buckets' flat layout and no such tag)."""


class CheckpointFormat(enum.Enum):
    """Megatron-LM's ``--ckpt-format`` values."""

    TORCH = "torch"
    """Legacy: one ``torch.save`` file from data-parallel rank 0 (this module)."""
    TORCH_DIST = "torch_dist"
    """Megatron-LM's distributed format; DCP shards here (``dcp_checkpoint.py``)."""
    TORCH_DCP = "torch_dcp"
    """torch.distributed.checkpoint directories."""
    FSDP_DTENSOR = "fsdp_dtensor"
    """DCP directories of Megatron-FSDP's DTensors."""


class OptimizerForm(enum.Enum):
    """The ``optimizer`` entry's form: Megatron-LM's optimizer class for the run's flags
    ([Note: torch format optimizer forms])."""

    FP32 = "fp32"
    """FP32Optimizer: torch.optim's state dict."""
    FLOAT16 = "float16"
    """Float16OptimizerWithFloat16Params: ``optimizer``, ``fp32_from_fp16_params``, ``grad_scaler``."""
    DISTRIBUTED = "distributed"
    """DistributedOptimizer: param groups (and ``grad_scaler``) here, parameter state in distrib_optim.pt."""

    @classmethod
    def of_run(cls, args: argparse.Namespace) -> "OptimizerForm":
        if args.use_distributed_optimizer:
            return cls.DISTRIBUTED
        return cls.FLOAT16 if (args.bf16 or args.fp16) else cls.FP32


def option_problems(args: argparse.Namespace) -> list[str]:
    """The flag combinations ``--ckpt-format torch`` cannot run, each with its fix
    (validation.py calls this before any process group starts)."""
    if CheckpointFormat(args.ckpt_format) is not CheckpointFormat.TORCH:
        return []
    problems = []
    if args.use_megatron_fsdp:  # Megatron-LM: "Megatron-FSDP requires the fsdp_dtensor checkpointing format"
        problems.append("--ckpt-format torch cannot be used with --use-megatron-fsdp (Megatron-LM's rule: "
                        "Megatron-FSDP requires --ckpt-format fsdp_dtensor, since its weights are sharded and the "
                        "torch format is one whole-tensor file); use --ckpt-format fsdp_dtensor")
    elif args.use_distributed_optimizer and not args.use_gloo_process_groups:
        # Megatron-LM: "Legacy checkpointing uses Gloo process groups to collect full distributed
        # optimizer state in the CPU memory of DP rank 0" (assert args.use_dist_ckpt).
        problems.append("--ckpt-format torch with --use-distributed-optimizer collects the sharded optimizer state "
                        "in rank 0's host memory over a gloo process group, which --disable-gloo-process-groups "
                        "forbids (Megatron-LM's rule); drop --disable-gloo-process-groups or use --ckpt-format "
                        "torch_dist")
    if args.async_save:  # Megatron-LM: "Async checkpoint save not implemented for legacy checkpoints"
        problems.append("--async-save with --ckpt-format torch: Megatron-LM has no asynchronous save for its legacy "
                        "torch format (it fails at the first save); drop --async-save or use --ckpt-format "
                        "torch_dist")
    return problems


def model_file(root: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir(root, iteration), MODEL_FILE)


def distrib_optim_file(root: str, iteration: int) -> str:
    return os.path.join(checkpoint_dir(root, iteration), DISTRIB_OPTIM_FILE)


def holds_checkpoint(root: str, step: Optional[int] = None) -> bool:
    """Whether the checkpoint ``--load root`` (``--ckpt-step step``) names is in the torch
    format; Megatron-LM's loader tells the formats apart by the ``mp_rank_*`` entries."""
    iteration = read_tracker(root) if step is None else step
    if iteration is None:
        return False
    directory = checkpoint_dir(root, iteration)
    if not os.path.isdir(directory):
        return False
    ranks = sorted(name for name in os.listdir(directory) if name.startswith("mp_rank_"))
    if not ranks:
        return False
    if ranks != ["mp_rank_00"]:  # tensor/pipeline-parallel files: not this launcher's layout
        raise CheckpointReadError(
            f"{directory} holds Megatron-LM torch-format files {ranks} of a model-parallel run; only a single "
            "mp_rank_00 (tensor and pipeline size 1) can be read here. Convert it to one rank first")
    return True


# -- the engine's side --------------------------------------------------------------------
def engine_of(model):
    """The Megatron-FSDP engine (``MegatronFSDP``) training ``model``, or None for PyTorch
    DDP (whose module holds whole tensors on every rank)."""
    from megatron_fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron_fsdp.megatron_fsdp import MegatronFSDP

    if isinstance(model, FullyShardedDataParallel):
        return model.module
    return model if isinstance(model, MegatronFSDP) else None


def _param_keys(model, engine, optimizer: torch.optim.Optimizer) -> list[list[tuple[str, list[str]]]]:
    """For each optimizer param group, each parameter's (name, every key the model
    entry holds it under: tied weights have several), as ``named_parameters`` names it."""
    from megatron_fsdp.state import alias_names, torch_key

    keys_of: dict[int, tuple[str, list[str]]] = {}
    if engine is None:
        for name, param in checkpoint_module(model).named_parameters(remove_duplicate=False):
            keys_of.setdefault(id(param), (name, []))[1].append(name)
    else:
        buffer = engine.param_and_grad_buffer
        by_raw = {raw: param for raw, param in buffer.named_dist_params()}
        for alias, raw in alias_names(engine).items():
            keys_of.setdefault(id(by_raw[raw]), (torch_key(raw), []))[1].append(alias)
    out = []
    for group in optimizer.param_groups:
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in keys_of]
        if missing:
            raise RuntimeError(f"--ckpt-format torch: optimizer parameters of shapes {missing} are not the model's")
        out.append([keys_of[id(p)] for p in group["params"]])
    return out


def _host_group() -> tuple[Optional[dist.ProcessGroup], torch.device]:
    """The group and device the writer's gathers travel through: host memory over gloo,
    as Megatron-LM's distributed-optimizer save (the default group when it is gloo; else
    one gloo group, made once, collectively, at the first save)."""
    if dist.get_backend() == "gloo":
        return None, torch.device("cpu")
    default = dist.distributed_c10d._get_default_group()
    group = _HOST_GROUPS.get(id(default))
    if group is None:
        group = _HOST_GROUPS[id(default)] = dist.new_group(backend="gloo")
    return group, torch.device("cpu")


_HOST_GROUPS: dict[int, dist.ProcessGroup] = {}


def _gather_engine(engine, optimizer) -> Optional[dict]:
    """On rank 0: the model entry, the full fp32 main weights (by ``named_parameters``
    name) and torch.optim's state dict with whole tensors; None elsewhere. Collective
    ([Note: torch format on the sharded engine])."""
    from megatron_fsdp.state import gather_main_weights_to, gather_optimizer_state_to, module_state_dict_from, torch_key

    sharded = any(g.strategy.shards_optimizer and g.optimizer_layout.world_size > 1
                  for g in engine.param_and_grad_buffer.groups)
    # Replicated state (no_shard) moves nowhere: rank 0 copies its own, and no gloo group is made.
    group, device = _host_group() if sharded else (None, torch.device("cpu"))
    main = gather_main_weights_to(engine, dst=0, pg=group, comm_device=device)
    torch_optim = gather_optimizer_state_to(optimizer, dst=0, pg=group, comm_device=device)
    if dist.get_rank() != 0:
        return None
    return {"model": module_state_dict_from(engine, main), "optimizer": torch_optim,
            "main": {torch_key(raw): value for raw, value in main.items()}}


# -- save ---------------------------------------------------------------------------------
def save(root: str, iteration: int, model, optimizer, extra_state: dict, args: argparse.Namespace, *,
         retain_interval: Optional[int] = None) -> str:
    """Collective: every rank contributes its RNG state (and its shards of the main
    weights and optimizer state on the sharded engine), data-parallel rank 0 writes the
    file(s), then the tracker moves (``publish_checkpoint``). ``extra_state`` is the
    launcher's (``checkpoint_extra_state`` in ``training/pretrain_gpt.py``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = engine_of(model)
    form = OptimizerForm.of_run(args) if engine is not None else OptimizerForm.FP32
    if engine is None:  # PyTorch DDP: whole tensors on every rank
        module_state = checkpoint_module(model).state_dict()
        optimizer_state = optimizer.state_dict()
        _require_whole_tensors(module_state, "the model")
        _require_whole_tensors(optimizer_state, "the optimizer")
        gathered = {"model": module_state, "optimizer": optimizer_state, "main": None} if rank == 0 else None
    else:
        gathered = _gather_engine(engine, optimizer)
    names = [[name for name, _ in group] for group in _param_keys(model, engine, optimizer)]
    rng_states: list = [None] * world
    dist.all_gather_object(rng_states, _megatron_rng(extra_state["rng"]))
    directory = checkpoint_dir(root, iteration)
    failure = [None]
    if rank == 0:
        train_state = extra_state["train_state"]
        optimizer_entry, distrib = _optimizer_entries(form, gathered, names, extra_state.get("loss_scaler"))
        state = {
            "args": _saved_args(args, train_state),
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "model": gathered["model"],
            "optimizer": optimizer_entry,
            "opt_param_scheduler": extra_state["lr_schedule"],
            "rng_state": rng_states,
            "num_floating_point_operations_so_far": train_state["floating_point_operations_so_far"],
            LAUNCHER_KEY: {"train_state": train_state, "loss_scaler": extra_state.get("loss_scaler"),
                           "optimizer_form": form.value, "param_names": names},
        }
        files = {MODEL_FILE: state}
        if distrib is not None:
            files[DISTRIB_OPTIM_FILE] = distrib
        try:
            _write(directory, files)
        except Exception as exc:  # every rank must learn of it, or the others wait at the next collective
            failure = [f"{type(exc).__name__}: {exc}"]
        del gathered, state, files, distrib
    dist.broadcast_object_list(failure, src=0)
    if failure[0] is not None:
        raise CheckpointWriteError(
            f"rank 0 could not write the torch-format checkpoint {os.path.join(directory, MODEL_FILE)} "
            f"({failure[0]}); nothing was published and the tracker still names the previous checkpoint")
    if rank == 0:
        publish_checkpoint(root, iteration, retain_interval)
    dist.barrier()
    logger.info("  successfully saved checkpoint from iteration %7d to %s (torch format)", iteration, root)
    return directory


def _optimizer_entries(form: OptimizerForm, gathered: dict, names: list[list[str]],
                       scaler: Optional[dict]) -> tuple[Any, Optional[dict]]:
    """(the model file's ``optimizer`` entry, ``distrib_optim.pt``'s content or None)
    in Megatron-LM's form for ``form`` ([Note: torch format optimizer forms])."""
    torch_optim, main, model_entry = gathered["optimizer"], gathered["main"], gathered["model"]
    if form is OptimizerForm.FP32:
        return torch_optim, None
    grad_scaler = _megatron_grad_scaler(scaler)
    if form is OptimizerForm.FLOAT16:
        # Megatron-LM lists the fp32 copies of its bf16/fp16 parameters only (fp32 ones are their own main weights).
        entry = {"optimizer": torch_optim,
                 "fp32_from_fp16_params": [[main[name] for name in group if model_entry[name].dtype in _HALF]
                                           for group in names]}
        if grad_scaler is not None:
            entry["grad_scaler"] = grad_scaler
        return entry, None
    groups = [{k: v for k, v in group.items() if k != "params"} for group in torch_optim["param_groups"]]
    entry = {"optimizer": {"param_groups": groups}}
    if grad_scaler is not None:
        entry["grad_scaler"] = grad_scaler
    distrib = {"format": DISTRIB_FORMAT, "param": [[main[name] for name in group] for group in names],
               "state": torch_optim["state"]}
    return entry, distrib


_HALF = (torch.float16, torch.bfloat16)


def _megatron_grad_scaler(scaler: Optional[dict]) -> Optional[dict]:
    """The loss scaler under Megatron-LM's ``grad_scaler`` names (DynamicGradScaler's
    ``scale``/``growth_tracker``/``hysteresis_tracker``; ConstantGradScaler's is empty);
    None for bf16/fp32 runs, which have none. The launcher resumes from its own copy."""
    if scaler is None:
        return None
    if not scaler.get("dynamic"):
        return {}
    return {"scale": torch.tensor([float(scaler["scale"])]), "growth_tracker": scaler["_growth_tracker"],
            "hysteresis_tracker": scaler["_hysteresis_tracker"]}


def _require_whole_tensors(state: Any, owner: str, key: str = "") -> None:
    """An internal guard behind ``option_problems``: a DTensor here would be one rank's shard."""
    if isinstance(state, DTensor):
        raise TypeError(f"--ckpt-format torch: {owner}'s state {key!r} is a DTensor shard, but this format saves "
                        "whole tensors from rank 0 only; use --ckpt-format torch_dist")
    if isinstance(state, dict):
        for name, value in state.items():
            _require_whole_tensors(value, owner, f"{key}.{name}" if key else str(name))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            _require_whole_tensors(value, owner, f"{key}[{index}]")


def _plain(value: Any) -> bool:
    # Exact types: an IntEnum or str-valued enum is an int/str subclass that weights_only refuses.
    if value is None or type(value) in (bool, int, float, str):
        return True
    return type(value) in (list, tuple) and all(_plain(v) for v in value)


def plain_args(args: argparse.Namespace) -> dict[str, Any]:
    """The launcher's plain-valued arguments (the derived objects and enums are rebuilt from
    the flags), which a ``weights_only`` load reads back: what a checkpoint keeps of the run's
    flags, so that a converter or a later run knows the architecture."""
    return {k: v for k, v in vars(args).items() if _plain(v)}


def _saved_args(args: argparse.Namespace, train_state: dict) -> argparse.Namespace:
    """Megatron-LM saves its ``args``; here the plain-valued ones (``plain_args``), so the
    file loads with ``weights_only``. Megatron-LM resumes its sample counters from these
    three attributes."""
    saved = argparse.Namespace(**plain_args(args))
    saved.consumed_train_samples = train_state["consumed_train_samples"]
    saved.skipped_train_samples = train_state.get("skipped_train_samples", 0)
    saved.consumed_valid_samples = train_state.get("consumed_valid_samples", 0)
    return saved


def _megatron_rng(rng: dict) -> dict:
    """The launcher's RNG state (``checkpointing.rng_state``) under Megatron-LM's names."""
    return {"random_rng_state": rng["python"], "np_rng_state": np.random.get_state(),
            "torch_rng_state": rng["torch"], "cuda_rng_state": rng.get("device"),
            "rng_tracker_states": rng.get("tracker") or {}}


def _write(directory: str, files: dict[str, Any]) -> None:
    """Stage ``directory + '.tmp'`` (each of ``files``: relative path -> object to
    ``torch.save``), then swap it in: a crash leaves no half-written ``iter_*`` behind
    (a previous save of the same iteration is replaced whole)."""
    staging = directory + ".tmp"
    shutil.rmtree(staging, ignore_errors=True)  # leftovers of a crashed save
    digests: dict[str, dict[str, str]] = {}
    for relative, content in files.items():
        path = os.path.join(staging, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            torch.save(content, f)
            f.flush()
            os.fsync(f.fileno())
        digests.setdefault(os.path.dirname(path), {})[os.path.basename(path)] = file_sha256(path)
    for folder, table in digests.items():
        with open(os.path.join(folder, CHECKSUM_FILE), "w") as f:
            json.dump(table, f)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)


# -- load ---------------------------------------------------------------------------------
def load(root: str, model, optimizer, *, step: Optional[int] = None, finetune: bool = False) -> dict:
    """Load the torch-format checkpoint ``holds_checkpoint`` found into ``model`` and
    ``optimizer`` (None: keep the optimizer as it is; the main weights then come from the
    model entry) and return the launcher's extra state for this rank (``train_state``,
    ``lr_schedule``, ``loss_scaler``, ``rng``). ``finetune``: the caller reads only the
    weights, so a file without this launcher's progress (one Megatron-LM wrote) is fine.
    Every check runs before anything changes. Collective on the sharded engine."""
    iteration = read_tracker(root) if step is None else step
    path = model_file(root, iteration)
    _verify_checksum(path)
    saved = _read(path)
    launcher = saved.get(LAUNCHER_KEY)
    if launcher is None and not finetune:
        raise CheckpointReadError(
            f"{path} has no '{LAUNCHER_KEY}' progress entry: it was not written by this launcher (Megatron-LM's "
            "optimizer and schedule states differ from this one's), so only its weights can be read; add "
            "--finetune (weights only, iteration 0)")
    engine = engine_of(model)
    _check_model(saved.get("model"), _live_model(model, engine), path)
    weights = dict(saved["model"])
    torch_optim = None
    if optimizer is not None:
        progress = launcher or {}  # a Megatron-LM file read with --finetune has none (its optimizer is not read)
        form = OptimizerForm(progress.get("optimizer_form", OptimizerForm.FP32.value))
        distrib = None
        if form is OptimizerForm.DISTRIBUTED:
            distrib_path = distrib_optim_file(root, iteration)
            _verify_checksum(distrib_path)
            distrib = _read(distrib_path, key="param", mmap=True)
            if distrib.get("format") != DISTRIB_FORMAT:
                raise CheckpointReadError(f"{distrib_path} is not this launcher's (no format tag "
                                          f"{DISTRIB_FORMAT!r}); add --no-load-optim or --finetune")
        keys = _param_keys(model, engine, optimizer)
        saved_names = progress.get("param_names")
        if saved_names is not None and saved_names != [[name for name, _ in group] for group in keys]:
            raise StateDictMismatchError(
                f"{path}: the optimizer's parameter groups hold {saved_names}, this run's "
                f"{[[name for name, _ in group] for group in keys]} (nothing was loaded); build the same model and "
                "optimizer (--decoupled-lr and --apply-wd-to-qk-layernorm change the groups), or add --no-load-optim")
        torch_optim, main = _normalized_optimizer(form, saved, distrib, keys, path)
        _check_optimizer(torch_optim, optimizer, path)
        _check_main(main, keys, optimizer, path)
        for group_main, group_keys in zip(main, keys):
            for value, (_, aliases) in zip(group_main, group_keys):
                if value is not None:
                    weights.update(dict.fromkeys(aliases, value))
        if engine is None and distrib is not None:  # PyTorch DDP keeps what it is given: no memory-mapped state
            torch_optim = _private_copy(torch_optim)
    if engine is None:
        checkpoint_module(model).load_state_dict(weights)
    else:
        model.load_state_dict(weights)  # every rank keeps its piece of each whole tensor (model_state_dict.py)
    if optimizer is not None:
        optimizer.load_state_dict(torch_optim)  # the engine's pre-hook cuts the pieces (optimizer_state_dict.py)
    logger.info("  successfully loaded checkpoint from %s [ iteration %d ] (torch format)", root, iteration)
    if launcher is None:
        return {}
    return {"train_state": launcher["train_state"], "lr_schedule": saved["opt_param_scheduler"],
            "loss_scaler": launcher.get("loss_scaler"), "rng": _own_rng(saved.get("rng_state"), path)}


def _live_model(model, engine) -> dict:
    """The model entry's expected keys with values of the right shapes, read without
    gathering anything (the engine's distributed parameters carry whole shapes)."""
    if engine is None:
        return checkpoint_module(model).state_dict()
    from megatron_fsdp.state import sharded_state_dict

    return sharded_state_dict(engine, keep_vars=True, module_prefix=False, extra_state=True)


def _normalized_optimizer(form: OptimizerForm, saved: dict, distrib: Optional[dict],
                          keys: list[list[tuple[str, list[str]]]], path: str) -> tuple[dict, list[list]]:
    """(torch.optim's state dict with whole tensors, per param group each parameter's
    fp32 main weights or None where the model entry holds them) from any form."""
    entry = saved.get("optimizer")
    try:
        if form is OptimizerForm.FP32:
            return entry, [[None] * len(group) for group in keys]
        if form is OptimizerForm.FLOAT16:
            lists = iter(entry["fp32_from_fp16_params"])
            main = []
            for group in keys:
                fp32 = iter(next(lists))
                main.append([next(fp32) if saved["model"][name].dtype in _HALF else None for name, _ in group])
                if next(fp32, None) is not None:
                    raise ValueError("more fp32_from_fp16_params than half-precision parameters")
            return entry["optimizer"], main
        groups, start = [], 0
        for group, params in zip(entry["optimizer"]["param_groups"], distrib["param"], strict=True):
            groups.append({**group, "params": list(range(start, start + len(params)))})
            start += len(params)
        return {"state": distrib["state"], "param_groups": groups}, [list(group) for group in distrib["param"]]
    except (KeyError, TypeError, ValueError, StopIteration) as exc:
        raise CheckpointReadError(f"{path}: its {form.value} optimizer entry is malformed ({type(exc).__name__}: "
                                  f"{exc}); nothing was loaded. Add --no-load-optim to start the optimizer fresh") from exc


def _check_main(main: list[list], keys: list[list[tuple[str, list[str]]]], optimizer, path: str) -> None:
    for group_main, group_keys, group in zip(main, keys, optimizer.param_groups):
        if len(group_main) != len(group_keys):
            raise StateDictMismatchError(f"{path}: {len(group_main)} main weights for a group of "
                                         f"{len(group_keys)} parameters (nothing was loaded); add --no-load-optim")
        for value, (name, _), param in zip(group_main, group_keys, group["params"]):
            if value is not None and tuple(value.shape) != tuple(param.shape):
                raise StateDictMismatchError(f"{path}: main weights of {name} are {tuple(value.shape)}, the parameter "
                                             f"{tuple(param.shape)} (nothing was loaded); add --no-load-optim")


def _private_copy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: _private_copy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_private_copy(v) for v in state]
    return state


def _verify_checksum(path: str) -> None:
    """Rank 0 hashes the file against ``checksums.json`` (when the writer recorded one)
    and every rank raises on a mismatch, before any rank reads it."""
    verdict = [None]
    if dist.get_rank() == 0:
        table_path = os.path.join(os.path.dirname(path), CHECKSUM_FILE)
        if os.path.isfile(table_path):
            try:
                with open(table_path) as f:
                    expected = json.load(f).get(os.path.basename(path))
                if expected is not None and os.path.isfile(path) and file_sha256(path) != expected:
                    verdict = ["does not match its checksum (altered or truncated)"]
            except (OSError, ValueError) as exc:
                verdict = [f"has an unreadable {CHECKSUM_FILE} ({exc})"]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise CheckpointReadError(f"the checkpoint file {path} {verdict[0]}; nothing was loaded. Load an "
                                  "earlier checkpoint (--ckpt-step)")


def _safe_globals() -> list:
    """What a torch-format file holds besides tensors and builtins: the args namespace and
    numpy's RNG state (Megatron-LM allows the same list in megatron/core/safe_globals.py)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    return [argparse.Namespace, np.ndarray, np.dtype, _reconstruct, type(np.dtype(np.uint32))]


def _read(path: str, *, key: str = "model", mmap: bool = False) -> dict:
    """``mmap``: tensors stay in the file until read (each rank then reads the pages of
    its own pieces only)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no torch-format checkpoint file {path}; point --load (or --ckpt-step) at a "
                                "saved iteration")
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            # On the host: a file saved from GPU tensors must not land on the saving device.
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:
        raise CheckpointReadError(f"could not read {path} ({type(exc).__name__}: {exc}); nothing was loaded. Load "
                                  "an earlier checkpoint (--ckpt-step)") from exc
    if not isinstance(saved, dict) or key not in saved:
        raise CheckpointReadError(f"{path} is not a Megatron-LM torch-format checkpoint file (no {key!r} entry)")
    return saved


def _check_model(saved: Any, live: dict, path: str) -> None:
    if not isinstance(saved, dict):
        raise CheckpointReadError(f"{path}: its 'model' entry is {type(saved).__name__}, not a state dict")
    missing = [k for k in live if k not in saved]
    unexpected = [k for k in saved if k not in live]
    mismatched = [f"{k}: checkpoint {tuple(getattr(saved[k], 'shape', ()))} vs model {tuple(v.shape)}"
                  for k, v in live.items()
                  if k in saved and isinstance(v, torch.Tensor) and tuple(getattr(saved[k], "shape", ())) != v.shape]
    if missing or unexpected or mismatched:
        raise StateDictMismatchError(
            f"{path} does not fit this model (nothing was loaded): missing keys {missing}, unexpected keys "
            f"{unexpected}, shape mismatches {mismatched}. Build the same architecture as the run that saved it")


def _check_optimizer(saved: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """What ``Optimizer.load_state_dict`` would refuse (group and parameter counts) and
    what it would not notice (state tensors shaped for other parameters), checked first."""
    if not isinstance(saved, dict) or "param_groups" not in saved or "state" not in saved:
        raise CheckpointReadError(f"{path} holds no torch.optim optimizer state; add --no-load-optim to start the "
                                  "optimizer fresh")
    groups = optimizer.param_groups
    counts = [len(g["params"]) for g in saved["param_groups"]]
    if counts != [len(g["params"]) for g in groups]:
        raise StateDictMismatchError(
            f"{path}: the optimizer's parameter groups hold {counts} parameters, this run's "
            f"{[len(g['params']) for g in groups]} (nothing was loaded); build the same model and optimizer, or add "
            "--no-load-optim")
    params = {pid: p for saved_group, group in zip(saved["param_groups"], groups)
              for pid, p in zip(saved_group["params"], group["params"])}
    for pid, entry in saved["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != params[pid].shape:
                raise StateDictMismatchError(
                    f"{path}: optimizer state {name!r} of parameter {pid} is {tuple(value.shape)}, the parameter "
                    f"{tuple(params[pid].shape)} (nothing was loaded); add --no-load-optim")


def _own_rng(entries: Any, path: str) -> dict:
    """This rank's generators from ``rng_state``: its own entry when the file has one per
    data-parallel rank (as written here), else entry 0 (Megatron-LM's file without
    --data-parallel-random-init, or another data-parallel size), in the launcher's names
    (``checkpointing.set_rng_state``)."""
    if not entries:
        raise CheckpointReadError(f"{path} holds no rng_state; add --no-load-rng to keep this run's generators")
    rank = dist.get_rank()
    entry = entries[rank] if len(entries) == dist.get_world_size() else entries[0]
    return {"python": entry["random_rng_state"], "torch": entry["torch_rng_state"],
            "device": entry.get("cuda_rng_state"), "numpy": entry.get("np_rng_state"),
            "tracker": entry.get("rng_tracker_states")}
