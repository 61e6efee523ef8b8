"""A tokenizer's decode of a short window of tokens, made once per tokenizer: the Rust tokenizer's
own decode for a plain HF fast tokenizer (a few times faster than ``tokenizer.decode`` on short
windows), whether its decoder is concatenative (a byte-level BPE), and the caches the
detokenizers and stop masks of that tokenizer share."""

from __future__ import annotations


def window_decoder(tokenizer):
    """``decode(ids, skip_special_tokens) -> str`` for ``tokenizer`` without clean-up: the Rust
    tokenizer's own decode when ``tokenizer`` is a plain HF fast tokenizer (what its ``decode``
    does, without the Python layers around it: a few times faster on the short windows the
    detokenizer decodes), else ``tokenizer.decode``. Its ``concatenative`` attribute is True
    when decoding two runs of tokens that meet at a character boundary gives the two texts
    joined (a byte-level BPE: GPT-2, Llama 3, Qwen, SmolLM2), unlike decoders that drop a
    leading space at the start of a decode (SentencePiece). Made once per tokenizer."""
    cached = getattr(tokenizer, "_engine_window_decoder", None)
    if cached is not None:
        return cached
    backend = getattr(tokenizer, "_tokenizer", None)
    try:
        from tokenizers import Tokenizer, decoders
        from transformers import PreTrainedTokenizerFast as Fast
    except ImportError:  # pragma: no cover - both come with the engine
        Tokenizer = Fast = None
    if (Tokenizer is not None and isinstance(backend, Tokenizer) and isinstance(tokenizer, Fast)
            and type(tokenizer).decode is Fast.decode and type(tokenizer)._decode is Fast._decode):
        decode = backend.decode

        def fn(ids, skip):
            return decode(ids, skip_special_tokens=skip)
        fn.concatenative = isinstance(backend.decoder, decoders.ByteLevel)
        # the text of each token alone, per skip_special_tokens (concatenative decoders only)
        fn.pieces = ({}, {}) if fn.concatenative else None
        fn.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        fn.backend = backend
    else:
        def fn(ids, skip):
            # Clean-up rewrites text around a window's edges, so windows would not add up.
            return tokenizer.decode(ids, skip_special_tokens=skip,
                                    clean_up_tokenization_spaces=False)
        fn.concatenative = False
        fn.pieces = None
    fn.masks = {}  # stop_mask's cache: (stop strings, skip) -> Future of a StopMask
    fn.vocab_index = {}  # skip -> _VocabIndex (every token's text alone, ...): stop_mask
    try:
        tokenizer._engine_window_decoder = fn
    except AttributeError:  # pragma: no cover - a tokenizer that takes no attributes
        pass
    return fn
