"""``pip install .`` (not editable) and the container image's install steps, for real.

One slow step for the module (~40 s): the wheel is built from exactly the files the
Dockerfile's ``wheel`` stage copies (so a file the image misses fails here too), then
``docker/install.sh`` (the image's own install step) installs it into two fresh virtual
environments, as the two image targets do: ``router`` (extra ``kubernetes``, no torch) and
``replica`` (extra ``emitter``, CPU torch). Every command then runs from a directory outside the
source tree with no ``PYTHONPATH``, so only the installed package can answer: the layouts
``kvrouter replica --layout fa_swa`` needs, the image's default command and its environment,
a request through the installed router to the installed simulated replica, and ``kvrouter
demo`` falling back to a synthetic workload when the Mooncake trace is not beside it.

Needs a package index (or pip's cache) for the dependencies, as any ``pip install`` does.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.dockerfile import DOCKERFILE, ROOT, stage_env, stages
from tests.zmq_helpers import wait_for

pytestmark = pytest.mark.slow

LAYOUT_FILES = sorted(p.name for p in (ROOT / "gpu_emitter" / "layout_files").glob("*.toml"))
IMAGE_CONFIG = "/etc/kvrouter/router.toml"
TOKEN = "install-test-token"


@dataclass(frozen=True)
class Envs:
    wheel: Path
    router: Path  # the router image's environment (extra "kubernetes")
    replica: Path  # the replica image's environment (extra "emitter")
    run_dir: Path  # cwd of every command: outside the source tree

    def env(self, **extra: str) -> dict[str, str]:
        """The process environment without anything that could reach the source tree."""
        out = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
            and not k.startswith("KVROUTER_")
        }
        out.update(extra)
        return out

    def run(self, venv: Path, argv: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
        exe = venv / "bin" / argv[0]
        return subprocess.run(
            [str(exe), *argv[1:]],
            cwd=self.run_dir,
            env=self.env(**extra),
            capture_output=True,
            text=True,
            timeout=120,
        )


def _copy_context(dst: Path) -> None:
    """The Dockerfile ``wheel`` stage's ``COPY`` sources, as .dockerignore leaves them."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    sources = stages()["wheel"].copy_sources()
    assert "pyproject.toml" in sources, sources
    for src in sources:
        path = ROOT / src
        if path.is_dir():
            shutil.copytree(path, dst / src, ignore=ignore)
        else:
            shutil.copy2(path, dst / src)


def _install(venv: Path, wheels: Path, extras: str, log: Path) -> None:
    # docker/install.sh with this interpreter as the base (python3 in the image), from a
    # directory without sources, as in the image (its checks also use python -I).
    proc = subprocess.run(
        ["sh", str(ROOT / "docker" / "install.sh"), str(venv), str(wheels), extras],
        cwd=log.parent,
        env={
            **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
            "PYTHON": sys.executable,
        },
        capture_output=True,
        text=True,
        timeout=240,
    )
    log.write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"docker/install.sh {extras} failed:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def envs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Envs]:
    base = tmp_path_factory.mktemp("install")
    src, wheels, run_dir = base / "src", base / "wheels", base / "run"
    src.mkdir()
    run_dir.mkdir()
    _copy_context(src)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(wheels), "."],
        cwd=src,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = wheels.glob("kvrouter-*.whl")
    router, replica = base / "router-venv", base / "replica-venv"
    _install(router, wheels, "kubernetes", base / "router-install.log")
    _install(replica, wheels, "emitter", base / "replica-install.log")
    try:
        yield Envs(wheel, router, replica, run_dir)
    finally:  # the replica environment holds torch (~1 GB): do not keep it around
        shutil.rmtree(router, ignore_errors=True)
        shutil.rmtree(replica, ignore_errors=True)


def test_wheel_carries_the_layout_files(envs: Envs) -> None:
    names = set(zipfile.ZipFile(envs.wheel).namelist())
    assert LAYOUT_FILES  # the source tree has them where the package expects
    assert {f"gpu_emitter/layout_files/{f}" for f in LAYOUT_FILES} <= names
    assert not [n for n in names if n.startswith(("tests/", "bench/", "config/", "docker/"))]


def test_wheel_carries_the_compiled_chain_when_a_compiler_is_there(envs: Envs) -> None:
    """setup.py (copied by the wheel stage) builds events._chain where gcc exists; where it
    does not (the slim image) the wheel is pure and works (tests/test_native_hashing.py)."""
    if shutil.which(os.environ.get("CC", "cc")) is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the wheel is built without events._chain")
    names = zipfile.ZipFile(envs.wheel).namelist()
    assert [n for n in names if n.startswith("events/_chain") and n.endswith(".so")], names
    code = "from events.hashing import native_hashing; print(native_hashing())"
    out = envs.run(envs.router, ["python", "-I", "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("events._chain ("), out.stdout
    # the index's compact tables (router.core._keytable, docs/index-memory.md) likewise
    assert [n for n in names if n.startswith("router/core/_keytable") and n.endswith(".so")]
    code = "from router.core.index import native_index; print(native_index())"
    out = envs.run(envs.router, ["python", "-I", "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "router.core._keytable", out.stdout


def test_installed_router_env_loads_layouts_from_itself_without_torch(envs: Envs) -> None:
    code = (
        "import importlib.util, json, router, gpu_emitter.layouts as L\n"
        "lay = L.load_layout('fa_swa')\n"
        "print(json.dumps({'torch': importlib.util.find_spec('torch') is not None,\n"
        "  'router': router.__file__, 'dir': str(L.LAYOUT_DIR), 'shipped': L.shipped_layouts(),\n"
        "  'window': lay.groups[1].sliding_window}))\n"
    )
    proc = envs.run(envs.router, ["python", "-c", code])
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["torch"] is False  # the router image carries no torch
    venv = str(envs.router.resolve())
    assert got["router"].startswith(venv) and got["dir"].startswith(venv)  # not the checkout
    assert got["shipped"] == [f.removesuffix(".toml") for f in LAYOUT_FILES]
    assert got["window"] == 128
    lightkube = envs.run(envs.router, ["python", "-c", "import lightkube"])
    assert lightkube.returncode == 0, lightkube.stderr  # the image's `kubernetes` extra


def test_image_default_command_with_the_image_env(envs: Envs, tmp_path: Path) -> None:
    """The router stage's ENTRYPOINT + CMD under its ENV: refuses to listen on every
    interface without an admin token, accepts the config with one."""
    all_stages = stages()
    router = all_stages["router"]
    argv = router.exec_form("ENTRYPOINT") + router.exec_form("CMD")
    assert IMAGE_CONFIG in argv
    image_env = {k: v for k, v in stage_env(all_stages, "router").items() if k.startswith("KV")}
    assert image_env["KVROUTER_HOST"] == "0.0.0.0"
    cfg = tmp_path / "router.toml"
    cfg.write_text(
        '[[pools]]\nmodel = "m"\n\n[[pools.replicas]]\nname = "a"\n'
        'url = "http://127.0.0.1:9"\nevent_endpoint = "tcp://127.0.0.1:9"\n'
    )
    argv = [str(cfg) if a == IMAGE_CONFIG else a for a in argv] + ["--check"]
    refused = envs.run(envs.router, argv, **image_env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "without a token" in refused.stderr and "KVROUTER_ADMIN_TOKEN" in refused.stderr
    ok = envs.run(envs.router, argv, **image_env, KVROUTER_ADMIN_TOKEN=TOKEN)
    assert ok.returncode == 0, ok.stderr
    assert "ok (1 pool(s), 1 replica(s))" in ok.stdout
    helped = envs.run(envs.router, ["kvrouter", "--help"])
    assert helped.returncode == 0, helped.stderr
    for command in ("serve", "replica", "demo", "replay"):
        assert command in helped.stdout


def _start(envs: Envs, venv: Path, argv: list[str], **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        cwd=envs.run_dir,
        env=envs.env(**extra),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _healthcheck(envs: Envs, **extra: str) -> subprocess.CompletedProcess[str]:
    """docker/healthcheck.py as the image's HEALTHCHECK runs it (the router env's python)."""
    return envs.run(envs.router, ["python", str(ROOT / "docker" / "healthcheck.py")], **extra)


def test_installed_router_serves_the_installed_replica(envs: Envs) -> None:
    from gpu_emitter.demo import MODEL, free_port, read_endpoints, router_toml

    replica = _start(
        envs,
        envs.replica,
        [
            *("kvrouter", "replica", "--port", "0", "--layout", "fa_swa", "--model", MODEL),
            *("--events-endpoint", "tcp://127.0.0.1:*", "--replay-endpoint", "tcp://127.0.0.1:*"),
        ],
    )
    router: subprocess.Popen[str] | None = None
    try:
        ends = read_endpoints(replica, "replica", 60)
        port = free_port()
        cfg = envs.run_dir / "router.toml"
        cfg.write_text(router_toml(port, "kv", [ends], 0, admin=True))
        # Configured as the image is: KVROUTER_* over the mounted file (host stays loopback).
        router = _start(
            envs,
            envs.router,
            ["kvrouter", "serve", "--config", str(cfg)],
            KVROUTER_PORT=str(port),
            KVROUTER_ADMIN_TOKEN=TOKEN,
        )
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if router.poll() is not None:
                raise AssertionError(f"router exited {router.returncode}: {router.stderr.read()}")
            try:
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 30, "the installed router ready")
        assert _healthcheck(envs, KVROUTER_PORT=str(port)).returncode == 0
        assert _healthcheck(envs, KVROUTER_HEALTHCHECK_URL=ends["http"] + "/health").returncode == 0
        prompt = " ".join(f"w{i}" for i in range(200))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        first = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

        def predicted() -> int | None:
            ex = httpx.post(
                url + "/admin/route/explain",
                json={"model": MODEL, "prompt": prompt},
                headers={"authorization": f"Bearer {TOKEN}"},
                timeout=5,
            )
            assert ex.status_code == 200, ex.text
            hit = ex.json()["replicas"][0]["hit_tokens"]
            return hit if hit > 0 else None

        hit = wait_for(predicted, 20, "the router to learn the replica's blocks from its events")
        again = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == hit
    finally:
        if router is not None:
            _stop(router)
        _stop(replica)
    assert _healthcheck(envs, KVROUTER_PORT=str(port)).returncode == 1  # nobody answers now


def test_installed_demo_falls_back_to_a_synthetic_workload(envs: Envs) -> None:
    """No Mooncake trace beside an installed package: the demo says so and still runs."""
    out = envs.run_dir / "demo"
    proc = envs.run(
        envs.replica,
        [
            *("kvrouter", "demo", "--replicas", "2", "--requests", "8", "--duration", "1"),
            *("--policies", "kv,round_robin", "--max-in-flight", "1"),
            *("--replica-time-scale", "0.1", "--out", str(out)),
        ],
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "synthetic (Mooncake-shaped; trace file not found)" in proc.stdout
    doc = json.loads((out / "demo.json").read_text())
    assert {p["label"] for p in doc["policies"]} >= {"round_robin"}
    assert all(p["errors"] == 0 for p in doc["policies"])


def test_dockerfile_is_the_one_read() -> None:
    """The reader above sees both image targets (a renamed stage must fail loudly here)."""
    names = list(stages())
    assert DOCKERFILE.is_file()
    assert names[-1] == "router" and "replica" in names and "wheel" in names
