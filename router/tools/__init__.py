"""Command-line tools built on :mod:`router.core` that are not the server: ``kvrouter replay``."""
