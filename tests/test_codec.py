"""kvswarm.codec: frames decode to exactly what was encoded, or not at all."""

from __future__ import annotations

import numpy as np
import pytest

from kvswarm.codec import HEADER, Codec, Compression, Mode


def bf16_like(n: int, seed: int = 0) -> bytes:
    """The high halves of float32 normals: bf16 values, compressible as real KV is."""
    f = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return (f.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def test_compressible_chunks_shrink_and_decode_exactly():
    data = bf16_like(1 << 16)
    frame = Codec(typesize=2).encode(data)
    assert frame[4] == Mode.BLOSC2 and len(frame) < 0.9 * len(data)
    assert Codec.decoded_length(frame) == len(data)
    out = bytearray(len(data))
    assert Codec.decode_into(frame, memoryview(out)) and bytes(out) == data


@pytest.mark.parametrize("n", [0, 1, 4097])
def test_incompressible_chunks_are_stored_as_they_are(n):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    frame = Codec(typesize=2).encode(data)
    assert frame[4] == Mode.RAW and len(frame) == HEADER.size + n <= Codec().max_frame_bytes(n)
    out = bytearray(n)
    assert Codec.decode_into(frame, memoryview(out)) and bytes(out) == data


def test_what_is_not_a_whole_frame_never_decodes():
    data = bf16_like(4096, seed=1)
    frame = Codec().encode(data)
    out = memoryview(bytearray(len(data)))
    assert not Codec.decode_into(frame[:-1], out)  # torn
    assert not Codec.decode_into(frame + b"\0", out)  # trailing bytes
    assert not Codec.decode_into(frame, memoryview(bytearray(len(data) - 2)))  # another length
    assert not Codec.decode_into(b"XXXX" + frame[4:], out)  # not a frame
    assert not Codec.decode_into(frame[:8], out)  # header cut
    for field in (4, 12):  # Blosc2's own header: its decoded length, its compressed length
        bad = bytearray(frame)
        bad[HEADER.size + field] ^= 0x01
        assert not Codec.decode_into(bytes(bad), out)
    assert not Codec.decode_into(Codec().encode(b"") + b"\0", memoryview(bytearray(0)))


def test_the_setting_is_parsed_or_refused():
    assert Compression.parse(" ZSTD ") is Compression.ZSTD and Compression.parse("none") is Compression.NONE
    with pytest.raises(ValueError, match="compression must be one of"):
        Compression.parse("lz5")
    with pytest.raises(ValueError, match="typesize"):
        Codec(typesize=0)
