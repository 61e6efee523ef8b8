"""The engine thread's stop-string check (IncrementalDetokenizer.check): tokens whose text
cannot end a stop string (sampling/stop_mask.py's StopMask) are queued undecoded; the verdict
(stop or not, at which token, which stop string) and the text are those of a detokenizer fed
every token."""

from __future__ import annotations

import random

import pytest

from engine.sampling import IncrementalDetokenizer, SamplingParams
from engine.sampling.detokenizer import stop_mask, window_decoder


def _counting(tok):
    """The tokenizer's window decoder, counting its calls (same attributes)."""
    real = window_decoder(tok)

    def fn(ids, skip):
        fn.calls += 1
        return real(ids, skip)

    for name in ("concatenative", "pieces", "vocab_size", "masks", "vocab_index", "backend"):
        setattr(fn, name, getattr(real, name))
    fn.calls = 0
    return fn


def _stops(rng, text: str) -> list[str]:
    """Stop strings: pieces of ``text`` (so they occur) and characters that never do."""
    out = []
    for _ in range(rng.randint(1, 3)):
        if text and rng.random() < 0.8:
            a = rng.randrange(len(text))
            s = text[a: a + rng.randint(1, 4)]
        else:
            s = rng.choice(["\u2603 never", "\u00a7\u00a7", "zz", "\u65e5\u672c", "Q"])
        if s:
            out.append(s)
    return out or ["\u00a7"]


def _tokens(rng, tok, vocab: int) -> list[int]:
    if rng.random() < 0.5:
        words = ["Once", " upon", " a", " time", " r\u00e9sum\u00e9", " \u65e5\u672c\u8a9e",
                 ",", ".", "\n", " never", " stop", "!!", " \u00a7", " end"]
        text = "".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
        return tok.encode(text, add_special_tokens=False)
    return [rng.randrange(vocab) for _ in range(rng.randint(5, 60))]


def _run(det, ids: list[int], eager: bool):
    for k, t in enumerate(ids):
        if eager:
            det.add([t])
            stopped = det.stopped
        else:
            stopped = det.check(t)
        if stopped:
            return k, det.matched_stop, det.text + det.finish()
    return None, None, det.text + det.finish()


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_check_stops_where_every_token_decoded_would(which, tiny_tokenizer, request):
    tok = tiny_tokenizer if which == "tiny" else request.getfixturevalue("smollm2_tokenizer")
    decode = window_decoder(tok)
    assert decode.concatenative  # both are byte-level BPE: the mask applies
    vocab = decode.vocab_size
    rng = random.Random(1234)
    skipped = stopped = 0
    for case in range(400):
        ids = _tokens(rng, tok, vocab)
        text = tok.decode(ids, skip_special_tokens=True)
        params = SamplingParams(stop=_stops(rng, text), max_new_tokens=1000,
                                min_new_tokens=rng.choice([0, 0, 1, 3, 8]),
                                skip_special_tokens=rng.random() < 0.8)
        prompt = [rng.randrange(vocab) for _ in range(3)]
        fast = IncrementalDetokenizer(tok, prompt, params)
        if fast._mask_future is not None:
            fast._mask_future.result()  # built: the check uses it from the first token
        slow = IncrementalDetokenizer(tok, prompt, params)
        got = _run(fast, ids, eager=False)
        want = _run(slow, ids, eager=True)
        assert got == want, (case, ids, params.stop, params.min_new_tokens)
        skipped += fast._mask is not None
        stopped += want[0] is not None
    assert skipped > 200 and 50 < stopped < 390  # the mask was used; both outcomes were seen


def test_check_decodes_only_tokens_that_might_end_a_stop_string(tiny_tokenizer,
                                                                 smollm2_tokenizer):
    for tok in (tiny_tokenizer, smollm2_tokenizer):
        counting = _counting(tok)
        params = SamplingParams(stop=["\u2603 never", "\u00a7\u00a7"], max_new_tokens=1000)
        ids = tok.encode("Once upon a time, in a land far away, lived a cat. " * 6,
                         add_special_tokens=False)
        stop_mask(counting, params.stop, True).result()
        fast = IncrementalDetokenizer(tok, [5, 6], params, decode=counting)
        assert fast._mask_future is not None
        fast._mask_future.result()
        counting.calls = 0
        for t in ids:
            assert not fast.check(t)
        checked = counting.calls
        counting.calls = 0
        slow = IncrementalDetokenizer(tok, [5, 6], params, decode=counting)
        for t in ids:
            slow.add([t])
        assert fast.text + fast.finish() == slow.text + slow.finish()
        # the eager detokenizer decodes each new token once (its piece); the check only the
        # few whose text holds an 'r', a U+00A7 or a partial character
        maybe = fast._mask.maybe
        assert checked <= 2 * sum(maybe[t] for t in ids) + 2 < len(ids), (checked, len(ids))


def test_no_mask_for_whitespace_endings_or_non_concatenative_decoders(tiny_tokenizer):
    decode = window_decoder(tiny_tokenizer)
    assert stop_mask(decode, ["end\n"], True) is None
    assert stop_mask(decode, ["a", "b "], True) is None
    assert stop_mask(decode, ["ab"], True) is not None

    def plain(ids, skip):
        return tiny_tokenizer.decode(ids, skip_special_tokens=skip)

    det = IncrementalDetokenizer(tiny_tokenizer, [], SamplingParams(stop=["x"]), decode=plain)
    assert det._mask_future is None  # every token decoded, as before
    assert not det.check(5)


def test_engine_streams_and_returns_the_same_stopped_text(tiny_model_factory):
    """Offline (Engine.output: the engine side's text) and streamed (the detokenizer thread's
    own detokenizer) agree on where stop strings cut the text, with the mask in use."""
    from engine import Engine
    from engine.server.handle import Handle, build_delta, collect

    engine = Engine(tiny_model_factory("llama"), max_total_tokens=4096)
    tok = engine.tokenizer
    rng = random.Random(7)
    for case in range(6):
        probe = engine.generate([5, 6, 7 + case], {"max_new_tokens": 24, "temperature": 0,
                                                   "ignore_eos": True})
        text = probe["text"]
        stops = _stops(rng, text)
        params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stops}
        r = engine.add_request([5, 6, 7 + case], params, stream=True)[0]
        if r.detokenizer._mask_future is not None:
            r.detokenizer._mask_future.result()
        h = Handle(stream=True)
        h.prompt_ids = [5, 6, 7 + case]
        h.started([r])
        streamed = ""
        while not r.finished:
            engine.step()
            streamed += build_delta(engine, collect(h, 0, r, len(r.output_ids),
                                                    r.finished)).text
        assert streamed == engine.output_text(r), (stops, text)
        if r.finish_reason == "stop" and isinstance(r.matched_stop, str):
            assert r.matched_stop in stops
            full = tok.decode(r.output_ids, skip_special_tokens=True)
            assert full.startswith(streamed) and r.matched_stop in full


def test_a_window_after_a_broken_character_is_decoded_alone(tiny_tokenizer):
    """The text before a window ended in a partial character that the window's first token
    finishes (or breaks): the window's known text is then decoded, not taken from the last
    delta (which would emit its first characters twice). Same text as two decodes per token."""
    from engine.sampling.stop_mask import bytes_to_unicode

    byte = {b: tiny_tokenizer.convert_tokens_to_ids(c) for b, c in bytes_to_unicode().items()}
    pct, a = byte[ord("%")], byte[ord("a")]
    prompt = [byte[ord("x")], byte[0xE6]]  # ends in a partial character
    outputs = [byte[0x97], pct, byte[0xE6], a, byte[0xE6], byte[0x97], byte[0xA5], pct]

    def plain(ids, skip):
        return tiny_tokenizer.decode(ids, skip_special_tokens=skip,
                                     clean_up_tokenization_spaces=False)

    for stop in (["\u00a7\u00a7"], ["zz"], []):
        params = SamplingParams(stop=stop, max_new_tokens=100)
        want = IncrementalDetokenizer(tiny_tokenizer, prompt, params, decode=plain)
        fast = IncrementalDetokenizer(tiny_tokenizer, prompt, params)
        checked = IncrementalDetokenizer(tiny_tokenizer, prompt, params)
        if checked._mask_future is not None:
            checked._mask_future.result()
        for t in outputs:
            want.add([t])
            fast.add([t])
            checked.check(t)
        expected = want.text + want.finish()
        assert "%%" not in expected
        assert fast.text + fast.finish() == expected
        assert checked.text + checked.finish() == expected


def test_the_masks_byte_decode_equals_the_tokenizers(tiny_tokenizer, smollm2_tokenizer):
    """A stop mask decodes windows from the tokens' bytes (StopMask.decode_bytes): for random
    windows, many cutting characters apart, it gives the tokenizer's own decode exactly."""
    import random

    for tok in (tiny_tokenizer, smollm2_tokenizer):
        decode = window_decoder(tok)
        mask = stop_mask(decode, ["\u00a7\u00a7"], True).result()
        rng = random.Random(0)
        text = "Große Straße, naïve café — 東京 🙂 \u00a7 ok " * 3
        real = tok.encode(text, add_special_tokens=False)
        vocab = decode.vocab_size
        checked = 0
        for _ in range(3000):
            n = rng.randint(1, 6)
            if rng.random() < 0.5:
                start = rng.randrange(len(real))
                ids = real[start: start + n]
            else:
                ids = [rng.randrange(vocab) for _ in range(n)]
            got = mask.decode_bytes(ids)
            if got is None:
                continue  # an added token: the tokenizer decodes it
            checked += 1
            assert got == decode(ids, True), ids
        assert checked > 2500
