"""Flags of ``scripts/pretrain_gpt.py``: Megatron-LM's parser rebuilt from the
argument table (``flag_table.py``), YAML config files, and the entry point that
parses, validates and derives.

[Note: config precedence] ``--config FILE.yaml`` is expanded into command-line
tokens placed *before* the real command line, so argparse reads the file first and
the user's flags override it; argparse also type-checks and choice-checks the
file's values exactly like typed flags. Two file forms are accepted:

* plain: ``num-layers: 2`` (keys spelt like the flag, with or without ``--``, or
  like its destination ``num_layers``);
* Megatron-LM's functional-test recipe: a ``MODEL_ARGS`` mapping of ``--dashed-keys``
  (``ENV_VARS``, ``TEST_TYPE``, ... are ignored), ``${VAR}`` expanded from the
  environment, ``true`` meaning "pass the flag".

Every unknown key of a file is reported in one message.

Validation runs before ``torch.distributed`` starts (the world size comes from
torchrun's ``WORLD_SIZE``, as in Megatron-LM), so a bad command fails in a second
with one message listing every problem and its fix.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Any, Optional, Sequence

from .arg_types import BYTE_VOCAB_SIZE, ArgumentError, LRDecayStyle, Precision, TokenizerType  # noqa: F401 (re-exported)
from .flag_table import FlagAction, FlagSpec, FlagStatus, FlagTable, load_flag_table
from .validation import collect_problems, default_tokenizer_type, derive_fields, flag_policy

# Tokenizers of this launcher that Megatron-LM's --tokenizer-type choices lack.
EXTRA_CHOICES = {"--tokenizer-type": tuple(t.value for t in TokenizerType)}
# Top-level keys of a Megatron-LM functional-test recipe that are not flags.
RECIPE_SECTIONS = ("MODEL_ARGS", "ENV_VARS", "TEST_TYPE", "METRICS", "LAUNCHER", "BEFORE_SCRIPT", "MODE",
                   "SPEC", "ARGUMENTS", "TEST_CASES", "AFTER_SCRIPT", "TEST_EVALUATION", "THROUGHPUT_TEST_PARAMS")
"""Top-level keys of a Megatron-LM functional-test recipe. Only MODEL_ARGS holds
flags; the rest drive its CI harness (log checks, pass criteria) and are ignored."""
_LATER_STAGE = re.compile(r"MODEL_ARGS_\d+")
"""A later stage of a multi-stage recipe (a resumed or re-run job): the launcher runs
the first stage, MODEL_ARGS, as the harness's first job does."""
_UNSET_ENV = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")
_BRACKETED = re.compile(r"\[([^\]]+)\]")
"""A recipe value written ``"[a b c]"``: Megatron-LM's recipe runner (``_run_training.sh``)
drops the brackets and passes the words as separate tokens (``--offload-modules a b c``).
Only for flags that take several values: a single-valued one keeps its value as written
(``--moe-layer-freq "[1,0,1,0]"`` is a list expression). Plain config files keep it too."""


class RecipeArgs(dict):
    """The ``MODEL_ARGS`` of a Megatron-LM functional-test recipe: its values are read as
    that recipe runner passes them (see ``_BRACKETED``)."""


class MegatronArgumentParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors name the config file a bad value came from
    and suggest the closest known flag when one is clearly meant."""

    config_source: Optional[str] = None

    def error(self, message: str):  # argparse's hook; exits with status 2
        if message.startswith("unrecognized arguments"):
            known = [opt for action in self._actions for opt in action.option_strings]
            hints = []
            for token in message.split(":", 1)[1].split():
                if token.startswith("--"):
                    close = suggest_flag(token.split("=")[0], known)
                    hints.append(f"{token} (did you mean {close}?)" if close else token)
            if hints:
                message = ("unrecognized arguments: " + ", ".join(hints) +
                           "; neither this launcher nor Megatron-LM has such a flag (see --help)")
        if self.config_source:
            message = f"in config file {self.config_source}: {message}"
        # A short message instead of argparse's full usage dump, which would bury it.
        self.exit(2, f"{self.prog}: error: {message}\n(run with --help to list the accepted flags)\n")


def suggest_flag(name: str, known: Sequence[str]) -> Optional[str]:
    """The one flag ``name`` is a near-miss of, or None: a hint is shown only when a
    single candidate is close (a typo), never a guess among several."""
    matches = difflib.get_close_matches(name, known, n=2, cutoff=0.85)
    if not matches:
        return None
    if len(matches) == 2:
        ratio = [difflib.SequenceMatcher(None, name, m).ratio() for m in matches]
        if ratio[0] - ratio[1] < 0.05:
            return None
    return matches[0]


def _help(spec: FlagSpec) -> str:
    if spec.status is FlagStatus.UNLISTED:
        return argparse.SUPPRESS  # 600+ Megatron-LM flags this launcher rejects: keep --help readable
    prefix = {FlagStatus.NOOP: "[no effect here] ", FlagStatus.NOOP_ONLY: "[no effect here] ",
              FlagStatus.REJECTED: "[rejected here] "}.get(spec.status, "")
    if spec.supported:
        prefix += f"[supported: {', '.join(spec.supported)}] "
    return (prefix + spec.note).replace("%", "%%")


def _add_flag(group, spec: FlagSpec) -> None:
    kwargs: dict[str, Any] = dict(dest=spec.dest, help=_help(spec))
    if spec.action is FlagAction.STORE_TRUE:
        kwargs.update(action="store_true", default=spec.default)
    elif spec.action is FlagAction.STORE_FALSE:
        kwargs.update(action="store_false", default=spec.default)
    elif spec.action is FlagAction.BOOLEAN_OPTIONAL:
        kwargs.update(action=argparse.BooleanOptionalAction, default=spec.default)
    else:
        kwargs.update(type=spec.type or str, default=spec.default)
        if spec.nargs:
            kwargs["nargs"] = int(spec.nargs) if spec.nargs.isdigit() else spec.nargs
        if spec.choices:
            kwargs["choices"] = spec.choices + EXTRA_CHOICES.get(spec.flag, ())
    group.add_argument(*spec.options, **kwargs)


def build_parser(table: Optional[FlagTable] = None) -> MegatronArgumentParser:
    table = table or load_flag_table()
    parser = MegatronArgumentParser(
        prog="pretrain_gpt.py",
        description="Megatron-LM style GPT pretraining with megatron_fsdp (or PyTorch DDP for comparison). "
                    "Every Megatron-LM flag is recognised; see megatron_fsdp/training/args/flag_data/.",
        allow_abbrev=False,
    )
    groups: dict[str, Any] = {}
    # Two destinations are shared by a Megatron-LM flag and a launcher flag
    # (--no-check-for-nan-in-loss-and-grad / --check-for-nan-in-loss-and-grad): the
    # launcher's default wins, so register the Megatron-LM one first.
    for spec in sorted(table.specs, key=lambda s: (not s.megatron, s.flag)):
        title = spec.group or "this launcher"
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        _add_flag(groups[title], spec)
    return parser


# -- config files ----------------------------------------------------------------
def _config_key_spec(key: str, value: Any, table: FlagTable) -> Optional[FlagSpec]:
    option = "--" + key.lstrip("-") if key.startswith("-") else "--" + key.replace("_", "-")
    spec = table.by_option.get(option) or table.by_option.get(option.replace("_", "-"))
    if spec is not None or key.startswith("-"):
        return spec
    specs = table.by_dest.get(key.replace("-", "_"), [])
    if len(specs) > 1 and isinstance(value, bool):  # dest shared by an on and an off flag: pick the one meaning `value`
        for candidate in specs:
            if (candidate.action is FlagAction.STORE_TRUE) == value:
                return candidate
    return specs[0] if specs else None


def _bool_tokens(spec: FlagSpec, value: Any, key: str, source: str) -> list[str]:
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise ArgumentError(f"{source}: {key}: {value!r} must be true or false (it is an on/off flag)")
    if spec.action is FlagAction.BOOLEAN_OPTIONAL:
        return [spec.flag if value else "--no-" + spec.flag[2:]]
    # true: pass the flag (as Megatron-LM's recipe runner does); false: leave it out.
    return [spec.flag] if value else []


def _expand_env(value: Any, key: str, source: str, problems: list[str]) -> Any:
    if isinstance(value, list):
        return [_expand_env(v, key, source, problems) for v in value]
    if not isinstance(value, str) or "$" not in value:
        return value
    expanded = os.path.expandvars(value)
    unset = _UNSET_ENV.findall(expanded)
    if unset:
        problems.append(f"{key}: {value!r} uses the environment variable {', '.join(unset)}, which is not set; "
                        "export it or write the value")
    return expanded


def config_to_argv(config: dict[str, Any], table: FlagTable, source: str) -> list[str]:
    """Translate a config mapping into command-line tokens (see [Note: config precedence])."""
    argv: list[str] = []
    problems: list[str] = []
    known = [opt.lstrip("-") for opt in table.by_option]
    for key, value in config.items():
        key = str(key)
        spec = _config_key_spec(key, value, table)
        if spec is None or spec.dest in ("config", "help"):
            close = suggest_flag(key.lstrip("-").replace("_", "-"), known)
            problems.append(f"unknown key {key!r}" + (f" (did you mean {close!r}?)" if close else ""))
            continue
        value = _expand_env(value, key, source, problems)
        if (isinstance(config, RecipeArgs) and spec.nargs in ("*", "+") and isinstance(value, str)
                and _BRACKETED.fullmatch(value.strip())):
            words = _BRACKETED.fullmatch(value.strip()).group(1).split()
            value = words[0] if len(words) == 1 else words
        try:
            argv += _config_entry_tokens(spec, key, value, source)
        except ArgumentError as exc:
            problems.append(str(exc).removeprefix(f"{source}: "))
    if problems:
        raise ArgumentError(f"{source}: " + "; ".join(problems) +
                            ". Keys are the launcher's flags (Megatron-LM's names), with or without the leading "
                            "'--' (see pretrain_gpt.py --help)")
    return argv


def _config_entry_tokens(spec: FlagSpec, key: str, value: Any, source: str) -> list[str]:
    if spec.is_bool:
        return _bool_tokens(spec, value, key, source)
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        if spec.nargs not in ("*", "+") and not (spec.nargs or "").isdigit():
            raise ArgumentError(f"{source}: {key}: expects one value, got the list {value!r}")
        return [spec.flag, *(str(v) for v in value)]
    if spec.nargs in ("*", "+") and isinstance(value, str) and " " in value.strip():
        return [spec.flag, *value.split()]  # a blend "0.3 a 0.7 b" written as one string
    return [spec.flag, str(value)]


def load_config_file(path: str) -> dict[str, Any]:
    """The flag mapping of a YAML file, in either form (see [Note: config precedence])."""
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
    if "MODEL_ARGS" in config:  # Megatron-LM functional-test recipe
        model_args = config["MODEL_ARGS"] or {}
        if not isinstance(model_args, dict):
            raise ArgumentError(f"--config {path!r}: MODEL_ARGS must be a mapping of --flag: value")
        extra = [k for k in config if k not in RECIPE_SECTIONS and not _LATER_STAGE.fullmatch(str(k))]
        if extra:
            raise ArgumentError(f"--config {path!r}: top-level keys {extra} next to MODEL_ARGS; a recipe keeps its "
                                "flags under MODEL_ARGS")
        return RecipeArgs(model_args)
    return config


# -- entry point -----------------------------------------------------------------
def given_flags(tokens: Sequence[str], table: FlagTable) -> dict[str, FlagSpec]:
    """The flags present in ``tokens`` (config expansion included), by canonical name."""
    given: dict[str, FlagSpec] = {}
    for token in tokens:
        if not token.startswith("--"):
            continue
        spec = table.by_option.get(token.split("=", 1)[0])
        if spec is not None:
            given[spec.flag] = spec
    return given


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None) -> argparse.Namespace:
    """Parse, apply the config file, validate and derive. Raises ``ArgumentError``
    for invalid combinations; argparse itself exits with status 2 on malformed flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    table = load_flag_table()
    parser = build_parser(table)
    config_path = _find_config_path(argv)
    prefix: list[str] = []
    if config_path:
        prefix = config_to_argv(load_config_file(config_path), table, config_path)
        parser.config_source = config_path
        parser.parse_args(prefix)  # report a bad value in the file as coming from the file
        parser.config_source = None
    args = parser.parse_args(prefix + argv)
    args.given_flags = given_flags(prefix + argv, table)
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
    """The table's verdict on each given flag, Megatron-LM's rules for the values
    (plus this script's limits), then the derived fields. Every problem is reported
    at once; the warnings for flags with no effect are kept on ``args.flag_warnings``
    for rank 0 to log once."""
    given = getattr(args, "given_flags", {})
    # Megatron-LM keeps --use-mcore-models under a "deprecated_" destination (its
    # models are always megatron-core); here the flag picks the model, so name it plainly.
    args.use_mcore_models = args.deprecated_use_mcore_models
    default_tokenizer_type(args)
    problems, warnings = flag_policy(args, given)
    problems += collect_problems(args, world_size)
    if problems:
        raise ArgumentError("invalid arguments:\n  - " + "\n  - ".join(problems))
    args.flag_warnings = warnings
    derive_fields(args, world_size)  # may add warnings of its own
