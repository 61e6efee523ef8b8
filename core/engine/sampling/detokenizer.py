from __future__ import annotations

from engine.sampling.params import SamplingParams
from engine.sampling.stop import find_stop, partial_stop_len

# Prompt tokens decoded before the first output token, so tokenizers that drop a leading space
# at the start of a decode (SentencePiece) still produce it for the first output token.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Never emits broken UTF-8 (holds back while the decoded text ends with U+FFFD), applies stop
    strings (the stop string and what follows are not emitted; none is looked for before
    min_new_tokens tokens), honours skip_special_tokens. Works with any HF tokenizer
    (PreTrainedTokenizerFast) via tokenizer.decode. Each step decodes only a window of the last
    few tokens, so the cost per token does not grow with the output. Pass the tokens whose text
    should appear: a final EOS or stop_token_ids token is usually left out.
    """

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._params = params
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # ids[prefix:read] were already turned into text; ids[read:] are not yet.
        self._prefix = 0
        self._read = len(self._ids)
        self._num_output = 0
        self._held = ""  # decoded, but possibly the start of a stop string
        self._chunks: list[str] = []
        self._stopped = False
        self.matched_stop: str | None = None  # the stop string that ended the output

    @property
    def text(self) -> str:
        """The full emitted text so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; later tokens add no text."""
        return self._stopped

    def add(self, token_ids: list[int]) -> str:
        """Append new output tokens; return the text that is now safe to emit (may be "")."""
        if self._stopped:
            return ""
        self._ids.extend(token_ids)
        self._num_output += len(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def finish(self) -> str:
        """Flush the held-back text at the end of the request (a stop string stays out)."""
        if self._stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._params.skip_special_tokens,
            # Clean-up rewrites text around a window's edges, so windows would not add up.
            clean_up_tokenization_spaces=False,
        )

    def _decode_new(self, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if not final and (len(after) <= len(before) or after.endswith(_INCOMPLETE)):
            return ""
        # The window starts where the last one ended, at a character boundary.
        self._prefix, self._read = self._read, len(self._ids)
        del self._ids[: self._prefix]
        self._read -= self._prefix
        self._prefix = 0
        return after[len(before) :]

    def _emit(self, delta: str, final: bool) -> str:
        stops = self._params.stop
        text = self._held + delta
        self._held = ""
        if stops and self._num_output >= self._params.min_new_tokens:
            at = find_stop(text, stops)
            if at is not None:
                self._stopped = True
                self.matched_stop = next(x for x in stops if text.find(x) == at)
                text = text[:at]
            elif not final:
                keep = partial_stop_len(text, stops)
                text, self._held = text[: len(text) - keep], text[len(text) - keep :]
        if text:
            self._chunks.append(text)
        return text
