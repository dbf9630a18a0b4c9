"""Compatibility with optional libraries, recognised without requiring them.

- ``transformer_engine.py``: TransformerEngine modules (FP8 refused, fused wgrad through
  ``param.main_grad``), detected without importing TransformerEngine.
- ``megatron_core.py``: megatron-core: whether it is installed, its layer classes and
  parallel state, its tensor-parallel weights' marks and the gradients its layers leave
  partial over TP, and its ``TransformerConfig`` from Megatron-LM style arguments.
"""
