"""Stop masks: for one set of stop strings, which tokens' text could end one. The engine thread's
stop-string check (IncrementalDetokenizer.check) queues the tokens that cannot, undecoded, and
decodes only around those that might. Built once per set of stop strings and tokenizer, on a
background thread (a decode of every token of the vocabulary)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

INCOMPLETE = "\ufffd"  # what a decode shows for a partial UTF-8 character

# StopMask.maybe codes
SAFE = 0  # whole characters, none a stop string's last one: cannot end a stop string
MAY_END = 1  # whole characters, where a stop string could end (its last character, preceded
# within the token by what precedes that character in the stop string)
PARTIAL = 2  # anything else (no text, an added token with a partial character): decoded
PARTIAL_FREE = 3  # a byte-level token with a partial character (U+FFFD) none of whose bytes
# is the last byte of a stop string's last character: its text in context (with its neighbours)
# cannot hold that character either; queued, and decoded with the queued tokens around it

_MAX_MASKS = 256  # StopMasks kept per decoder (one per set of stop strings; vocab bytes each)

_mask_pool: ThreadPoolExecutor | None = None
_mask_lock = threading.Lock()


class StopMask:
    """For one set of stop strings (and skip_special_tokens): ``maybe[t]`` is SAFE when token
    ``t``'s text is whole characters and no stop string can end in it, MAY_END when it is
    whole characters and one could (a stop's last character, preceded within the token by what
    precedes it in the stop: "er" may end "never", "ar" cannot), PARTIAL_FREE or
    PARTIAL (see there) when it is not whole characters; ``pieces[t]`` is the token's text
    alone. Only for a concatenative decoder (byte-level BPE), where a token's text in context is
    its text alone once the text before it ends at a character boundary."""

    __slots__ = ("maybe", "pieces", "raw")

    def __init__(self, maybe: bytes, pieces: list[str], raw: list[bytes | None] | None = None):
        self.maybe, self.pieces = maybe, pieces
        self.raw = raw  # each token's bytes (None: an added token), for decode_bytes

    def decode_bytes(self, ids: list[int]) -> str | None:
        """The window decoder's text of ``ids`` from the tokens' bytes, without a call into
        the tokenizer: a byte-level BPE's decode is its tokens' bytes joined and decoded as
        UTF-8 with maximal invalid subsequences replaced by U+FFFD (from_utf8_lossy), which
        is what Python's "replace" does. None when a token's bytes are not known (added or
        special tokens): then the tokenizer decodes."""
        raw = self.raw
        try:
            parts = [raw[t] for t in ids]
        except (IndexError, TypeError):
            return None
        if None in parts:
            return None
        return b"".join(parts).decode("utf-8", "replace")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table (what a byte-level BPE vocabulary is spelt in)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
          *range(ord("\xae"), ord("\xff") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _token_bytes(decode, pieces: list[str]) -> list[bytes | None]:
    """Each token's bytes (None: an added token, or one whose bytes do not decode to its
    piece: treated as unknown)."""
    backend = getattr(decode, "backend", None)
    if backend is None:
        return [None] * len(pieces)
    inv = {c: b for b, c in bytes_to_unicode().items()}
    added = set(backend.get_added_tokens_decoder())
    out: list[bytes | None] = []
    for t, piece in enumerate(pieces):
        s = None if t in added else backend.id_to_token(t)
        if s is None or any(c not in inv for c in s):
            out.append(None)
            continue
        b = bytes(inv[c] for c in s)
        out.append(b if b.decode("utf-8", "replace") == piece else None)
    return out


class _VocabIndex:
    """What every StopMask of a decoder (and skip_special_tokens) starts from: each token's
    code without stop strings (SAFE, PARTIAL_FREE or PARTIAL), and which tokens hold a given
    character (whole-character tokens) or byte (partial-character tokens)."""

    def __init__(self, decode, skip: bool):
        self.pieces = [decode([t], skip) for t in range(decode.vocab_size)]
        self.raw = raw = _token_bytes(decode, self.pieces)
        self.base = bytearray(len(self.pieces))
        self.by_char: dict[str, list[int]] = {}
        self.by_byte: dict[int, list[int]] = {}
        for t, p in enumerate(self.pieces):
            if not p:
                self.base[t] = PARTIAL
            elif INCOMPLETE in p:
                b = raw[t]
                if b is None:
                    self.base[t] = PARTIAL
                else:
                    self.base[t] = PARTIAL_FREE
                    for x in set(b):
                        self.by_byte.setdefault(x, []).append(t)
            else:
                for c in set(p):
                    self.by_char.setdefault(c, []).append(t)


def _can_end_in(piece: str, stop: str) -> bool:
    """Whether ``stop`` can end inside ``piece`` (whatever text comes before it): at some
    position holding stop's last character, the piece's characters up to there are the end
    of ``stop`` (all of it, or the part of its tail that fits after the piece's start)."""
    last, n = stop[-1], len(stop)
    i = piece.find(last)
    while i >= 0:
        k = min(i + 1, n)
        if piece[i + 1 - k: i + 1] == stop[n - k:]:
            return True
        i = piece.find(last, i + 1)
    return False


def _build_mask(decode, stops: frozenset, skip: bool) -> StopMask:
    index = decode.vocab_index.get(skip)
    if index is None:
        index = decode.vocab_index[skip] = _VocabIndex(decode, skip)
    codes, pieces = index.base[:], index.pieces
    lasts = {x[-1] for x in stops}
    for c in lasts:
        ending = [x for x in stops if x[-1] == c]
        for t in index.by_char.get(c, ()):
            if any(_can_end_in(pieces[t], x) for x in ending):
                codes[t] = MAY_END
    for b in {c.encode("utf-8")[-1] for c in lasts}:  # the last byte of each
        for t in index.by_byte.get(b, ()):
            codes[t] = PARTIAL
    return StopMask(bytes(codes), index.pieces, index.raw)


def stop_mask(decode, stops: list[str], skip: bool) -> Future | None:
    """A Future of the StopMask of ``stops`` for window decoder ``decode``, computed once per
    set of last characters on a background thread (not the engine thread: a decode of every
    token of the vocabulary); None when no mask can be used: a decoder that is not
    concatenative, or a stop string that ends in whitespace or holds U+FFFD (kept
    conservative)."""
    global _mask_pool
    masks = getattr(decode, "masks", None)
    if masks is None or not getattr(decode, "concatenative", False) or not stops:
        return None
    if any(not x or x[-1].isspace() or INCOMPLETE in x for x in stops):
        return None
    key = (frozenset(stops), skip)
    fut = masks.get(key)
    if fut is None:
        with _mask_lock:
            fut = masks.get(key)
            if fut is None:
                if _mask_pool is None:
                    _mask_pool = ThreadPoolExecutor(1, thread_name_prefix="stop-mask")
                if len(masks) >= _MAX_MASKS:  # clients choose the stops: keep the newest
                    masks.pop(next(iter(masks)))
                fut = masks[key] = _mask_pool.submit(_build_mask, decode, key[0], skip)
    return fut
