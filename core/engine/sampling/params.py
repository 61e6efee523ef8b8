from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields

MAX_TOP_LOGPROBS = 20


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown, of the wrong type or out of range; the message names it."""

    def __init__(self, field_name: str, message: str):
        super().__init__(message)
        self.field = field_name


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    Each field follows the formula of the project it is named after: temperature divides the
    logits (0 = greedy); top_k keeps the k largest (-1 or 0 = off); top_p keeps the smallest set
    whose probability reaches top_p; min_p drops tokens with p < min_p * max p;
    repetition_penalty divides positive and multiplies negative logits of every prompt or output
    token (HF); frequency/presence subtract count * f + (count > 0) * p over output tokens
    (OpenAI). The constructor only normalises (a single stop string becomes a list, ints become
    floats); call validate(), or build with from_dict(), to reject bad values.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # structured output (SGLang's names; at most one): the output must match a JSON schema
    # (as JSON text), a regex or an EBNF grammar; the engine's grammar backend enforces it
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, tuple):
            self.stop = list(self.stop)
        if isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(self, name, float(value))

    @property
    def is_greedy(self) -> bool:
        """True when the request always takes the most likely token."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def constraint(self):
        """The output constraint these params ask for (an engine.interfaces.Constraint), or None."""
        from engine.interfaces import Constraint

        for name in CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return Constraint(name, value, name)
        return None

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        """Build and validate from a JSON-like dict; a None value means 'use the default'."""
        if not isinstance(d, dict):
            raise SamplingParamsError(
                "<params>", f"sampling params must be a dict, got {type(d).__name__}"
            )
        known = [f.name for f in fields(cls)]
        for key in d:
            if key not in known:
                hint = difflib.get_close_matches(str(key), known, n=1)
                did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
                raise SamplingParamsError(
                    str(key),
                    f"unknown sampling parameter {key!r}.{did_you_mean} "
                    f"Known fields: {', '.join(known)}",
                )
        # JSON clients send null for "not set".
        params = cls(**{k: v for k, v in d.items() if v is not None})
        params.validate()
        return params

    def validate(self) -> None:
        """Raise SamplingParamsError naming the first field that has a bad type or value."""
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name))

        _require("max_new_tokens", self.max_new_tokens >= 0, "must be >= 0", self.max_new_tokens)
        _require(
            "min_new_tokens",
            0 <= self.min_new_tokens <= self.max_new_tokens,
            f"must be between 0 and max_new_tokens ({self.max_new_tokens})",
            self.min_new_tokens,
        )
        _require(
            "temperature",
            math.isfinite(self.temperature) and self.temperature >= 0,
            "must be >= 0 (0 means greedy)",
            self.temperature,
        )
        _require("top_p", 0 < self.top_p <= 1, "must be in (0, 1]", self.top_p)
        _require("top_k", self.top_k >= -1, "must be -1 or 0 (off) or >= 1", self.top_k)
        _require("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]", self.min_p)
        _require(
            "repetition_penalty",
            math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0,
            "must be > 0 (1 means off)",
            self.repetition_penalty,
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(name, -2 <= value <= 2, "must be in [-2, 2] (0 means off)", value)
        if self.seed is not None:
            _require("seed", -(2**63) <= self.seed < 2**64, "must be in [-2**63, 2**64)", self.seed)
        for s in self.stop:
            _require("stop", len(s) > 0, "must contain only non-empty strings", self.stop)
        for t in self.stop_token_ids:
            _require(
                "stop_token_ids", t >= 0, "must contain only token ids >= 0", self.stop_token_ids
            )
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingParamsError(
                given[1], f"{given[0]} and {given[1]} both constrain the output: give at most "
                          f"one of {', '.join(CONSTRAINT_FIELDS)}")
        for name in given:
            _require(name, getattr(self, name) != "", "must not be empty", "")
        _require("n", self.n >= 1, "must be >= 1", self.n)
        _require(
            "top_logprobs",
            0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
            f"must be between 0 and {MAX_TOP_LOGPROBS}",
            self.top_logprobs,
        )
        _require(
            "top_logprobs",
            self.top_logprobs == 0 or self.logprobs,
            "must be 0 unless logprobs is true",
            self.top_logprobs,
        )


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
)
_INT_FIELDS = ("max_new_tokens", "min_new_tokens", "top_k", "n", "top_logprobs")
_BOOL_FIELDS = ("ignore_eos", "logprobs", "skip_special_tokens")
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_type(name: str, value) -> None:
    if name in _FLOAT_FIELDS:
        ok, expected = _is_int(value) or isinstance(value, float), "a number"
    elif name in _INT_FIELDS:
        ok, expected = _is_int(value), "an integer"
    elif name in _BOOL_FIELDS:
        ok, expected = isinstance(value, bool), "a boolean"
    elif name == "seed":
        ok, expected = value is None or _is_int(value), "an integer or null"
    elif name == "stop":
        ok = isinstance(value, list) and all(isinstance(s, str) for s in value)
        expected = "a string or a list of strings"
    elif name in CONSTRAINT_FIELDS:
        ok, expected = value is None or isinstance(value, str), "a string or null"
    elif name == "stop_token_ids":
        ok = isinstance(value, list) and all(_is_int(t) for t in value)
        expected = "a list of integers"
    else:
        raise AssertionError(f"no type rule for field {name}")
    if not ok:
        raise SamplingParamsError(
            name, f"{name} must be {expected}, got {value!r} ({type(value).__name__})"
        )


def _require(name: str, ok: bool, rule: str, value) -> None:
    if not ok:
        raise SamplingParamsError(name, f"{name} {rule}, got {value!r}")
