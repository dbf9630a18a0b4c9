#!/usr/bin/env bash
# Installs Megatron-core for the Megatron-core integration (megatron_fsdp.
# FullyShardedDataParallel with a Megatron-core GPTModel, tests/test_megatron_core.py).
# Called by scripts/setup_env.sh; safe to run on its own and to run again.
#
# Why 0.16.1: it is the newest release whose wheel declares Python >= 3.10, and on
# its GPTModel path with the *local* layer spec (no TransformerEngine, no apex) it
# imports no triton; 0.19.x needs Python >= 3.12 (--ignore-requires-python here)
# and its gpt_model imports a MoE module that imports triton unconditionally,
# which a CPU-only torch does not bring.
#
# Why --no-deps: megatron-core requires torch, and letting pip resolve it could
# replace the CPU torch with a CUDA build. Its only other import-time needs are
# numpy and packaging, installed plainly below. TransformerEngine and NVIDIA apex
# are optional for megatron-core and cannot be installed on a CPU machine; the PyPI
# package called "apex" is unrelated and must never be installed.
#
# Never fails the calling setup: when megatron-core cannot be installed it prints a
# warning and exits 0, and the Megatron-core tests skip (pytest.importorskip).
#
# Environment: PYTHON (interpreter, default python3), MCORE_VERSION (default
# 0.16.1), MFSDP_SKIP_MEGATRON_CORE=1 (do nothing).
set -uo pipefail
PY=${PYTHON:-python3}
MCORE_VERSION=${MCORE_VERSION:-0.16.1}

warn() {
  echo "setup_megatron_core: WARNING: $*; the Megatron-core tests will be skipped" >&2
}

if [ "${MFSDP_SKIP_MEGATRON_CORE:-0}" = "1" ]; then
  echo "setup_megatron_core: MFSDP_SKIP_MEGATRON_CORE=1, not installing megatron-core"
  exit 0
fi

installed_version() {
  "$PY" -c 'import importlib.metadata as m; print(m.version("megatron-core"))' 2>/dev/null
}

# Quick path: the pinned version is installed already (a metadata read, no import).
if [ "$(installed_version)" = "$MCORE_VERSION" ]; then
  echo "setup_megatron_core: megatron-core $MCORE_VERSION already installed"
  exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  warn "torch is not importable, so megatron-core cannot be used"
  exit 0
fi

# Light pure-Python import-time dependencies (neither depends on torch).
if ! "$PY" -c "import numpy, packaging" 2>/dev/null; then
  "$PY" -m pip install -q numpy "packaging>=24.2" || warn "could not install numpy/packaging"
fi

extra=()
# Releases newer than the pin may declare a Python newer than this one.
if ! "$PY" -m pip install -q --no-deps "megatron-core==$MCORE_VERSION" 2>/dev/null; then
  extra=(--ignore-requires-python)
  if ! "$PY" -m pip install -q --no-deps "${extra[@]}" "megatron-core==$MCORE_VERSION"; then
    warn "pip could not install megatron-core==$MCORE_VERSION"
    exit 0
  fi
fi

# Check that what the integration uses imports (no CUDA needed for this).
if ! "$PY" - <<'EOF' 2>/dev/null
import warnings

warnings.simplefilter("ignore")  # "Apex/TransformerEngine not installed" fallbacks
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: F401
from megatron.core.models.gpt import GPTModel  # noqa: F401
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: F401
EOF
then
  warn "megatron-core $MCORE_VERSION installed but its GPTModel does not import here"
  exit 0
fi
echo "setup_megatron_core: installed megatron-core $(installed_version)"
exit 0
