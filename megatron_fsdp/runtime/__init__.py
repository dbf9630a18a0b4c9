"""Runtime: what happens during a step: hooks, the unit schedule, the gathers and reductions.

Modules, one concern each:

- ``hooks.py``: module and autograd hooks and the unit state machine (``HookRuntime``).
- ``unit_schedule.py``: the one order in which every rank visits the units.
- ``all_gather_pipeline.py``: making a group's model weights whole before compute.
- ``grad_reduce_pipeline.py``: from autograd's raw gradients to reduced main gradients.
- ``grad_norm.py``: the total gradient norm and clipping over every mesh, experts spread over ranks included.
- ``nan_check.py``: ``check_for_nan_in_grad`` with one host sync per step.
- ``weight_edits.py``: in-place edits of ``model.parameters()`` reaching the compute weights.
- ``init_sync.py``: every data-parallel rank starts from rank 0's parameters and buffers.
- ``meta_init.py``: materialising a meta-device model straight into the sharded buffers.
- ``registered_params.py``: which tensors the wrapped module's registered parameters are.
- ``backward_outputs.py``: which tensors of a module's output backward reaches.
- ``owners.py``: which wrapper owns a parameter or module (held weakly).
- ``wrap_checks.py``: what cannot be wrapped, refused before any buffer exists.
- ``wrapped_model_guards.py``: copies, pickles, moves and casts of a wrapped model refused.
"""
