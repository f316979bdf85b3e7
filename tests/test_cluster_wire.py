"""The cluster's value frames, configuration and publication policies (no processes)."""

from __future__ import annotations

import pytest

from kvswarm.cluster import ClusterConfig, make_publication
from kvswarm.cluster import wire
from kvswarm.errors import ClusterError
from kvswarm.format import key_digest


def test_frame_round_trip_and_every_flipped_bit_is_a_miss():
    d = key_digest(b"block-key")
    payload = bytes(range(256)) * 3
    frame = wire.pack(d, payload)
    assert bytes(wire.unpack(d, frame)) == payload
    for bit in range(0, len(frame) * 8, 7):  # header and payload
        bad = bytearray(frame)
        bad[bit // 8] ^= 1 << (bit % 8)
        assert wire.unpack(d, bad) is None, bit
    assert wire.unpack(key_digest(b"other-key"), frame) is None  # stored under another key
    assert wire.unpack(d, frame[:-1]) is None and wire.unpack(d, frame[:10]) is None  # torn


def test_config_from_engine_section():
    c = ClusterConfig.from_dict({"master": "etcd://127.0.0.1:2379", "replicas": 2, "protocol": "rdma"})
    assert c.replicas == 2 and c.metadata == "P2PHANDSHAKE"
    with pytest.raises(ClusterError, match="unknown cluster option"):
        ClusterConfig.from_dict({"mastr": "x"})
    with pytest.raises(ClusterError):
        ClusterConfig(protocol="udp")
    with pytest.raises(ClusterError):
        ClusterConfig(replicas=0)


def test_publication_policies():
    assert make_publication("all").publish(1) and not make_publication("none").publish(9)
    s = make_publication("sighted:3")
    assert not s.publish(2) and s.publish(3)
    with pytest.raises(ValueError, match="unknown publication policy"):
        make_publication("sometimes")
