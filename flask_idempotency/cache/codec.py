"""The bytes a cached response is kept as in Redis: versioned, compact, data only.

Never pickle: whoever can write to Redis must not be able to run code in the
application. A value is parsed as plain data, and anything that does not parse
exactly - an unknown version or flag, a truncated or padded value, a body that
inflates past the limit - is rejected, which the cache turns into a miss:
PostgreSQL still has the record.

Layout of version 2 (integers big-endian, lengths unsigned 16-bit)::

    u8  version           2
    u8  flags             bit 0: body is zlib-compressed; other bits must be 0
    u16 status
    u64 expires at        Unix time in milliseconds: the record's end of life
    u16 fingerprint length, fingerprint bytes
    u16 header count, then per header:
        u16 name length, name (UTF-8)   u16 value length, value (UTF-8)
    u32 body length, body (compressed if flagged), and nothing after it

Every field is framed and the value must end exactly where the body does, so
any truncated or padded value is rejected rather than replayed as a shorter
body. In Redis the value is followed by its HMAC tag (``keyring.py``), checked
before anything here parses it.

Version 1 (0.2.x) had no expiry and no tag. Its entries are never read by this
version (they live under other Redis keys, and their version byte is refused),
and this version's entries are never read by 0.2.x (which reads only its own
keys, and refuses version 2): during a rolling upgrade each side's entries are
misses for the other, and PostgreSQL answers.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from ..store.base import StoredResponse
from .base import CachedRecord

FORMAT_VERSION = 2
#: What every value of this format starts with.
VERSION_BYTE = bytes([FORMAT_VERSION])

#: The body that follows the headers is zlib data.
FLAG_COMPRESSED = 0x01
_KNOWN_FLAGS = FLAG_COMPRESSED

#: zlib level 1: on the completion path speed matters more than the last few
#: percent; JSON bodies still shrink several-fold, and inflating is equally
#: fast whatever the level.
COMPRESS_LEVEL = 1

_PREFIX = struct.Struct(">BBHQ")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")

#: Header names and values are ``str`` that may hold any code point (WSGI
#: gives latin-1 decoded bytes, an application may set anything); surrogatepass
#: makes every ``str`` encodable, so a round trip is exact.
_TEXT_ERRORS = "surrogatepass"


class CodecError(ValueError):
    """A response that cannot be framed (a header over 64 KiB, a body over 4 GiB):
    it is simply not cached; PostgreSQL still replays it."""


class CorruptEntry(ValueError):
    """A cached value that is not a well-formed entry of a known version: a miss."""


class UnknownVersion(CorruptEntry):
    """Written by another release of this library (or by something else entirely)."""


class Entry(NamedTuple):
    record: CachedRecord
    #: When the record it copies expires, Unix milliseconds.
    expires_at: int


def encode(
    fingerprint: bytes, response: StoredResponse, *, expires_at: int, compress_over: int = 4096
) -> bytes:
    """Frame one completed response that may be replayed until ``expires_at``
    (Unix ms). Bodies above ``compress_over`` bytes (4 kB: deflating a few kB
    costs less than sending them) are deflated when that makes them smaller
    (random or already-compressed bodies do not shrink, and are kept as they are)."""
    body = response.body
    flags = 0
    if len(body) > compress_over:
        deflated = zlib.compress(body, COMPRESS_LEVEL)
        if len(deflated) < len(body):
            body, flags = deflated, FLAG_COMPRESSED
    try:  # struct refuses what does not fit its field (a status, a length)
        parts = [
            _PREFIX.pack(FORMAT_VERSION, flags, response.status, expires_at),
            _framed(fingerprint),
            _U16.pack(len(response.headers)),
        ]
        for pair in response.headers:
            parts += [_framed(text.encode("utf-8", _TEXT_ERRORS)) for text in pair]
        parts += [_U32.pack(len(body)), body]
    except struct.error as exc:
        raise CodecError(f"the response does not fit the format: {exc}") from None
    return b"".join(parts)


def decode(value: bytes, *, max_body: int | None = None) -> Entry:
    """Parse a cached value, or raise :class:`CorruptEntry`.

    ``max_body`` bounds how far a compressed body may inflate: a value crafted
    to inflate to gigabytes is rejected after ``max_body + 1`` bytes instead of
    exhausting the worker's memory.
    """
    if value and value[0] != FORMAT_VERSION:
        raise UnknownVersion(f"format version {value[0]}")
    if len(value) < _PREFIX.size:
        raise CorruptEntry("shorter than the fixed prefix")
    _, flags, status, expires_at = _PREFIX.unpack_from(value, 0)
    if flags & ~_KNOWN_FLAGS:
        raise CorruptEntry(f"unknown flags {flags:#04x}")
    reader = _Reader(value, _PREFIX.size)
    fingerprint = reader.framed()
    headers = [(reader.text(), reader.text()) for _ in range(reader.number(_U16))]
    body = reader.framed(_U32)
    if reader.offset != len(value):
        raise CorruptEntry("bytes after the body")
    if flags & FLAG_COMPRESSED:
        body = _inflate(body, max_body)
    elif max_body is not None and len(body) > max_body:
        raise CorruptEntry("body larger than any stored body")
    return Entry(
        CachedRecord(fingerprint, StoredResponse(status, tuple(headers), body)), expires_at
    )


def _framed(data: bytes, length: struct.Struct = _U16) -> bytes:
    """``data`` preceded by its length, a ``u16`` unless said otherwise."""
    return length.pack(len(data)) + data


def _inflate(data: bytes, max_body: int | None) -> bytes:
    inflater = zlib.decompressobj()
    try:
        body = inflater.decompress(data, 0 if max_body is None else max_body + 1)
    except zlib.error:
        raise CorruptEntry("body is not valid zlib data") from None
    if max_body is not None and (len(body) > max_body or inflater.unconsumed_tail):
        raise CorruptEntry("body inflates past the largest stored body")
    if not inflater.eof or inflater.unused_data:
        raise CorruptEntry("compressed body is truncated or padded")
    return body


class _Reader:
    """Bounds-checked reads: slicing past the end would silently truncate."""

    def __init__(self, data: bytes, offset: int) -> None:
        self._data = data
        self.offset = offset

    def _take(self, n: int) -> bytes:
        end = self.offset + n
        if end > len(self._data):
            raise CorruptEntry("truncated")
        chunk, self.offset = self._data[self.offset : end], end
        return chunk

    def number(self, fmt: struct.Struct) -> int:
        (n,) = fmt.unpack(self._take(fmt.size))
        return int(n)

    def framed(self, length: struct.Struct = _U16) -> bytes:
        """Bytes preceded by their length, a ``u16`` unless said otherwise."""
        return self._take(self.number(length))

    def text(self) -> str:
        """A header's name or value: framed UTF-8."""
        try:
            return self.framed().decode("utf-8", _TEXT_ERRORS)
        except UnicodeDecodeError:
            raise CorruptEntry("header is not UTF-8") from None
