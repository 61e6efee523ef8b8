"""A storage page: the K/V of ``page_tokens`` consecutive tokens of a prefix, keyed by the hash
chain of the prefix's pages (so any server on the same model, dtype and page size finds it,
after a restart too), and its byte format.

    magic (8 bytes) | header length (4, little endian) | header (JSON) | payload

The header records the identity (model, dtypes, page sizes, shapes), the key, the page's
tokens, the payload's length and its CRC-32; the payload is each layer's K then V. ``decode``
refuses (``PageError``, saying why) a truncated, corrupt or foreign page, which is then never
loaded.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import NamedTuple

import torch

MAGIC = b"ENGKVPG1"


class PageError(ValueError):
    """A stored page that must not be loaded (why is the message)."""


class PageKV(NamedTuple):
    k: list  # per layer, [page_tokens, heads, head_dim]
    v: list


def identity_seed(identity: dict) -> bytes:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()


def page_keys(tokens, page_tokens: int, seed: bytes, pages: int | None = None) -> list[str]:
    """The keys of the first ``pages`` (default: every whole) pages of ``tokens``: page i's key
    hashes page i-1's key and page i's tokens (the first page's, the identity's seed)."""
    n = len(tokens) // page_tokens if pages is None else pages
    keys, prev = [], seed
    for i in range(n):
        chunk = struct.pack(f"<{page_tokens}i", *tokens[i * page_tokens: (i + 1) * page_tokens])
        prev = hashlib.sha256(prev + chunk).digest()
        keys.append(prev.hex())
    return keys


def encode(key: str, identity: dict, tokens, page: PageKV) -> bytes:
    parts = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in (*page.k, *page.v)]
    payload = b"".join(parts)
    header = json.dumps({"key": key, "identity": identity, "tokens": list(tokens),
                         "payload_bytes": len(payload), "crc32": zlib.crc32(payload)}).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode(data: bytes, key: str, identity: dict, tokens, like: PageKV) -> PageKV:
    """The page in ``data``, checked against what the reader expects: its key, identity and
    tokens, and shapes/dtypes of ``like``'s tensors (one page of the host pool)."""
    if len(data) < len(MAGIC) + 4 or data[:len(MAGIC)] != MAGIC:
        raise PageError("not a page file (bad magic), or truncated")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(data[start: start + n])
    except ValueError:
        raise PageError("truncated or corrupt header") from None
    if header.get("identity") != identity:
        theirs = header.get("identity") or {}
        diff = sorted(k for k in set(identity) | set(theirs) if identity.get(k) != theirs.get(k))
        raise PageError(f"written by another model/dtype/page size (differs in "
                        f"{', '.join(diff)})")
    if header.get("key") != key or header.get("tokens") != list(tokens):
        raise PageError("its key or tokens are not the ones asked for")
    payload = memoryview(data)[start + n:]
    if len(payload) != header.get("payload_bytes"):
        raise PageError(f"truncated: {len(payload)} payload bytes of "
                        f"{header.get('payload_bytes')}")
    if zlib.crc32(payload) != header.get("crc32"):
        raise PageError("corrupt: the payload's checksum does not match")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out, offset = [], 0
    for t in (*like.k, *like.v):
        size = t.numel() * t.element_size()
        if offset + size > len(raw):
            raise PageError("the payload is shorter than this model's page")
        out.append(raw[offset: offset + size].view(t.dtype).view(t.shape))
        offset += size
    if offset != len(raw):
        raise PageError("the payload is longer than this model's page")
    layers = len(like.k)
    return PageKV(out[:layers], out[layers:])
