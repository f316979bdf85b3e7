"""`kvswarm bench io-layers` on small data: every layer measured, and its verified ring checks what it reads."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xxhash

from kvswarm.bench import io_layers
from kvswarm.cli import main
from kvswarm.errors import KVSwarmError
from kvswarm.format import HEADER_SIZE, payload_offset
from kvswarm.io import native as native_io

pytestmark = pytest.mark.skipif(not native_io.enabled(), reason="the native read path is not built")


def test_bench_io_layers_quick_writes_every_layer(tmp_path):
    out = tmp_path / "layers.json"
    assert main(["bench", "io-layers", "--quick", "--data-mib", "8", "--seconds", "0.1", "--rounds", "2",
                 "--sizes", "4k,16k", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    s = res["summary"]
    for name in ("4k", "16k"):
        size = res["sizes"][name]
        for layer in io_layers.LAYERS:
            assert len(size["samples"][layer]) == 2 and s[f"layer_cpu_s_per_gb_{layer}_{name}"] > 0
            if layer != "raw":
                assert s[f"layer_ratio_{layer}_{name}"] > 0
        # The ring keeps reads in flight, never more than every drive's queue depth.
        assert 0 < s[f"ring_reads_in_flight_{name}"] <= size["raw_depth"] * 1.01
        assert size["raw_depth"] == res["drives"]["drives"] * size["queue_depth_per_drive"]
        assert size["raw_span_buffers"] == size["store_shape"][0] * size["store_shape"][1]


def test_the_verified_ring_refuses_a_payload_that_does_not_match_its_checksum(tmp_path):
    size, n = 16384, 16
    data = np.random.default_rng(1).integers(0, 256, n * size, dtype=np.uint8).tobytes()
    path = tmp_path / "drive"
    path.write_bytes(data)
    poff = payload_offset(size - HEADER_SIZE)
    sums = np.array([xxhash.xxh3_64_intdigest(data[i * size + poff:(i + 1) * size]) for i in range(n)], np.uint64)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        ios = [(0, i * size) for i in range(n)]
        sample, held = io_layers.ring_read([fd], ios, sums, size, 4, 4, 2, 0.05)
        assert sample.gbps > 0 and 0 < held <= 4.04
        sums[5] ^= 1
        with pytest.raises(KVSwarmError, match="did not verify"):
            io_layers.ring_read([fd], ios, sums, size, 4, 4, 2, 0.05)
    finally:
        os.close(fd)
