"""Tools beside the engine: the scale planner.

- ``plan.py``: per-rank memory and per-step collectives of a preset GPT, derived from its
  structure alone, with data parallelism and optionally tensor (``tp``), context (``cp``)
  and expert (``ep``) parallelism, and the activation collectives of TP, CP and EP.
- ``peak.py``: the peak bytes of one step per rank: the plan's persistent state plus one
  microbatch's activations traced on fake tensors (``activation_trace.py``), gathered
  units, reduce buckets and optimizer temporaries, per phase; ``peak_measure.py`` measures
  the real one on CPU (glibc's bytes in use) for the tests.
- ``simulate.py``: the same model built through the engine on torch's fake process group
  (laid out as the launcher lays it out: TP plan, CP attention, rank 0's experts), its
  buffers read and its collectives recorded.
- ``plan_cli.py``: the command line (``python -m megatron_fsdp.tools.plan_cli``, ``scripts/plan.py``).
"""
