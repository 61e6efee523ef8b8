"""The knobs `engine tune` searches: the tuning guides' flags, their candidate values, and
whether a running engine can take a new value between runs (live) or needs a new Engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import EngineConfig
from engine.registry import EngineError

_D = EngineConfig()


@dataclass(frozen=True)
class Knob:
    """``ordered``: the values are on a scale (a rule can say "lower" or "higher");
    ``live``: the scheduler reads it every step, so a running engine can take a new value."""

    name: str  # the EngineConfig field
    values: tuple  # candidates, the default among them
    default: object
    live: bool
    ordered: bool

    @property
    def flag(self) -> str:
        return f"--{self.name.replace('_', '-')}"

    def position(self, value) -> int:
        """Where ``value`` sits on the knob's scale (``values`` are in scale order)."""
        return self.values.index(value)


def _registered(registry: str, special: tuple) -> tuple:
    from engine.plugins import get_registries

    return (*special, *getattr(get_registries(), registry).names())


def default_number(name: str, kind: str) -> float:
    """The number a knob's unset default (None) stands for on a ``kind`` device ("cpu" or
    "cuda"): its place on the scale. The pool-derived --max-running-requests is the top."""
    from engine.memory.sizing import DEFAULT_CHUNKED_PREFILL, DEFAULT_MEM_FRACTION

    return {"chunked_prefill_size": DEFAULT_CHUNKED_PREFILL[kind],
            "mem_fraction_static": DEFAULT_MEM_FRACTION[kind]}.get(name, float("inf"))


def _scale(name: str, values, kind: str) -> tuple:
    """Numbers ascending (-1, chunking off, is the largest chunk), None where its default
    number sits (a candidate equal to it dropped: the same run twice), words ("auto") last."""
    def key(v):
        if v is None:
            return default_number(name, kind)
        return float("inf") if (name == "chunked_prefill_size" and v == -1) else v

    numbers = [v for v in values if v is None or not isinstance(v, str)]
    if None in numbers:
        numbers = [v for v in numbers if v is None or key(v) != key(None)]
    numbers.sort(key=lambda v: (key(v), v is not None))
    return (*numbers, *(v for v in values if isinstance(v, str)))


def default_knobs(kind: str = "cpu") -> dict[str, Knob]:
    """Every knob with the candidates `engine tune` tries when ``--values`` does not say, in
    the guides' order of importance (the order the search visits them)."""
    policies = _registered("policies", ())

    def ordered(name, values, live):
        return Knob(name, _scale(name, values, kind), getattr(_D, name), live=live,
                    ordered=True)

    return {k.name: k for k in (
        ordered("schedule_conservativeness", (0.3, 0.5, 0.7, 1.0, 1.3, "auto"), True),
        ordered("chunked_prefill_size", (None, 256, 512, 1024, 2048, 4096, 8192, -1), True),
        ordered("max_running_requests", (None, 16, 32, 64, 128, 256), True),
        Knob("schedule_policy", policies, _D.schedule_policy, live=True, ordered=False),
        ordered("mem_fraction_static", (None, 0.2, 0.5, 0.7, 0.8, 0.9), False),
        Knob("kv_cache_dtype", _registered("kv_dtypes", ()), _D.kv_cache_dtype, live=False,
             ordered=False),
        Knob("quantization", _registered("quantization", (None,)), _D.quantization, live=False,
             ordered=False),
        Knob("attention_backend", _registered("attention", ("auto",)), _D.attention_backend,
             live=False, ordered=False),
        Knob("enable_torch_compile", (False, True), _D.enable_torch_compile, live=False,
             ordered=False),
    )}


def knob_name(text: str) -> str:
    """``--schedule-conservativeness``, ``schedule-conservativeness`` or the field name."""
    return text.strip().lstrip("-").replace("-", "_")


def parse_value(knob: Knob, text: str):
    """One candidate from the command line, typed like the EngineConfig field."""
    t = text.strip()
    if t in ("default", "none", "None"):
        if knob.default is None or knob.name == "quantization":
            return None
        raise EngineError(f"{knob.flag}: {t!r} is not a value; its default is {knob.default}.")
    try:
        if knob.name == "enable_torch_compile":
            if t.lower() not in ("true", "false", "on", "off"):
                raise ValueError
            return t.lower() in ("true", "on")
        if knob.name in ("chunked_prefill_size", "max_running_requests"):
            return int(t)
        if knob.name == "mem_fraction_static":
            return float(t)
        if knob.name == "schedule_conservativeness":
            return t if t == "auto" else float(t)
    except ValueError:
        raise EngineError(f"{knob.flag}: {t!r} is not a value it takes (e.g. "
                          f"{', '.join(map(str, knob.values[:3]))}).") from None
    return t


def select(names: list[str] | None, values: dict[str, list[str]], fixed: set[str],
           kind: str = "cpu") -> list[Knob]:
    """The knobs to search: ``names`` (None: every knob not ``fixed`` by an engine flag), with
    candidates from ``values`` where given (the default always joins them: it is the start)."""
    known = default_knobs(kind)
    for name in [*(names or []), *values]:
        if knob_name(name) not in known:
            raise EngineError(f"--knobs {name}: not a knob engine tune searches; choose from "
                              f"{', '.join(k.replace('_', '-') for k in known)}.")
    chosen = [knob_name(n) for n in names] if names else [k for k in known if k not in fixed]
    if "max_total_tokens" in fixed and "mem_fraction_static" in chosen:
        if names:
            raise EngineError("--knobs mem-fraction-static with --max-total-tokens fixed (after "
                              "--): the pool size is set, so the fraction changes nothing; drop "
                              "one of them.")
        chosen.remove("mem_fraction_static")
    clash = [k for k in chosen if k in fixed]
    if clash and names:
        raise EngineError(f"{', '.join('--' + k.replace('_', '-') for k in clash)} is both "
                          f"searched (--knobs) and fixed (after --); drop it from one.")
    stray = [k for k in map(knob_name, values) if k not in chosen]
    if stray:
        raise EngineError(f"--values for {', '.join(stray)}, which --knobs does not search; "
                          f"add it to --knobs or drop its --values.")
    knobs = []
    for name in sorted(set(chosen), key=list(known).index):
        k = known[name]
        given = values.get(name) or values.get(name.replace("_", "-"))
        if given:
            vals = [parse_value(k, v) for v in given]
            vals = list(dict.fromkeys([k.default, *vals]))
            if k.ordered:
                vals = _scale(k.name, vals, kind)
            k = Knob(k.name, tuple(vals), k.default, k.live, k.ordered)
        knobs.append(k)
    return knobs
