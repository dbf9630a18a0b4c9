"""Helpers shared by the upstream A/B scripts, one concern per module.

scripts/upstream_ab.py (the world-1 run and the command line) and
scripts/upstream_ab_patterns.py (world > 1) both import them:

* ``user_script``: the user's training script both sides run, and what a run records.
* ``packages``: each side's ``megatron_fsdp`` (imported from its root only), the CPU
  shim upstream needs, the unpacked wheel.
* ``comparison``: both sides' records compared into the A/B sections (reads ``packages``).
* ``cli``: the command line both scripts take (reads ``user_script`` and ``packages``).

Nothing here imports either script; upstream_ab.py imports upstream_ab_patterns.py,
never the other way round."""
