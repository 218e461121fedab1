"""vllm-router 0.1.17 (the vLLM project's Rust router, PyPI ``vllm-router``) in front of a fleet.

``install_vllm_router.sh`` installs it into its own cached venv (like ``install.sh`` for vLLM)
and prints that venv's python; the router runs as

    PY -m vllm_router.launch_router --host 127.0.0.1 --port PORT \\
        --worker-urls http://127.0.0.1:R1 http://127.0.0.1:R2 --policy cache_aware \\
        --prometheus-host 127.0.0.1 --prometheus-port PORT2

in its own process group (the Prometheus exporter otherwise binds 29000 by default). Nothing
else is changed: the cache_aware defaults stay (see ``load.py``'s docstring). It adds no header
naming the chosen worker, so per-replica counts come from the replicas' own
``vllm:request_success_total``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
INSTALL = HERE / "install_vllm_router.sh"


def vllm_router_python() -> str:
    """Install (or reuse) the cached vllm-router environment; return its python."""
    out = subprocess.run(["bash", str(INSTALL)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def launch_command(
    python: str, urls: list[str], port: int, prometheus_port: int, policy: str = "cache_aware"
) -> list[str]:
    return [
        python, "-m", "vllm_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *urls,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        "--worker-startup-check-interval", "1",
        "--log-level", "warning",
    ]  # fmt: skip


@contextlib.contextmanager
def vllm_router_process(
    urls: list[str],
    port: int,
    prometheus_port: int,
    log_path: Path,
    policy: str = "cache_aware",
    timeout_s: float = 90.0,
) -> Iterator[str]:
    """Start the router, wait until it answers ``/v1/models``, yield its base URL, stop it."""
    cmd = launch_command(vllm_router_python(), urls, port, prometheus_port, policy)
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"vllm-router did not start ({' '.join(cmd)}):\n{tail}")
                time.sleep(0.2)  # waiting for another process to come up
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
