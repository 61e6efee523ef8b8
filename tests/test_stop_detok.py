import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.sampling import IncrementalDetokenizer, SamplingParams
from engine.sampling.stop import find_stop, partial_stop_len, token_stop_reason

CORPUS = [
    "The café served crème brûlée to the über-tired students after the exam.",
    "Naïve résumé writers in Zürich drink Glühwein; the Müller family likes Käse.",
    "日本語のテキストも少し入れます。日本は東京です。",
    "Emoji are four bytes: 😀 🎉 🚀 and the thumbs up 👍 sign appear here.",
    "Plain English sentences help the merges: the quick brown fox jumps over the lazy dog.",
    "Stop words and STOP markers, END of line, ### separators and <tags> appear too.",
] * 4
EOS = "<|eos|>"


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)


def stream(tokenizer, ids, params, prompt_ids=(), chunk=1):
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), params)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text
    return detok, deltas


TEXTS = [
    "Crème brûlée in Zürich: 日本 😀 👍 and über-naïve café 🚀!",
    "日本語😀😀é",
    "plain ascii only, nothing fancy",
    "🎉",
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer, text, chunk):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    prompt = tokenizer.encode("Prompt with é and 日本 ")
    detok, deltas = stream(tokenizer, ids, SamplingParams(), prompt, chunk)
    assert detok.text == tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert not detok.stopped


def test_the_test_text_really_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXTS[0])
    assert sum("\ufffd" in tokenizer.decode([i]) for i in ids) >= 4


def test_decode_windows_stay_small_on_a_long_output(tokenizer):
    calls = []

    class Recording:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode(" ".join(TEXTS) * 20)
    detok, _ = stream(
        Recording(), ids, SamplingParams(), tokenizer.encode("a prompt of a few tokens")
    )
    assert detok.text == tokenizer.decode(ids)
    assert len(ids) > 500 and max(calls) <= 12


def split_across_tokens(tokenizer, ids, stop):
    pieces = [tokenizer.decode([i]) for i in ids]
    return not any(stop in p for p in pieces)


@pytest.mark.parametrize(
    "text, stop, before",
    [
        ("The answer is 42. STOP then more text", "STOP", "The answer is 42. "),
        ("Zürich café ### next section", "###", "Zürich café "),
        ("Un café 日本語 après", "日本語", "Un café "),
        ("first 😀 second", "😀 sec", "first "),
        ("crème brûlée", "e br", "crèm"),
    ],
)
@pytest.mark.parametrize("chunk", [1, 2])
def test_stop_strings_split_across_tokens_are_caught(tokenizer, text, stop, before, chunk):
    ids = tokenizer.encode(text)
    assert split_across_tokens(tokenizer, ids, stop)
    detok, deltas = stream(tokenizer, ids, SamplingParams(stop=["never", stop]), chunk=chunk)
    assert detok.stopped
    assert detok.text == before
    assert not any("\ufffd" in d for d in deltas)
    assert detok.add(tokenizer.encode(" more")) == "" and detok.finish() == ""


def test_earliest_stop_wins(tokenizer):
    ids = tokenizer.encode("alpha END beta STOP gamma")
    detok, _ = stream(tokenizer, ids, SamplingParams(stop=["STOP", "END"]))
    assert detok.text == "alpha "


def test_partial_stop_is_held_back_then_released(tokenizer):
    params = SamplingParams(stop=["STOP"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    emitted = "".join(detok.add([i]) for i in tokenizer.encode("go ST"))
    assert emitted == "go "  # "ST" could begin "STOP"
    emitted += "".join(detok.add([i]) for i in tokenizer.encode("AR"))
    assert emitted == "go STAR"
    assert not detok.stopped


def test_finish_flushes_a_trailing_partial_stop(tokenizer):
    detok, deltas = stream(
        tokenizer, tokenizer.encode("the end is ST"), SamplingParams(stop=["STOP"])
    )
    assert deltas[-1].endswith("ST") and detok.text == "the end is ST" and not detok.stopped


def test_no_stop_string_before_min_new_tokens(tokenizer):
    ids = tokenizer.encode("STOP early, then STOP again")
    params = SamplingParams(stop=["STOP"], min_new_tokens=4)
    detok, _ = stream(tokenizer, ids, params)
    assert detok.stopped and detok.text == "STOP early, then "


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids = tokenizer.encode("hello ") + [eos] + tokenizer.encode("wörld")
    skipped, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=True))
    kept, _ = stream(tokenizer, ids, SamplingParams(skip_special_tokens=False))
    assert skipped.text == "hello wörld"
    assert kept.text == f"hello {EOS}wörld"


def test_find_stop():
    assert find_stop("abc STOP def", ["STOP"]) == 4
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("abc", ["STOP"]) is None
    assert find_stop("abc", []) is None


def test_partial_stop_len():
    assert partial_stop_len("abc ST", ["STOP"]) == 2
    assert partial_stop_len("abc S", ["STOP", "SEND"]) == 1
    assert partial_stop_len("abc SE", ["STOP", "SEND"]) == 2
    assert partial_stop_len("abc STOP", ["STOP"]) == 0  # a full stop is find_stop's job
    assert partial_stop_len("aaa", ["aab"]) == 2
    assert partial_stop_len("", ["x"]) == 0
    assert partial_stop_len("abc", []) == 0


def test_token_stop_reason():
    eos = {2}
    assert token_stop_reason(SamplingParams(), [5, 2], eos) == "stop"
    assert token_stop_reason(SamplingParams(ignore_eos=True), [5, 2], eos) is None
    assert (
        token_stop_reason(SamplingParams(stop_token_ids=[9], ignore_eos=True), [9], eos) == "stop"
    )
    assert token_stop_reason(SamplingParams(min_new_tokens=3), [5, 2], eos) is None
    assert token_stop_reason(SamplingParams(max_new_tokens=2), [5, 6], eos) == "length"
    assert token_stop_reason(SamplingParams(max_new_tokens=2), [5, 2], eos) == "stop"
    assert token_stop_reason(SamplingParams(max_new_tokens=0), [], eos) == "length"
    assert token_stop_reason(SamplingParams(), [5], eos) is None
