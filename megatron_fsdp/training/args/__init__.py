"""The launcher's flags: parsing, configs and validation, before any process group.

- ``arguments.py``: Megatron-LM's parser rebuilt from the flag table, YAML configs (and
  Megatron-LM recipes), the entry point ``parse_args``.
- ``flag_table.py``: the argument table, loaded from ``flag_data/`` (every Megatron-LM flag
  and what the launcher does with it).
- ``arg_types.py``: enums and the error type parsing and validation share.
- ``validation.py``: the table's verdict on each given flag, Megatron-LM's rules for the values,
  this launcher's limits.
- ``activation_offload_flags.py``, ``checkpoint_flags.py`` (``--save``, ``--load`` and the
  formats), ``ep_cp_flags.py`` (expert and context parallelism, expert capacity),
  ``fsdp_v2_flags.py`` (``--megatron-fsdp-version 2``), ``mla_flags.py``, ``mtp_flags.py``,
  ``muon_flags.py``, ``torch_fsdp2_flags.py``, ``tp_flags.py``: the rules of one feature's flags
  each, called by ``validation.py``.
"""
