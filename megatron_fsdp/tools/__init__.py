"""Tools beside the engine: the scale planner.

- ``plan.py``: per-rank memory and per-step collectives of a preset GPT, derived from its
  structure alone, with data parallelism and optionally tensor parallelism (``tp``).
- ``simulate.py``: the same model built through the engine on torch's fake process group
  (under the embedded models' TP plan when ``tp`` > 1), its DTensor collectives recorded.
- ``plan_cli.py``: the command line (``python -m megatron_fsdp.tools.plan_cli``, ``scripts/plan.py``).
"""
