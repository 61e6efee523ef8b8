from __future__ import annotations

from collections.abc import Collection

from engine.sampling.params import SamplingParams


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string begins in text, or None when none occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of some stop string.

    A streamer holds these characters back: the next token may complete the stop string.
    """
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def token_stop_reason(
    params: SamplingParams, output_ids: list[int], eos_token_ids: Collection[int]
) -> str | None:
    """Why a request ends after its latest token: "stop" (EOS or a stop token), "length", or None.

    Stop strings are the detokenizer's business (IncrementalDetokenizer.stopped).
    """
    if not output_ids:
        return "length" if params.max_new_tokens == 0 else None
    if len(output_ids) >= params.min_new_tokens:
        last = output_ids[-1]
        if last in params.stop_token_ids or (last in eos_token_ids and not params.ignore_eos):
            return "stop"
    if len(output_ids) >= params.max_new_tokens:
        return "length"
    return None
