"""The launcher's argument table, loaded from data.

Two files in ``flag_data/`` describe every flag ``scripts/pretrain_gpt.py`` knows:

* ``megatron_lm_flags.csv``: every option of Megatron-LM's argument parser (name,
  aliases, destination, action, type, nargs, default, choices, group, and which
  Megatron-FSDP launch scripts / recipes / docs use it), extracted from a pinned
  Megatron-LM commit by ``scripts/extract_megatron_flags.py``.
* ``launcher_flags.table``: what the launcher does with a flag (see its header):
  used, used for some values only, accepted with no effect (one warning), or
  rejected with a reason; plus the few flags of this launcher only.

[Note: recognised flags] Every Megatron-LM flag is in the parser, so argparse never
answers "unrecognized arguments" for one: a flag without a row in the launcher table
is rejected by validation ("not implemented here") instead, which names the flag and
its Megatron-LM group. Pure data handling, no torch, no process group.
"""

from __future__ import annotations

import csv
import dataclasses
import enum
import functools
import os
from typing import Any, Optional

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "flag_data")
MEGATRON_FLAGS_CSV = os.path.join(DATA_DIR, "megatron_lm_flags.csv")
LAUNCHER_TABLE = os.path.join(DATA_DIR, "launcher_flags.table")
_TYPES = {"int": int, "float": float, "str": str}


class FlagStatus(enum.Enum):
    """What the launcher does with a flag."""

    USED = "used"
    """Implemented with Megatron-LM's meaning."""
    ONLY = "only"
    """Implemented for the table's ``supported`` values; others are rejected."""
    NOOP = "noop"
    """Accepted; when given, one rank-0 warning says why it has no effect here."""
    NOOP_ONLY = "noop-only"
    """As NOOP, and only the ``supported`` values are accepted."""
    REJECTED = "rejected"
    """Given -> a validation error with the table's reason."""
    UNLISTED = "unlisted"
    """A Megatron-LM flag the table does not mention: rejected when given."""


class FlagAction(enum.Enum):
    STORE = "store"
    STORE_TRUE = "storetrue"
    STORE_FALSE = "storefalse"
    BOOLEAN_OPTIONAL = "booleanoptional"


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlagSpec:
    """One row of the argument table: how to parse the flag and what it does here."""

    flag: str
    aliases: tuple[str, ...] = ()
    dest: str
    action: FlagAction
    type: Optional[type] = None
    nargs: Optional[str] = None
    default: Any = None
    choices: Optional[tuple] = None
    group: str = ""
    used_by: tuple[str, ...] = ()
    """Megatron-LM launch scripts / recipes / docs that pass this flag (empty for ours)."""
    status: FlagStatus = FlagStatus.UNLISTED
    supported: tuple[str, ...] = ()
    note: str = ""
    megatron: bool = True
    """False for the flags of this launcher only."""

    @property
    def options(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)

    @property
    def is_bool(self) -> bool:
        return self.action is not FlagAction.STORE


@dataclasses.dataclass(frozen=True)
class FlagTable:
    specs: tuple[FlagSpec, ...]
    megatron_commit: str

    @functools.cached_property
    def by_option(self) -> dict[str, FlagSpec]:
        return {opt: spec for spec in self.specs for opt in spec.options}

    @functools.cached_property
    def by_dest(self) -> dict[str, list[FlagSpec]]:
        out: dict[str, list[FlagSpec]] = {}
        for spec in self.specs:
            out.setdefault(spec.dest, []).append(spec)
        return out


def _data_lines(path: str) -> list[str]:
    with open(path) as f:
        return [line for line in f if line.strip() and not line.startswith("#")]


def _parse_default(text: str, spec_type: Optional[type], nargs: Optional[str]) -> Any:
    if text in ("", "None"):
        return None
    convert = spec_type or str
    if nargs in ("+", "*"):
        return [convert(tok) for tok in text.split()]
    if text in ("True", "False") and spec_type is None:
        return text == "True"
    return convert(text)


def _megatron_specs(path: str) -> tuple[dict[str, dict], str]:
    commit = ""
    with open(path) as f:
        for line in f:
            if line.startswith("# megatron_lm_commit:"):
                commit = line.split(":", 1)[1].strip()
                break
    rows = {row["flag"]: row for row in csv.DictReader(_data_lines(path))}
    return rows, commit


def _table_rows(path: str) -> dict[str, dict]:
    rows = {}
    for number, line in enumerate(_data_lines(path), 1):
        cells = [c.strip() for c in line.rstrip("\n").split("|", 4)]
        if len(cells) != 5:
            raise ValueError(f"{path}: row {number} {line.strip()!r} needs 5 '|'-separated columns")
        flag, status, supported, default, note = cells
        if flag in rows:
            raise ValueError(f"{path}: {flag} has two rows; keep one")
        rows[flag] = dict(status=status, supported=tuple(supported.split()), default=default, note=note)
    return rows


def _spec_from_megatron(row: dict, entry: Optional[dict]) -> FlagSpec:
    action = FlagAction(row["action"])
    spec_type = _TYPES.get(row["type"], str) if action is FlagAction.STORE else None
    nargs = row["nargs"] or None
    if action is FlagAction.STORE_TRUE:
        default = False
    elif action is FlagAction.STORE_FALSE:
        default = True
    else:
        override = entry["default"] if entry and entry["default"] else None
        default = _parse_default(override if override is not None else row["default"], spec_type, nargs)
    return FlagSpec(
        flag=row["flag"], aliases=tuple(row["aliases"].split()), dest=row["dest"], action=action, type=spec_type,
        nargs=nargs, default=default, choices=tuple((spec_type or str)(c) for c in row["choices"].split()) or None,
        group=row["group"],
        used_by=tuple(row["used_by"].split()),
        status=FlagStatus(entry["status"]) if entry else FlagStatus.UNLISTED,
        supported=entry["supported"] if entry else (), note=entry["note"] if entry else "",
    )


def _spec_of_ours(flag: str, entry: dict) -> FlagSpec:
    # status "ours:<action>:<type or dest>"
    _, action_name, extra = entry["status"].split(":")
    action = FlagAction(action_name)
    dest = flag.lstrip("-").replace("-", "_")
    spec_type = None
    if action is FlagAction.STORE:
        spec_type = _TYPES[extra]
    else:
        dest = extra
    default = _parse_default(entry["default"], spec_type, None)
    return FlagSpec(flag=flag, dest=dest, action=action, type=spec_type, default=default, status=FlagStatus.USED,
                    note=entry["note"], megatron=False)


@functools.lru_cache(maxsize=None)
def load_flag_table(megatron_csv: str = MEGATRON_FLAGS_CSV, launcher_table: str = LAUNCHER_TABLE) -> FlagTable:
    megatron_rows, commit = _megatron_specs(megatron_csv)
    entries = _table_rows(launcher_table)
    specs = []
    for flag, row in megatron_rows.items():
        specs.append(_spec_from_megatron(row, entries.get(flag)))
    for flag, entry in entries.items():
        if flag in megatron_rows:
            continue
        if not entry["status"].startswith("ours:"):
            raise ValueError(f"{launcher_table}: {flag} is not a Megatron-LM flag (not in {megatron_csv}); "
                             "mark it ours:<action>:<type> or fix its name")
        specs.append(_spec_of_ours(flag, entry))
    return FlagTable(specs=tuple(specs), megatron_commit=commit)
