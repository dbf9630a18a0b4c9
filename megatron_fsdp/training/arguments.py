"""Flags of ``scripts/pretrain_gpt.py``: Megatron-LM's names and defaults, a YAML
config file whose keys are the same flags, and Megatron-LM's validation rules.

[Note: config precedence] ``--config FILE.yaml`` is expanded into command-line
tokens placed *before* the real command line, so argparse reads the file first and
the user's flags override it; argparse also type-checks and choice-checks the
file's values exactly like typed flags. Keys may be spelt like the flag
(``data-parallel-sharding-strategy``) or like its destination
(``data_parallel_sharding_strategy``); ``true``/``false`` set boolean flags.

Validation runs before ``torch.distributed`` starts (the world size comes from
torchrun's ``WORLD_SIZE``, as in Megatron-LM), so a bad command fails in a second
with one message listing every problem and its fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import os
import sys
from typing import Any, Optional, Sequence

from ..enums import ShardingStrategy

DTYPE_CHOICES = ("fp32", "bf16", "fp16", "auto")
STRATEGY_CHOICES = tuple(s.label for s in ShardingStrategy)
OUTER_STRATEGY_CHOICES = (ShardingStrategy.NO_SHARD.label, ShardingStrategy.OPTIM.label)
BYTE_VOCAB_SIZE = 256


class ArgumentError(ValueError):
    """A flag value or combination the script cannot run; the message names the
    offending value and the fix."""


class LRDecayStyle(enum.Enum):
    """Shape of the learning rate after warmup (Megatron-LM's ``--lr-decay-style``)."""

    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"
    INVERSE_SQUARE_ROOT = "inverse-square-root"


class TokenizerType(enum.Enum):
    """Tokenizers this script can build without downloading anything."""

    BYTE = "ByteTokenizer"
    """One token per UTF-8 byte (vocabulary 256): the embedded corpus needs no files."""
    NULL = "NullTokenizer"
    """Megatron-LM's placeholder tokenizer for ``--mock-data`` with ``--vocab-size``."""


class Precision(enum.Enum):
    """Dtype of the model (compute) weights."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


@dataclasses.dataclass(frozen=True)
class _BoolFlag:
    """The option strings that set one boolean destination to True / to False."""

    on: Optional[str] = None
    off: Optional[str] = None


class MegatronArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors suggest the closest known flag and name the
    config file a bad value came from."""

    config_source: Optional[str] = None

    def error(self, message: str):  # argparse's hook; exits with status 2
        if message.startswith("unrecognized arguments"):
            known = [opt for action in self._actions for opt in action.option_strings]
            hints = []
            for token in message.split(":", 1)[1].split():
                if token.startswith("--"):
                    close = difflib.get_close_matches(token.split("=")[0], known, n=1)
                    hints.append(f"{token} (did you mean {close[0]}?)" if close else token)
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints) + "; see --help for the accepted flags"
        if self.config_source:
            message = f"in config file {self.config_source}: {message}"
        # A short message instead of argparse's full usage dump, which would bury it.
        self.exit(2, f"{self.prog}: error: {message}\n(run with --help to list the accepted flags)\n")


def build_parser() -> MegatronArgumentParser:
    parser = MegatronArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-LM style GPT pretraining with megatron_fsdp (or PyTorch DDP for comparison).",
        allow_abbrev=False,
    )
    parser.add_argument("--config", default=None, help="YAML file whose keys are these flags; flags override it.")
    _add_model_args(parser)
    _add_training_args(parser)
    _add_learning_rate_args(parser)
    _add_mixed_precision_args(parser)
    _add_distributed_args(parser)
    _add_data_args(parser)
    _add_checkpoint_args(parser)
    _add_logging_args(parser)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="Defaults to 4 * hidden size.")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="Only with --tokenizer-type NullTokenizer.")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--recompute-activations", action="store_true", help="Recompute every transformer block.")
    g.add_argument("--use-mcore-models", action="store_true", help="Megatron-core's GPTModel (needs megatron-core).")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None, help="Defaults to micro batch x data-parallel size.")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--exit-interval", type=int, default=None, help="Exit (after saving) at a multiple of this iteration.")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="Gradient-norm clipping; 0 disables clipping.")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Average the loss over all tokens of the global batch instead of per microbatch.")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True, help="Raise on a NaN/Inf loss or gradient (default).")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")


def _add_learning_rate_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("learning rate")
    g.add_argument("--lr", type=float, default=None)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=[s.value for s in LRDecayStyle], default=LRDecayStyle.LINEAR.value)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="Defaults to --train-iters.")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)


def _add_mixed_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true", help="Model weights in bfloat16.")
    g.add_argument("--fp16", action="store_true", help="Model weights in float16, with dynamic loss scaling.")
    g.add_argument("--loss-scale", type=float, default=None, help="Static loss scale (fp16); default: dynamic.")
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_distributed_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("distributed")
    g.add_argument("--use-megatron-fsdp", action="store_true")
    g.add_argument("--use-torch-fsdp2", action="store_true", help="Accepted to report conflicts; not implemented here.")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--data-parallel-sharding-strategy", choices=STRATEGY_CHOICES,
                   default=ShardingStrategy.OPTIM_GRADS_PARAMS.label)
    g.add_argument("--outer-dp-sharding-strategy", choices=OUTER_STRATEGY_CHOICES,
                   default=ShardingStrategy.NO_SHARD.label)
    g.add_argument("--num-distributed-optimizer-instances", type=int, default=1,
                   help="Size of the outer (replica) data-parallel group; > 1 enables HSDP.")
    g.add_argument("--megatron-fsdp-main-params-dtype", choices=DTYPE_CHOICES, default="fp32")
    g.add_argument("--megatron-fsdp-main-grads-dtype", choices=DTYPE_CHOICES, default="auto")
    g.add_argument("--megatron-fsdp-grad-comm-dtype", choices=DTYPE_CHOICES, default="auto")
    g.add_argument("--init-model-with-meta-device", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="Megatron-LM fuses wgrad accumulation on GPUs; the embedded GPT never does.")
    g.add_argument("--fsdp-double-buffer", action="store_true")
    g.add_argument("--use-nccl-ub", action="store_true")
    g.add_argument("--suggested-communication-unit-size", type=int, default=None)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="Default: nccl when CUDA is available, else gloo.")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="Plain-text files, byte-tokenized. Default: the corpus in data/ that ships with the repo.")
    g.add_argument("--mock-data", action="store_true", help="Generated, learnable token sequences.")
    g.add_argument("--split", default="969,30,1", help="train,valid,test weights of the corpus.")
    g.add_argument("--tokenizer-type", choices=[t.value for t in TokenizerType], default=None,
                   help="Default: ByteTokenizer (NullTokenizer with --mock-data --vocab-size).")


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="Load this iteration from --load instead of the tracker file's.")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")


def _add_logging_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-json", default=None, help="Write per-iteration metrics (rank 0) to this JSON file.")
    g.add_argument("--plot-path", default="results/loss_curve.png", help="Loss-curve PNG; 'none' disables it.")


# -- config files ----------------------------------------------------------------
def _bool_flags(parser: argparse.ArgumentParser) -> dict[str, _BoolFlag]:
    flags: dict[str, _BoolFlag] = {}
    for action in parser._actions:
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            current = flags.get(action.dest, _BoolFlag())
            if action.const:
                flags[action.dest] = dataclasses.replace(current, on=action.option_strings[0])
            else:
                flags[action.dest] = dataclasses.replace(current, off=action.option_strings[0])
    return flags


def config_to_argv(config: dict[str, Any], parser: argparse.ArgumentParser, source: str) -> list[str]:
    """Translate a config mapping into command-line tokens (see [Note: config precedence])."""
    by_option = {opt: action for action in parser._actions for opt in action.option_strings}
    by_dest = {action.dest: action for action in parser._actions if action.option_strings}
    bools = _bool_flags(parser)
    argv: list[str] = []
    for key, value in config.items():
        option = "--" + str(key).replace("_", "-")
        action = by_option.get(option) or by_dest.get(str(key).replace("-", "_"))
        if action is None or action.dest in ("config", "help"):
            close = difflib.get_close_matches(option, list(by_option), n=1)
            hint = f"did you mean {close[0].lstrip('-')!r}? " if close else ""
            raise ArgumentError(
                f"{source}: unknown key {key!r}; {hint}keys are the script's flags without the leading '--' "
                "(see pretrain_gpt.py --help)"
            )
        argv += _config_entry_to_argv(key, value, action, option, bools, source)
    return argv


def _config_entry_to_argv(key, value, action, option, bools, source) -> list[str]:
    if action.dest in bools:
        if not isinstance(value, bool):
            raise ArgumentError(f"{source}: {key}: {value!r} must be true or false (it is an on/off flag)")
        flag = bools[action.dest]
        # A key naming the negative flag (no_gradient_accumulation_fusion: true) means dest=False.
        want = (not value) if option == flag.off else value
        chosen = flag.on if want else flag.off
        if chosen is not None:
            return [chosen]
        if want == action.default:
            return []
        raise ArgumentError(f"{source}: {key}: {value!r} cannot be expressed by a flag; remove the key")
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        if action.nargs not in ("*", "+"):
            raise ArgumentError(f"{source}: {key}: expects one value, got the list {value!r}")
        return [action.option_strings[0], *(str(v) for v in value)]
    return [action.option_strings[0], str(value)]


def load_config_file(path: str) -> dict[str, Any]:
    try:
        import yaml
    except ImportError as exc:  # pyyaml is in setup_env.sh; say so instead of a bare ImportError
        raise ArgumentError(f"--config {path} needs PyYAML; run `pip install pyyaml` (or scripts/setup_env.sh)") from exc
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path!r}: no such file; the shipped configs are in configs/*.yaml")
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ArgumentError(f"--config {path!r} must hold a mapping of flag: value, got a {type(config).__name__}")
    return config


# -- entry point -----------------------------------------------------------------
def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse, apply the config file, validate and derive. Raises ``ArgumentError``
    for invalid combinations; argparse itself exits with status 2 on malformed flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    config_path = _find_config_path(argv)
    prefix: list[str] = []
    if config_path:
        prefix = config_to_argv(load_config_file(config_path), parser, config_path)
        parser.config_source = config_path
        parser.parse_args(prefix)  # report a bad value in the file as coming from the file
        parser.config_source = None
    args = parser.parse_args(prefix + argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate_args(args, world_size)
    return args


def _find_config_path(argv: Sequence[str]) -> Optional[str]:
    for i, token in enumerate(argv):
        if token == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith("--config="):
            return token.split("=", 1)[1]
    return None


def validate_args(args: argparse.Namespace, world_size: int) -> None:
    """Megatron-LM's rules for these flags (plus this script's limits), then the
    derived fields. Every problem is reported at once."""
    from .validation import collect_problems, derive_fields

    problems = collect_problems(args, world_size)
    if problems:
        raise ArgumentError("invalid arguments:\n  - " + "\n  - ".join(problems))
    derive_fields(args, world_size)
