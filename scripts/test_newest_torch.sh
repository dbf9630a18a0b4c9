#!/usr/bin/env bash
# Runs the engine's core tests (DTensor routing, parity, checkpoints, state dicts, the
# experimental API) on another torch release in a virtual environment of its own, leaving the
# main environment's torch alone. The newest release of the declared range is the default.
#
#   bash scripts/test_newest_torch.sh                 # torch 2.14.1
#   TORCH_SPEC=torch==2.12.0 bash scripts/test_newest_torch.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
VENV=${VENV:-/tmp/mfsdp-venv-${TORCH_SPEC//[^0-9.]/}}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q "$TORCH_SPEC" numpy pytest pyyaml
fi
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__)"
PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q tests/test_parity.py tests/test_dtensor_route.py \
  tests/test_checkpoint.py tests/test_upstream_state_dict.py tests/test_experimental_dtensor.py \
  tests/test_optimizer_state_dict.py tests/test_experimental.py "$@"
