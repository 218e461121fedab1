"""Build bits only: the optional C extensions ``events._chain`` (docs/native-hashing.md) and
``router.core._keytable`` (docs/index-memory.md).

Everything else about the package is in pyproject.toml. ``optional=True`` makes a failed
compile (no gcc, no Python headers: a slim image) a warning, not an install error; the package
then runs on the pure-Python hash chain and on dict tables in its index, which are also the
references the extensions are tested against. ``KVROUTER_NO_NATIVE_BUILD=1`` skips both on
purpose.
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
    ext_modules.append(
        Extension(
            "router.core._keytable",
            sources=["router/core/_keytable.c"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
