#!/usr/bin/env bash
# Installs everything megatron_fsdp, its scripts and its tests need, on a fresh
# machine with Python >= 3.10. Never lets pip pull a CUDA build of torch: torch is
# pinned first, and packages that depend on torch are installed with --no-deps.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "$TORCH_SPEC"
fi
"$PY" -m pip install -q --no-deps -e .
"$PY" -m pip install -q "pytest>=7" pyyaml matplotlib build
# Optional dashboards extra: TensorBoard events for --tensorboard-dir (tensorboard does
# not depend on torch, so this never replaces the installed torch).
"$PY" -m pip install -q tensorboard || echo "setup_env: WARNING: could not install tensorboard (optional)" >&2
if [ -f scripts/setup_megatron_core.sh ]; then
  bash scripts/setup_megatron_core.sh
fi
# Optional data/tokenizer extras, none of which depends on torch: `regex` compiles GPT-2's
# word pattern (megatron_fsdp/training/data/tokenizers.py has a pure-`re` fallback) and
# `tokenizers` is the fast GPT-2 BPE backend and reads HuggingFaceTokenizer directories
# (tokenizer.json). Without them everything still works, slower or with a clear message.
"$PY" -m pip install -q regex tokenizers || echo "setup_env: WARNING: could not install regex/tokenizers (optional)" >&2
# Optional: `sentencepiece` reads the --tokenizer-model of GPTSentencePieceTokenizer, Llama2Tokenizer and
# SentencePieceTokenizer (megatron_fsdp/training/data/sentencepiece_tokenizers.py); it has no dependencies,
# and --no-deps keeps pip from ever touching torch. Without it those types are refused at validation.
"$PY" -m pip install -q --no-deps sentencepiece || echo "setup_env: WARNING: could not install sentencepiece (optional)" >&2
# Optional: `tiktoken` runs --tokenizer-type TikTokenizer (training/data/tiktoken_tokenizer.py); it does not
# depend on torch. Without it that type is refused at validation.
"$PY" -m pip install -q tiktoken || echo "setup_env: WARNING: could not install tiktoken (optional)" >&2
# Optional Hugging Face interop (megatron_fsdp/interop/: checkpoints in and out, wrapped transformers
# models in the tests): `safetensors` and transformers' own dependencies do not depend on torch;
# transformers itself is installed with --no-deps so that pip never touches the installed torch.
# Without them the interop raises a clear message and its tests skip.
"$PY" -m pip install -q safetensors "huggingface-hub>=1.31,<3" typer tqdm \
  && "$PY" -m pip install -q --no-deps "transformers==5.24.0" \
  || echo "setup_env: WARNING: could not install transformers/safetensors (optional)" >&2
