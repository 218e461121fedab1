"""The container's ``HEALTHCHECK``: exit 0 when ``GET /health`` answers 200, else 1.

The slim image has no curl, so the standard library asks. The URL is
``$KVROUTER_HEALTHCHECK_URL`` when set, else ``http://127.0.0.1:$KVROUTER_PORT/health``
(``KVROUTER_PORT`` defaults to 8000, the router's and the simulated replica's port in the
images). Runs with no kvrouter import, so it stays cheap every interval.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def health_url(environ: dict[str, str] | os._Environ[str]) -> str:
    """Where to ask: the explicit URL, else loopback on the configured port."""
    explicit = environ.get("KVROUTER_HEALTHCHECK_URL")
    if explicit:
        return explicit
    return f"http://127.0.0.1:{environ.get('KVROUTER_PORT') or '8000'}/health"


def main() -> int:
    url = health_url(os.environ)
    try:
        with urllib.request.urlopen(url, timeout=3) as resp:
            status = resp.status
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"healthcheck: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"healthcheck: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
