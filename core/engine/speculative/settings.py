"""The speculative-decoding settings: SGLang's ``--speculative-*`` flags and vLLM's
``--speculative-config '{json}'`` folded into one ``SpecSettings`` (a clash between the two
spellings is an error naming both)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.config import ConfigError

# vLLM's "method" -> SGLang's algorithm name
VLLM_METHODS = {"ngram": "NGRAM", "eagle": "EAGLE", "eagle3": "EAGLE3",
                "draft_model": "STANDALONE"}
VLLM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
             "model")
ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3")  # SGLang's; plugins may add more
DEFAULT_NUM_DRAFT_TOKENS = {"NGRAM": 8, "STANDALONE": 5, "EAGLE": 4, "EAGLE3": 4}
NGRAM_WINDOW = (1, 12)  # the n-gram match window's default (SGLang's), when not given


class SpecConfigError(ConfigError):
    pass


@dataclass(frozen=True)
class SpecSettings:
    """One engine's speculative decoding. ``num_draft_tokens`` counts the tokens verified per
    request and step, the request's last token included (SGLang's meaning): at most
    ``num_draft_tokens - 1`` drafts each."""

    algorithm: str
    num_draft_tokens: int
    num_steps: int | None = None
    eagle_topk: int | None = None
    draft_model_path: str | None = None
    # None: not given (NGRAM's defaults: 1 and 12); another algorithm refuses them given
    ngram_min_match_window: int | None = None
    ngram_max_match_window: int | None = None
    ngram_max_bfs_breadth: int | None = None

    @property
    def max_drafts(self) -> int:
        return self.num_draft_tokens - 1

    def as_dict(self) -> dict:
        return {"algorithm": self.algorithm, "num_draft_tokens": self.num_draft_tokens,
                "num_steps": self.num_steps, "eagle_topk": self.eagle_topk,
                "draft_model_path": self.draft_model_path,
                "ngram_min_match_window_size": self.ngram_min_match_window,
                "ngram_max_match_window_size": self.ngram_max_match_window,
                "ngram_max_bfs_breadth": self.ngram_max_bfs_breadth}


def _vllm_config(raw) -> dict:
    """``--speculative-config``: a JSON object (or a dict from Python) with vLLM's keys."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise SpecConfigError(
                f"--speculative-config must be a JSON object such as '{{\"method\": \"ngram\", "
                f"\"num_speculative_tokens\": 4}}'; could not parse {raw!r}: {e}") from None
    if not isinstance(raw, dict):
        raise SpecConfigError(f"--speculative-config must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - set(VLLM_KEYS))
    if unknown:
        raise SpecConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; "
                              f"this engine reads {', '.join(VLLM_KEYS)}")
    return raw


def _pick(name_a: str, a, name_b: str, b):
    """One setting given in both spellings must agree."""
    if a is not None and b is not None and a != b:
        raise SpecConfigError(f"{name_a} {a!r} and {name_b} {b!r} disagree; give one of them")
    return a if a is not None else b


def _positive(flag: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or value < 1):
        raise SpecConfigError(f"{flag} must be an integer >= 1, got {value!r}")


def spec_settings(config) -> SpecSettings | None:
    """The settings the flags of ``config`` (an EngineConfig) ask for; None: speculation off."""
    v = _vllm_config(config.speculative_config) if config.speculative_config else {}
    method = v.get("method")
    if method is None and v.get("model"):
        method = "draft_model"
    if method is not None and method not in VLLM_METHODS:
        raise SpecConfigError(f"--speculative-config method {method!r} is not one this engine "
                              f"knows; use one of {', '.join(VLLM_METHODS)}")
    algo = config.speculative_algorithm
    algo = algo.upper() if isinstance(algo, str) else algo
    algo = _pick("--speculative-algorithm", algo, "--speculative-config method",
                 VLLM_METHODS.get(method))
    if algo is None:
        for flag, value in (("--speculative-num-draft-tokens",
                             config.speculative_num_draft_tokens),
                            ("--speculative-draft-model-path",
                             config.speculative_draft_model_path),
                            ("--speculative-num-steps", config.speculative_num_steps),
                            ("--speculative-eagle-topk", config.speculative_eagle_topk),
                            ("--speculative-ngram-min-match-window-size",
                             config.speculative_ngram_min_match_window_size),
                            ("--speculative-ngram-max-match-window-size",
                             config.speculative_ngram_max_match_window_size),
                            ("--speculative-ngram-max-bfs-breadth",
                             config.speculative_ngram_max_bfs_breadth)):
            if value is not None:
                raise SpecConfigError(f"{flag} needs --speculative-algorithm (e.g. "
                                      f"{', '.join(ALGORITHMS)}) or --speculative-config")
        return None
    if not algo or not isinstance(algo, str):
        raise SpecConfigError(f"--speculative-algorithm must name an algorithm (NGRAM, or a "
                              f"plugin's: `engine plugins` lists them), got "
                              f"{config.speculative_algorithm!r}")
    k = v.get("num_speculative_tokens")
    _positive("--speculative-config num_speculative_tokens", k)
    _positive("--speculative-num-draft-tokens", config.speculative_num_draft_tokens)
    n = _pick("--speculative-num-draft-tokens", config.speculative_num_draft_tokens,
              "--speculative-config num_speculative_tokens + 1",
              None if k is None else k + 1)
    n = DEFAULT_NUM_DRAFT_TOKENS.get(algo, 5) if n is None else n
    if n < 2:
        raise SpecConfigError("--speculative-num-draft-tokens counts the request's last token "
                              "too: it must be >= 2 for any draft to run")
    lo = _pick("--speculative-ngram-min-match-window-size",
               config.speculative_ngram_min_match_window_size,
               "--speculative-config prompt_lookup_min", v.get("prompt_lookup_min"))
    hi = _pick("--speculative-ngram-max-match-window-size",
               config.speculative_ngram_max_match_window_size,
               "--speculative-config prompt_lookup_max", v.get("prompt_lookup_max"))
    _positive("--speculative-ngram-min-match-window-size", lo)
    _positive("--speculative-ngram-max-match-window-size", hi)
    if (lo or NGRAM_WINDOW[0]) > (hi or NGRAM_WINDOW[1]):
        raise SpecConfigError(f"--speculative-ngram-min-match-window-size {lo} is above "
                              f"--speculative-ngram-max-match-window-size {hi}")
    for flag, value in (("--speculative-num-steps", config.speculative_num_steps),
                        ("--speculative-eagle-topk", config.speculative_eagle_topk),
                        ("--speculative-ngram-max-bfs-breadth",
                         config.speculative_ngram_max_bfs_breadth)):
        _positive(flag, value)
    for flag, value in (("--speculative-ngram-max-bfs-breadth",
                         config.speculative_ngram_max_bfs_breadth),
                        ("--speculative-eagle-topk", config.speculative_eagle_topk)):
        if (value or 1) > 1 and (config.page_size or 1) > 1:
            raise SpecConfigError(
                f"{flag} {value} with --page-size {config.page_size}: a tree of drafts is "
                f"verified in the request's own slots, rearranged after acceptance, which pages "
                f"of more than one token do not allow; use --page-size 1 or {flag} 1")
    path = _pick("--speculative-draft-model-path", config.speculative_draft_model_path,
                 "--speculative-config model", v.get("model"))
    problem = incompatibility(config)
    if problem:
        raise SpecConfigError(problem)
    return SpecSettings(algo, n, config.speculative_num_steps, config.speculative_eagle_topk,
                        path, lo, hi, config.speculative_ngram_max_bfs_breadth)


def incompatibility(config) -> str | None:
    """Why speculation cannot run with the rest of ``config`` yet (None: it can)."""
    if config.enable_overlap_schedule:
        return ("speculative decoding with --enable-overlap-schedule is not supported yet (a "
                "verify step's accepted length decides the next batch): drop one of them")
    if config.pp_size > 1:
        return ("speculative decoding with --pp-size > 1 is not supported yet (a verify step "
                "needs every position's logits at once): drop one of them")
    return None
