"""The extent header codec (kvswarm.format): what a put packs is what a read expects and recovery parses."""

from __future__ import annotations

import numpy as np

from kvswarm.format import (
    ALIGN,
    FLAG_SECTOR_PAYLOAD,
    HEADER_BODY,
    HEADER_SIZE,
    Header,
    expected_headers,
    header_candidates,
    header_fields,
    key_digest,
    pack_header,
    parse_header,
    sector_payload,
)

PARTS = [(key_digest(b"a"), 100, 0, 1, 7, 0x1234, False), (key_digest(b"b"), 3 * ALIGN, 1, 2, 9, 2**64 - 1, True)]


def test_a_packed_header_parses_back_and_is_what_a_read_expects():
    packed = [pack_header(*p) for p in PARTS]
    assert all(len(h) == HEADER_SIZE for h in packed)
    for (dg, n, part, parts, gen, csum, sector), h in zip(PARTS, packed):
        assert parse_header(h) == header_fields(h) == Header(FLAG_SECTOR_PAYLOAD if sector else 0, dg, n, part,
                                                             parts, gen, csum)
    col = lambda i, t: np.array([p[i] for p in PARTS], t)  # noqa: E731
    want = expected_headers(np.array([p[0] for p in PARTS], "V16"), col(1, np.uint32), col(2, np.uint16),
                            col(3, np.uint16), col(4, np.uint64), col(5, np.uint64),
                            sector_payload(np.array([100, 3 * ALIGN])))
    assert [bytes(r) for r in want] == [h[:HEADER_BODY.size] for h in packed]


def test_a_damaged_header_does_not_parse_and_headers_are_found_by_sector():
    h = bytearray(pack_header(*PARTS[0]))
    h[20] ^= 1
    assert parse_header(bytes(h)) is None and parse_header(b"\0" * HEADER_SIZE) is None
    sectors = np.zeros((4, ALIGN), np.uint8)
    sectors[1, :HEADER_SIZE] = np.frombuffer(pack_header(*PARTS[1]), np.uint8)
    sectors[3, :HEADER_SIZE] = np.frombuffer(bytes(h), np.uint8)  # magic and version intact: a candidate
    assert header_candidates(sectors).tolist() == [1, 3]
