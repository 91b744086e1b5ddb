"""Protobuf's base-128 varints, by hand: for the codecs that write or scan messages without protobuf's
copies (`wire.encode_record` / `decode_record`, and `wire_push`'s PushWeights chunks). Pure; stdlib only.
"""

from __future__ import annotations


def encode(n: int, pad: int = 0) -> bytes:
    """`n` as a protobuf varint, `pad` bytes longer than it need be (0x80 continuation bytes, then 0x00:
    the same value to every protobuf parser)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    if pad:
        out += bytes((n | 0x80,)) + b"\x80" * (pad - 1) + b"\x00"
    else:
        out.append(n)
    return bytes(out)


def decode(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, position after it) of the varint at data[pos] — records and PushWeights messages alike;
    ValueError when it runs past the end of the message (or past 64 bits)."""
    try:
        byte = data[pos]
        if byte < 0x80:  # most tags and small lengths: one byte
            return byte, pos + 1
        value, shift = byte & 0x7F, 7
        while shift < 64:
            pos += 1
            byte = data[pos]
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value, pos + 1
            shift += 7
    except IndexError:
        pass
    raise ValueError("a message is truncated or malformed: a varint runs past its end")
