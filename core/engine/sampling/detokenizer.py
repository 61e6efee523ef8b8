"""IncrementalDetokenizer: a request's growing output ids turned into text deltas (a window of
the last few tokens decoded per step), with its stop strings applied; and ``check``, the engine
thread's stop-string verdict per token, which decodes only where a stop string might end
(sampling/stop_mask.py)."""

from __future__ import annotations

from engine.sampling.params import SamplingParams
from engine.sampling.stop_mask import (INCOMPLETE, MAY_END, PARTIAL, PARTIAL_FREE, SAFE,
                                       StopMask, stop_mask)
from engine.sampling.window_decode import window_decoder

# Prompt tokens decoded before the first output token, so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still produce it for the first output token.
_CONTEXT_TOKENS = 5
MAX_DIRTY = 32  # queued tokens with partial characters decoded together at most


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Never emits broken UTF-8 (holds back while the decoded text ends with U+FFFD), applies stop
    strings (the stop string and what follows are not emitted; none is looked for before
    min_new_tokens tokens), honours skip_special_tokens. Works with any HF tokenizer
    (PreTrainedTokenizerFast) via tokenizer.decode. Each step decodes only a window of the last
    few tokens and looks for stop strings only in the text not emitted yet (at most the longest
    stop string held back, plus the new text), so the cost per token does not grow with the
    output; nothing re-joins the text emitted so far (``take`` returns only the new text).
    Pass the tokens whose text should appear: a final EOS or stop_token_ids token is usually
    left out.
    """

    # (slots: the engine thread touches one of these per request with stop strings each step)
    __slots__ = ("_tokenizer", "_decode_fn", "_concatenative", "_before", "_params", "_skip",
                 "_pieces", "_stops", "_min_new", "_partial_ends", "_prefixes", "_ids",
                 "_prefix", "_read", "_num_output", "_held", "_chunks", "_fresh", "length",
                 "_stopped", "matched_stop", "pending", "dirty", "_mask", "codes",
                 "_mask_future")

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams,
                 decode=None):
        self._tokenizer = tokenizer
        self._decode_fn = decode or window_decoder(tokenizer)
        # with a concatenative decoder the text of ids[prefix:read] is the last delta decoded:
        # one decode per token instead of two
        self._concatenative = getattr(self._decode_fn, "concatenative", False)
        self._before: str | None = None  # the text of ids[prefix:read], when known
        self._params = params
        self._skip = params.skip_special_tokens
        pieces = getattr(self._decode_fn, "pieces", None)
        self._pieces = pieces[self._skip] if pieces is not None else None
        self._stops = list(params.stop)
        self._min_new = params.min_new_tokens
        # the characters a held-back partial stop string can end with: a text whose last
        # character is none of them holds nothing back (the common case: no scan)
        self._partial_ends = frozenset(c for x in self._stops for c in x[:-1])
        # every proper prefix of a stop string, longest first: what partial_stop_len looks
        # for, as one str.endswith first (most texts end in none)
        self._prefixes = tuple(sorted({x[:n] for x in self._stops for n in range(1, len(x))},
                                      key=len, reverse=True))
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # ids[prefix:read] were already turned into text; ids[read:] are not yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._num_output = 0
        self._held = ""  # decoded, but possibly the start of a stop string
        self._chunks: list[str] = []
        self._fresh: list[str] = []  # emitted since the last take()
        self.length = 0  # characters emitted so far
        self._stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the output
        # ``check`` (the engine thread's stop-string check): tokens that cannot end a stop
        # string wait in pending, undecoded, until one that might comes (or text is asked for)
        # check's most common case, for a caller that inlines it (the scheduler's commit, for
        # every token of every request with stop strings): with tokens queued already (pending
        # not empty) and ``codes[token] == 0`` (token < len(codes)), ``check(token)`` only
        # appends the token to ``pending`` and returns False
        self.pending: list[int] = []
        # pending holds a partial character (PARTIAL_FREE); Scheduler.commit queues such tokens
        # inline (pending, codes and dirty are what it touches)
        self.dirty = False
        self._mask: StopMask | None = None
        self.codes = b""  # the StopMask's codes, once it is ready
        self._mask_future = (stop_mask(self._decode_fn, self._stops, self._skip)
                             if self._pieces is not None else None)

    @property
    def text(self) -> str:
        """The full emitted text so far (joins it: for the end of a request, not per step)."""
        if self.pending:
            self._flush()
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def take(self) -> str:
        """The text emitted since the last ``take`` (a streamed delta)."""
        if self.pending:
            self._flush()
        fresh = self._fresh
        if not fresh:  # (None: ``check`` was used, and nobody takes deltas)
            return ""
        self._fresh = []
        return fresh[0] if len(fresh) == 1 else "".join(fresh)

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later tokens add no text."""
        return self._stopped

    def check(self, token: int) -> bool:
        """Engine thread: take one output token; True once a stop string ended the output.
        The same verdict, at the same token, as ``add([token])`` followed by ``stopped``, but
        a token whose text cannot end a stop string (the StopMask says so, and the text so far
        ends at a character boundary) is only queued: no decode, no search. The queued tokens
        are turned into text (their cached pieces: still no decode) when a token that might end
        a stop string comes (one search over their text and its own), or when anything asks
        for text."""
        mask = self._mask
        if mask is None:
            fut = self._mask_future
            if fut is not None and fut.done():
                mask = self._mask = fut.result()
                self._mask_future = None
                if mask is not None:
                    self.codes = mask.maybe
            self._fresh = None  # the engine side takes no deltas (the detokenizer thread does)
            if mask is None:
                self.add([token])
                return self._stopped
        maybe = mask.maybe
        code = maybe[token] if token < len(maybe) else PARTIAL
        pending = self.pending
        if pending:  # from a character boundary on, each of them at or after min_new_tokens
            if code == SAFE:  # (the scheduler's commit does this one inline: see pending)
                pending.append(token)
                return False
            if code == PARTIAL_FREE:
                pending.append(token)
                self.dirty = True
                if len(pending) >= MAX_DIRTY:  # decoded in windows of a few tokens
                    self._flush()
                return False
            if code == MAY_END:
                if not self.dirty:
                    return self._emit_pending(token)
                pending.append(token)
                # decoded with the queued run, in one window: it ends with whole characters
                # (this token's), so the search sees what one token at a time would have seen
                self._flush()
                return self._stopped
        elif code != PARTIAL and self._before is not None and self._read == len(self._ids) \
                and not self._stopped:
            if code == MAY_END:
                return self._emit_pending(token)
            if self._num_output >= self._min_new - 1:  # no text before min_new_tokens queued
                pending.append(token)
                self.dirty = code == PARTIAL_FREE
                return False
        self.add([token])  # (the queued tokens first)
        return self._stopped

    def _emit_pending(self, token: int) -> bool:
        """The queued tokens and ``token`` (whole characters, at a character boundary), as one
        delta of their pieces: the search finds what ``add`` one token at a time would have
        found (none can end in the queued tokens' text: the mask says so of each of them)."""
        pending, pieces = self.pending, self._mask.pieces
        piece = pieces[token]
        if pending:
            pending.append(token)
            self.pending = []
            text = "".join([pieces[t] for t in pending])
            self._num_output += len(pending)
        else:
            text = piece
            self._num_output += 1
        self._ids = [token]  # the next window starts here, at a character boundary
        self._prefix, self._read = 0, 1
        self._before = piece
        self._emit(text, final=False)
        return self._stopped

    def _flush(self) -> str:
        """Turn the queued tokens into text: what ``add`` one token at a time would have
        emitted and held back (no stop string can end in their text, but in the last one's
        when ``check`` queued one that might, to decode it with a run of partial characters).
        Whole characters are their cached pieces; a run with partial characters is decoded."""
        pending, pieces = self.pending, self._mask.pieces
        self.pending = []
        if self.dirty:
            # the text so far ends with a whole character: the queued tokens' text is theirs
            # alone, decoded as a window of its own
            self.dirty = False
            self._ids, self._prefix, self._read, self._before = pending, 0, 0, ""
            self._num_output += len(pending)
            return self._emit(self._decode_new(final=False), final=False)
        text = "".join([pieces[t] for t in pending])
        last = pending[-1]
        self._ids = [last]  # the window starts at the last one, at a character boundary
        self._prefix, self._read = 0, 1
        self._before = pieces[last]
        self._num_output += len(pending)
        return self._emit(text, final=False)

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the text that is now safe to emit (may be "")."""
        if self._stopped:
            return ""
        if self.pending:
            flushed = self._flush()
            return flushed + self.add(token_ids) if token_ids else flushed
        pieces = self._pieces
        if pieces is not None and len(token_ids) == 1 and self._before is not None \
                and self._read == len(self._ids):
            # one token after a window that ended at a character boundary (the usual step):
            # with a concatenative decoder its text is the token's own text (cached per
            # tokenizer), when that is whole characters; what _decode_new would do, undecoded
            t = token_ids[0]
            piece = pieces.get(t)
            if piece is None:
                piece = pieces[t] = self._decode_fn([t], self._skip)
            if piece and INCOMPLETE not in piece:
                self._ids = [t]
                self._prefix, self._read = 0, 1
                self._before = piece
                self._num_output += 1
                return self._emit(piece, final=False)
        self._ids.extend(token_ids)
        self._num_output += len(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """Flush the held-back text at the end of the request (a stop string stays out)."""
        if self._stopped:
            return ""
        flushed = self._flush() if self.pending else ""
        return flushed + self._emit(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        mask = self._mask  # with a stop mask, from the tokens' bytes (no tokenizer call)
        if mask is not None:
            text = mask.decode_bytes(ids)
            if text is not None:
                return text
        return self._decode_fn(ids, self._skip)

    def _decode_new(self, final: bool) -> str:
        ids, prefix, read = self._ids, self._prefix, self._read
        before = self._before
        if before is None:
            before = self._before = self._decode(ids[prefix:read]) if read > prefix else ""
        after = self._decode(ids[prefix:] if prefix else ids)
        if not final and (len(after) <= len(before) or after.endswith(INCOMPLETE)):
            return ""
        # The window starts where the last one ended, at a character boundary.
        if read:
            del ids[:read]
        self._prefix, self._read = 0, len(ids)
        delta = after[len(before):]
        # the next window's text so far: decoded from its tokens alone next time, unless the
        # decoder is concatenative (then it is this delta: the window starts at a character
        # boundary); after a final flush nothing is decoded any more
        # (not when the text before ended in a partial character: the window's first tokens
        # finish it, and their text alone differs)
        self._before = (delta if self._concatenative and not final
                        and not before.endswith(INCOMPLETE) else None)
        return delta

    def _emit(self, delta: str, final: bool) -> str:
        stops = self._stops
        text = self._held + delta if self._held else delta
        self._held = ""
        if stops and text and self._num_output >= self._min_new:
            at, matched = -1, None
            for x in stops:  # the earliest; on a tie the first listed
                i = text.find(x)
                if i >= 0 and (at < 0 or i < at):
                    at, matched = i, x
            if matched is not None:
                self._stopped = True
                self.matched_stop = matched
                text = text[:at]
            elif not final and text[-1] in self._partial_ends and \
                    text.endswith(self._prefixes):
                keep = next(len(x) for x in self._prefixes if text.endswith(x))
                if keep:  # (partial_stop_len(text, stops))
                    text, self._held = text[: len(text) - keep], text[len(text) - keep:]
        if text:
            self._chunks.append(text)
            if self._fresh is not None:
                self._fresh.append(text)
            self.length += len(text)
        return text
