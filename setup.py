"""Build bits only: the optional C extension ``events._chain`` (docs/native-hashing.md).

Everything else about the package is in pyproject.toml. ``optional=True`` makes a failed
compile (no gcc, no Python headers: a slim image) a warning, not an install error; the package
then runs on the pure-Python hash chain, which is also the reference the extension is tested
against. ``KVROUTER_NO_NATIVE_BUILD=1`` skips the extension on purpose.
"""

import os

from setuptools import Extension, setup

ext_modules = []
if os.environ.get("KVROUTER_NO_NATIVE_BUILD", "") not in ("1", "true", "yes"):
    ext_modules.append(
        Extension(
            "events._chain",
            sources=["events/_chain.c"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
