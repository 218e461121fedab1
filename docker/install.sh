#!/bin/sh
# The container image's install step (Dockerfile), also run by tests/test_install.py in a clean
# virtual environment, so what the image gets is what the test checked.
#
#   docker/install.sh VENV WHEEL_DIR [EXTRAS]
#
# Creates the virtual environment VENV, installs the kvrouter wheel found in WHEEL_DIR with the
# comma-separated EXTRAS (router image: "kubernetes"; replica image: "emitter"), then checks
# what the image promises: without "emitter", torch is NOT installed (the router image stays
# small); the shipped layouts load from the installed package (python -I: never from a source
# tree in the current directory); `kvrouter --help` runs.
# The interpreter is $PYTHON (default python3); pip's own settings come from the environment
# (PIP_NO_CACHE_DIR, PIP_EXTRA_INDEX_URL, ...).
set -eu

if [ "$#" -lt 2 ] || [ "$#" -gt 3 ]; then
    echo "usage: $0 VENV WHEEL_DIR [EXTRAS]" >&2
    exit 2
fi
venv=$1
wheel_dir=$2
extras=${3:-}

set -- "$wheel_dir"/kvrouter-*.whl
if [ "$#" -ne 1 ] || [ ! -f "$1" ]; then
    echo "$0: want exactly one kvrouter-*.whl in $wheel_dir, found: $*" >&2
    exit 2
fi
wheel=$1
spec=$wheel
if [ -n "$extras" ]; then
    spec="$wheel[$extras]"
fi

"${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet "$spec"

case ",$extras," in
    *,emitter,*) ;;
    *)
        if "$venv/bin/python" -I -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
            echo "$0: torch got installed without the emitter extra; the router image must not carry it" >&2
            exit 1
        fi
        ;;
esac
"$venv/bin/python" -I -c 'from gpu_emitter.layouts import load_layout, shipped_layouts
for name in shipped_layouts() or ["fa_swa"]:
    load_layout(name)'
"$venv/bin/kvrouter" --help > /dev/null
echo "installed $spec into $venv"
