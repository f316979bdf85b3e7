#!/usr/bin/env bash
# Create .venv-lmcache: LMCache (pinned) + kvswarm (editable), kept apart from the other venvs because
# LMCache's pins (numpy<=2.2.6, protobuf<7, prometheus_client<=0.24.1, opentelemetry-api<=1.40,
# setuptools<81) would change the main venv's and vLLM's venv's packages.
# Idempotent: a venv that already imports the pinned version is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
LMCACHE_VERSION=0.5.6  # as pyproject.toml's lmcache extra pins it
VENV="${VENV_LMCACHE:-.venv-lmcache}"
PY="$VENV/bin/python"

ready() {
    [ -x "$PY" ] && "$PY" - "$LMCACHE_VERSION" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
assert md.version("lmcache") == sys.argv[1], "lmcache"
import blosc2, kvswarm, pytest  # noqa: F401
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface  # noqa: F401
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: F401
PY
}

if ready; then
    echo "setup-lmcache: $VENV ready (lmcache $LMCACHE_VERSION)"
    exit 0
fi
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
# The local CPU wheel first: LMCache's plain `torch` requirement would otherwise pull a CUDA build.
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[lmcache,test,uring]"  # kvswarm with LMCache (pyproject's pin), and its test tools
ready || { echo "setup-lmcache: $VENV does not import lmcache/kvswarm" >&2; exit 1; }
echo "setup-lmcache: $VENV installed (lmcache $LMCACHE_VERSION)"
