"""Typed registries filled by the plugins and name resolution. The user-facing errors live in
engine/errors.py; their names are importable from here too (plugins import them from here)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, TypeVar

from engine.errors import (GRAMMAR_INSTALL, KNOWN_PROVIDERS, BackendUnavailable,
                           DuplicateRegistration, EngineError, IncompatibleOptions,
                           NoBackendAvailable, NotImplementedYet, UnknownAttentionBackend,
                           UnknownName)

T = TypeVar("T")

__all__ = [
    "GRAMMAR_INSTALL", "KNOWN_PROVIDERS", "BackendUnavailable", "DuplicateRegistration",
    "EngineError", "Entry", "IncompatibleOptions", "NoBackendAvailable", "NotImplementedYet",
    "Registries", "Registry", "UnknownAttentionBackend", "UnknownName", "backend_kv_dtypes",
    "default_page_size", "resolve_attention_backend", "resolve_grammar_backend",
    "resolve_kv_dtype", "resolve_linear_kernel", "resolve_parallel_strategy", "resolve_parser",
    "resolve_policy", "resolve_quantization", "takes_dtype", "takes_page_size",
]


@dataclass
class Entry(Generic[T]):
    name: str
    obj: T
    plugin: str
    dist: str  # distribution name, or "built-in"
    version: str = ""
    check: Callable[[Any], str | None] | None = None
    extra: dict = field(default_factory=dict)

    @property
    def origin(self) -> str:
        return "built-in" if self.dist == "built-in" else f"{self.dist} {self.version}".strip()

    def unavailable_reason(self, device) -> str | None:
        return self.check(device) if self.check else None


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry[T]] = {}
        self._aliases: dict[str, str] = {}
        # names of plugins not loaded for another hook contract -> "dist version, which is not
        # loaded: why"
        self.withheld: dict[str, str] = {}

    def add(self, entry: Entry[T], aliases=()) -> None:
        for key in (entry.name, *aliases):
            owner = self._entries.get(key) or self._entries.get(self._aliases.get(key, ""))
            if owner is not None:
                raise DuplicateRegistration(
                    f"{self.kind} '{key}' is registered twice: by {owner.origin} "
                    f"(plugin {owner.plugin}) and by {entry.origin} (plugin {entry.plugin}). "
                    f"Uninstall one, or limit loading with ENGINE_PLUGINS / ENGINE_DISABLE_PLUGINS."
                )
        self._entries[entry.name] = entry
        for alias in aliases:
            self._aliases[alias] = entry.name

    def __contains__(self, name: str) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self) -> str:
        if not self._entries:
            return "none"
        return ", ".join(f"{e.name} ({e.origin})" for e in self)

    def get(self, name: str, error: type[UnknownName] = UnknownName) -> Entry[T]:
        key = self._aliases.get(name, name)
        if key in self._entries:
            return self._entries[key]
        if name in self.withheld:  # a plugin built for another hook contract (contract.py)
            raise error(f"{self.kind} '{name}' is provided by {self.withheld[name]}.")
        msg = f"Unknown {self.kind} '{name}'."
        close = difflib.get_close_matches(name, [*self._entries, *self._aliases], n=1)
        if close:
            msg += f" Did you mean '{close[0]}'?"
        provider = KNOWN_PROVIDERS.get(self.kind, {}).get(name)
        if provider:
            dist, folder = provider
            msg += (f" '{name}' is provided by {dist}, which is not installed "
                    f"(pip install ./{folder}).")
        raise error(msg + f" Registered: {self.describe()}.")


@dataclass
class Registries:
    attention: Registry = field(default_factory=lambda: Registry("attention backend"))
    kv_dtypes: Registry = field(default_factory=lambda: Registry("KV-cache dtype"))
    quantization: Registry = field(default_factory=lambda: Registry("quantization method"))
    policies: Registry = field(default_factory=lambda: Registry("schedule policy"))
    parallel: Registry = field(default_factory=lambda: Registry("parallel strategy"))
    models: Registry = field(default_factory=lambda: Registry("model architecture"))
    routing: Registry = field(default_factory=lambda: Registry("routing policy"))
    grammar: Registry = field(default_factory=lambda: Registry("grammar backend"))
    linear_kernels: Registry = field(default_factory=lambda: Registry("linear kernel"))
    speculative: Registry = field(default_factory=lambda: Registry("speculative algorithm"))
    tool_parsers: Registry = field(default_factory=lambda: Registry("tool-call parser"))
    reasoning_parsers: Registry = field(default_factory=lambda: Registry("reasoning parser"))
    hicache_storage: Registry = field(default_factory=lambda: Registry("HiCache storage "
                                                                       "backend"))
    serve_options: list = field(default_factory=list)  # (plugin name, EngineOption)

    def all(self) -> dict[str, Registry]:
        return {"attention": self.attention, "kv_dtypes": self.kv_dtypes,
                "quantization": self.quantization, "policies": self.policies,
                "parallel": self.parallel, "models": self.models, "routing": self.routing,
                "grammar": self.grammar, "linear_kernels": self.linear_kernels,
                "speculative": self.speculative, "tool_parsers": self.tool_parsers,
                "reasoning_parsers": self.reasoning_parsers,
                "hicache_storage": self.hicache_storage}


def resolve_kv_dtype(regs: Registries, name: str) -> Entry:
    return regs.kv_dtypes.get(name)


def backend_kv_dtypes(regs: Registries, entry: Entry) -> list[str]:
    """The --kv-cache-dtype names an attention backend accepts. It may register "any": every
    registered KV dtype, when it reads K/V through the pool, which dequantizes."""
    supported = entry.extra.get("kv_dtypes", ("auto",))
    return regs.kv_dtypes.names() if supported == "any" else list(supported)


def takes_page_size(entry: Entry, page_size: int | None) -> bool:
    sizes = entry.extra.get("page_sizes")
    return page_size is None or not sizes or page_size in sizes


def takes_dtype(entry: Entry, dtype: str | None) -> bool:
    dtypes = entry.extra.get("dtypes")
    return dtype is None or not dtypes or dtype in dtypes


def takes_model(entry: Entry, model_config) -> bool:
    """Whether the backend can attend ``model_config``'s layers: an MLA model (DeepSeek's
    latent attention) needs a backend registered with ``mla=True`` (or ``"only"``), and one
    registered with ``mla="only"`` (contract 1.6) takes nothing else. An unknown model (None):
    any backend."""
    if model_config is None:
        return True
    latent = bool(getattr(getattr(model_config, "mla", None), "kv_lora_rank", 0))
    mla = entry.extra.get("mla")
    return bool(mla) if latent else mla != "only"


def default_page_size(entry: Entry) -> int:
    """The page size when --page-size is not given: the backend's own (its last listed), else 1."""
    sizes = entry.extra.get("page_sizes")
    return sizes[-1] if sizes else 1


def resolve_attention_backend(regs: Registries, name: str, device, kv_dtype: str = "auto",
                              model_config=None, pm=None, page_size: int | None = None,
                              dtype: str | None = None) -> Entry:
    """Resolve ``--attention-backend`` (``auto`` included) for ``device``, ``kv_dtype``,
    ``page_size`` (None: the backend's default) and the model's ``dtype`` (a name; None:
    unknown)."""
    resolve_kv_dtype(regs, kv_dtype)
    picked_by_auto = name == "auto"
    if name == "auto":
        picked = None
        if pm is not None:
            picked = pm.hook.select_attention_backend(
                device=device, model_config=model_config, kv_dtype=kv_dtype, page_size=page_size,
                registries=regs, dtype=dtype)
        if picked is None:
            reasons = "; ".join(
                f"{e.name}: {e.unavailable_reason(device) or 'does not support --kv-cache-dtype ' + kv_dtype}"
                for e in regs.attention) or "none registered"
            raise NoBackendAvailable(
                f"No attention backend can run here with --kv-cache-dtype {kv_dtype} ({reasons}).")
        name = picked
    entry = regs.attention.get(name, UnknownAttentionBackend)
    if not takes_model(entry, model_config):
        latent = [e for e in regs.attention if e.extra.get("mla")]
        usable = [e.name for e in latent if e.unavailable_reason(device) is None]
        how = "picked by --attention-backend auto" if picked_by_auto else "asked for"
        raise IncompatibleOptions(
            f"'{entry.name}' ({entry.origin}, {how}) has no multi-head latent attention, which "
            f"{model_config.architecture} uses; the backends that have it: "
            f"{', '.join(e.name for e in latent) or 'none installed'}. Pass "
            f"--attention-backend {usable[0] if usable else 'torch_native'}"
            f"{' (usable here)' if usable else ''}.")
    reason = entry.unavailable_reason(device)
    if reason:
        usable = [e.name for e in regs.attention if not e.unavailable_reason(device)]
        raise BackendUnavailable(
            f"'{entry.name}' ({entry.origin}) is installed but unusable here: {reason}. "
            f"Usable: {', '.join(usable) or 'none'}.")
    supported = backend_kv_dtypes(regs, entry)
    if kv_dtype not in supported:
        raise IncompatibleOptions(
            f"'{entry.name}' does not support --kv-cache-dtype {kv_dtype} "
            f"(supports: {', '.join(supported)}).")
    if not takes_dtype(entry, dtype):
        raise IncompatibleOptions(
            f"'{entry.name}' runs {' or '.join(entry.extra['dtypes'])} models, not {dtype}: pass "
            f"--dtype {entry.extra['dtypes'][-1]} (or pick another --attention-backend).")
    if not takes_page_size(entry, page_size):
        sizes = entry.extra["page_sizes"]
        raise IncompatibleOptions(
            f"'{entry.name}' needs --page-size {' or '.join(map(str, sizes))}, got {page_size}; "
            f"leave --page-size unset to get {default_page_size(entry)}.")
    return entry


def resolve_policy(regs: Registries, name: str) -> Entry:
    if not len(regs.policies):
        raise UnknownName(
            f"No schedule policy is installed, so '{name}' cannot be used. Install one: "
            f"pip install ./plugins/policy_lpm ./plugins/policy_fcfs "
            f"(or pip install engine-policy-lpm engine-policy-fcfs).")
    return regs.policies.get(name)


def resolve_quantization(regs: Registries, name: str | None, device,
                         hf_config: dict | None = None) -> Entry | None:
    """``--quantization NAME``; when unset, the method the checkpoint declares in config.json
    (``quantization_config.quant_method``), if any, as vLLM does. None: not quantized."""
    declared = ((hf_config or {}).get("quantization_config") or {}).get("quant_method")
    declared = str(declared).lower() if declared else None
    where = "config.json quantization_config.quant_method"
    if name and declared and name != declared:
        raise IncompatibleOptions(
            f"--quantization {name} does not match the checkpoint, which is quantized with "
            f"'{declared}' ({where}); leave --quantization unset to use '{declared}'.")
    if not name and not declared:
        return None
    try:
        entry = regs.quantization.get(name or declared)
    except UnknownName as exc:
        if name:
            raise
        raise UnknownName(f"The checkpoint is quantized with '{declared}' ({where}), which no "
                          f"installed plugin provides. {exc} Install a plugin that registers "
                          f"quantization method '{declared}'.") from None
    if declared and not entry.obj.detect(hf_config):
        raise EngineError(f"quantization '{entry.name}' ({entry.origin}) does not recognize this "
                          f"checkpoint's quantization_config.")
    reason = entry.unavailable_reason(device)
    if reason:
        raise BackendUnavailable(
            f"quantization '{entry.name}' ({entry.origin}) is installed but unusable here: {reason}.")
    return entry


def resolve_parallel_strategy(regs: Registries, name: str, device) -> Entry:
    """``--parallel-strategy``: a registered name, or ``auto``: the first one registered for
    this device's type that can run here (the built-ins: gloo on a CPU, nccl on a GPU)."""
    if name != "auto":
        entry = regs.parallel.get(name)
        reason = entry.unavailable_reason(device)
        if reason is None and entry.obj.device_type != device.type:
            reason = f"its ranks compute on {entry.obj.device_type}, and this is a {device.type}"
        if reason:
            raise EngineError(f"parallel strategy '{name}' cannot run here: {reason}.")
        return entry
    for entry in regs.parallel:
        if entry.obj.device_type == device.type and entry.unavailable_reason(device) is None:
            return entry
    listed = ", ".join(f"{e.name} ({e.obj.device_type})" for e in regs.parallel) or "none"
    raise EngineError(f"no parallel strategy can run the ranks on this {device.type} "
                      f"(registered: {listed}); install a plugin that registers one.")


def resolve_grammar_backend(regs: Registries, name: str) -> Entry | None:
    """``--grammar-backend``: ``none`` (None: structured outputs off), ``auto`` (the usable
    backend with the highest priority; None when none is installed), or a registered name that
    can run here."""
    if name == "none":
        return None
    if name == "auto":
        usable = [e for e in regs.grammar if e.unavailable_reason(None) is None]
        return max(usable, key=lambda e: e.extra.get("priority", 0), default=None)
    entry = regs.grammar.get(name)
    reason = entry.unavailable_reason(None)
    if reason:
        usable = [e.name for e in regs.grammar if e.unavailable_reason(None) is None]
        raise BackendUnavailable(
            f"grammar backend '{entry.name}' ({entry.origin}) is installed but unusable here: "
            f"{reason}. Usable: {', '.join(usable) or 'none'} (or --grammar-backend none).")
    return entry


def resolve_parser(registry: Registry, name: str | None) -> Entry | None:
    """``--tool-call-parser`` / ``--reasoning-parser`` (``registry`` is the registries' tool
    or reasoning parsers): None when not given; an unknown name lists the installed ones."""
    if not name:
        return None
    if not len(registry):
        raise UnknownName(f"No {registry.kind} is installed, so '{name}' cannot be used. "
                          f"Install them: pip install ./plugins/parsers (or engine-parsers).")
    return registry.get(name)


def resolve_linear_kernel(regs: Registries, weight_dtype: str, device,
                          forced: str | None = None,
                          activations: str | None = None) -> Entry | None:
    """The registered linear kernel for weights in ``weight_dtype`` on ``device``: ``forced``
    (``ENGINE_LINEAR_KERNEL=NAME``; an error when it cannot run, keeps other weights or takes
    other activations), else the usable one with the highest priority; None when none is (the
    core's own kernels run). ``activations`` ("float32", "int8"; None: any): only kernels
    registered with those activations."""
    def fits(e: Entry) -> bool:
        return e.extra.get("weight_dtype") == weight_dtype and (
            activations is None or e.extra.get("activations", "float32") == activations)

    wanted = weight_dtype + (f" weights with {activations} activations" if activations
                             else " weights")
    if forced:
        entry = regs.linear_kernels.get(forced)
        reason = entry.unavailable_reason(device)
        if reason is None and entry.extra.get("weight_dtype") != weight_dtype:
            reason = (f"it keeps {entry.extra.get('weight_dtype')} weights and the model runs "
                      f"with {weight_dtype} ones")
        elif reason is None and not fits(entry):
            reason = (f"it takes {entry.extra.get('activations', 'float32')} activations and "
                      f"the model runs with {activations} ones")
        if reason:
            usable = [e.name for e in regs.linear_kernels
                      if fits(e) and e.unavailable_reason(device) is None]
            raise BackendUnavailable(
                f"linear kernel '{entry.name}' ({entry.origin}) cannot run here: {reason}. "
                f"Usable for {wanted}: {', '.join(usable) or 'none'}.")
        return entry
    usable = [e for e in regs.linear_kernels if fits(e) and e.unavailable_reason(device) is None]
    return max(usable, key=lambda e: e.extra.get("priority", 0), default=None)
