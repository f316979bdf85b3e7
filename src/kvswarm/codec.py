"""Lossless codecs for stored KV chunks: fewer bytes on drives whose bandwidth, not the CPU, binds.

Real KV compresses: SmolLM2's bf16 keys and values shrink about 1.45x under a byte shuffle
(every element's high bytes together, which hold the sign and exponent that neighbouring values
share) followed by zstd at level 1 (measured on its KV of real text; random bytes do not shrink).
A drive capped at 100 MB/s then delivers about 145 MB/s of KV.  On this machine's two cores Blosc2
compressed such chunks at 0.43-0.56 GB/s and decompressed them at 1.5-1.75 GB/s: on NVMe that reads
GB/s per drive the CPU would bind instead, so the codec is a setting, off by default.

A frame is a 16-byte header (magic, mode, element size, the chunk's length) and the payload: a
Blosc2 chunk (shuffle + zstd; Blosc2 rather than hand-written shuffling because it shuffles with
SIMD and compresses blocks on several threads without the GIL), or the chunk's bytes as they are
when compression would not make them smaller.  The store checksums the frame as it checksums any
object; :meth:`Codec.decode_into` also checks that the frame decodes to exactly the length its
header states, so a frame that is not one is a miss, never wrong KV.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

HEADER = struct.Struct("<4sBBxxQ")  # magic, mode, element size, decoded length
MAGIC = b"KVZ1"


class Mode(enum.IntEnum):
    RAW = 0  # the chunk's bytes as they are (compression would not have shrunk them)
    BLOSC2 = 1  # a Blosc2 chunk: byte shuffle of ``typesize``-byte elements, then zstd


class Compression(enum.Enum):
    NONE = "none"
    ZSTD = "zstd"  # Blosc2: shuffle + zstd level 1

    @classmethod
    def parse(cls, value: str) -> Compression:
        try:
            return cls(str(value).strip().lower())
        except ValueError:
            raise ValueError(f"compression must be one of {[c.value for c in cls]}, not {value!r}") from None


@dataclass(frozen=True)
class Codec:
    """Frames of chunks whose elements are ``typesize`` bytes wide (2 for bf16 / fp16 KV)."""

    typesize: int = 2
    level: int = 1

    def __post_init__(self) -> None:
        import blosc2  # noqa: F401  (fail at configuration, not at the first store)

        if not 1 <= self.typesize <= 255:
            raise ValueError(f"typesize must be 1-255, not {self.typesize}")

    @property
    def name(self) -> str:
        return f"blosc2-shuffle{self.typesize}-zstd{self.level}"

    def max_frame_bytes(self, length: int) -> int:
        """The largest frame of a ``length``-byte chunk (what to reserve before encoding it)."""
        return HEADER.size + length

    def encode(self, data: memoryview | bytes) -> bytes:
        """The frame of ``data`` (a C-contiguous buffer)."""
        import blosc2

        view = memoryview(data).cast("B")
        n = len(view)
        if 0 < n < blosc2.MAX_BUFFERSIZE:
            packed = blosc2.compress2(view, typesize=self.typesize, clevel=self.level, codec=blosc2.Codec.ZSTD,
                                      filters=[blosc2.Filter.SHUFFLE])
            if len(packed) < n:
                return HEADER.pack(MAGIC, Mode.BLOSC2, self.typesize, n) + packed
        return HEADER.pack(MAGIC, Mode.RAW, self.typesize, n) + bytes(view)

    @staticmethod
    def decoded_length(frame: memoryview | bytes) -> int | None:
        """The chunk length a frame's header states; None when it is not a frame."""
        if len(frame) < HEADER.size:
            return None
        magic, mode, _, n = HEADER.unpack_from(frame)
        return n if magic == MAGIC and mode in Mode._value2member_map_ else None

    @staticmethod
    def decode_into(frame: memoryview | bytes, out: memoryview) -> bool:
        """Decode ``frame`` into ``out``, which must be exactly as long as the chunk; False (``out``
        then undefined) when the frame is not a frame of a chunk of that length."""
        import blosc2

        out = memoryview(out).cast("B")
        n = Codec.decoded_length(frame)
        if n is None or n != len(out):
            return False
        body = memoryview(frame)[HEADER.size:]
        if frame[4] == Mode.RAW:
            if len(body) != n:
                return False
            out[:] = body
            return True
        try:
            if blosc2.get_cbuffer_sizes(body)[:2] != (n, len(body)):
                return False
            blosc2.decompress2(body, dst=out)
        except (RuntimeError, ValueError, TypeError):
            return False
        return True
