#!/usr/bin/env bash
# Install vllm-router 0.1.17 (the vLLM project's Rust router, a PyPI wheel with a Python
# launcher) into a cached virtual environment outside the repository and reuse it when present,
# like install.sh does for vLLM. Prints the env's python; the router is started with
#   PY -m vllm_router.launch_router --worker-urls URL... --policy cache_aware --port PORT
#   KVROUTER_VLLM_ROUTER_ENV   where the environment lives
#                              (default ~/.cache/kvrouter/vllm-router-0.1.17)
set -euo pipefail
ENV_DIR="${KVROUTER_VLLM_ROUTER_ENV:-$HOME/.cache/kvrouter/vllm-router-0.1.17}"
PY="$ENV_DIR/bin/python"
if [ -x "$PY" ] && [ -f "$ENV_DIR/.kvrouter-ok" ] && "$PY" -c "import vllm_router" >/dev/null 2>&1; then
  echo "$PY"
  exit 0
fi
echo "installing vllm-router==0.1.17 into $ENV_DIR" >&2
python3 -m venv "$ENV_DIR"
"$ENV_DIR/bin/pip" install -q "vllm-router==0.1.17" >&2
"$PY" -c "import vllm_router" >&2
touch "$ENV_DIR/.kvrouter-ok"
echo "$PY"
