"""The plugin manager: built-ins and entry points, loaded once, turned into registries."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from engine import hookspecs
from engine.contract import contract_problem, withheld_names
from engine.registry import DuplicateRegistration, EngineError, Entry, Registries

DEFAULT_PLUGINS = (
    "engine.builtins.attention_torch_native",
    "engine.builtins.hicache_file",
    "engine.builtins.kv_dtypes",
    "engine.builtins.models",
    "engine.builtins.parallel",
    "engine.builtins.routing_policies",
    "engine.builtins.select",
)


@dataclass
class PluginInfo:
    name: str
    dist: str  # "built-in" for the core's own
    version: str = ""
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None
    hooks_version: str | None = None  # the contract it declares (None: undeclared)
    incompatible: str | None = None  # why it is not loaded: built for another hook contract
    withheld: dict[str, list[str]] = field(default_factory=dict)  # names it would register


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("engine")
    pm.add_hookspecs(hookspecs)
    if os.environ.get("ENGINE_TRACE_PLUGINS"):
        pm.trace.root.setwriter(print)
        pm.enable_tracing()
    return pm


pm = new_plugin_manager()
_infos: dict[str, PluginInfo] = {}
_loaded = False
_registries: Registries | None = None


def _env_list(var: str) -> list[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [x.strip() for x in raw.split(",") if x.strip()]


def register_builtins(manager: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
    for modname in DEFAULT_PLUGINS:
        if manager.has_plugin(modname) or manager.is_blocked(modname):
            continue
        manager.register(importlib.import_module(modname), name=modname)
        infos[modname] = PluginInfo(modname, "built-in")


def load_entry_points(manager: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> None:
    """Load the "engine" entry points; a plugin that fails to import is recorded, not fatal."""
    allow = _env_list("ENGINE_PLUGINS")
    blocked = set(_env_list("ENGINE_DISABLE_PLUGINS") or ())
    for ep in metadata.entry_points(group="engine"):
        dist = ep.dist.name if ep.dist else "unknown"
        version = ep.dist.version if ep.dist else ""
        if allow is not None and dist not in allow and ep.name not in allow:
            continue
        if ep.name in blocked or dist in blocked:
            manager.set_blocked(ep.name)
            continue
        if manager.has_plugin(ep.name) or manager.is_blocked(ep.name):
            continue
        info = PluginInfo(ep.name, dist, version)
        infos[ep.name] = info
        try:
            plugin = ep.load()
            info.hooks_version = getattr(plugin, hookspecs.PLUGIN_HOOKS_VERSION_ATTRIBUTE, None)
            info.incompatible = contract_problem(info.hooks_version)
            if info.incompatible:  # never registered: it cannot fail later, deep in a step
                info.withheld = withheld_names(plugin)
                continue
            manager.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not stop the others
            info.error = f"failed to load: {type(exc).__name__}: {exc}"


def load_plugins() -> pluggy.PluginManager:
    """Idempotent: built-ins first, then entry points (so outside hooks run first)."""
    global _loaded
    if not _loaded:
        for name in _env_list("ENGINE_DISABLE_PLUGINS") or ():
            pm.set_blocked(name)
        register_builtins(pm, _infos)
        load_entry_points(pm, _infos)
        pm.check_pending()
        _loaded = True
    return pm


def _registrar(regs: Registries, hook: str, info: PluginInfo):
    def add(registry, kind, name, obj, check=None, aliases=(), **extra):
        registry.add(Entry(name, obj, info.name, info.dist, info.version, check, extra), aliases)
        info.registered.setdefault(kind, []).append(name)

    def attention(name, factory, *, check=None, kv_dtypes=("auto",), priority=0, aliases=(),
                  description="", page_sizes=None, dtypes=None, mla=False):
        add(regs.attention, "attention", name, factory, check, aliases,
            kv_dtypes=kv_dtypes if kv_dtypes == "any" else tuple(kv_dtypes), priority=priority,
            description=description, page_sizes=tuple(page_sizes) if page_sizes else None,
            dtypes=tuple(dtypes) if dtypes else None,
            mla="only" if mla == "only" else bool(mla))

    def kv_dtype(name, kv):
        add(regs.kv_dtypes, "kv_dtypes", name, kv)

    def quantization(name, method, *, check=None):
        add(regs.quantization, "quantization", name, method, check)

    def policy(name, factory, *, cache_aware=False):
        add(regs.policies, "policies", name, factory, cache_aware=cache_aware)

    def routing(name, factory, *, description=""):
        add(regs.routing, "routing", name, factory, description=description)

    def parallel(name, strategy, *, check=None):
        add(regs.parallel, "parallel", name, strategy, check)

    def grammar(name, factory, *, check=None, priority=0, description=""):
        # its check() takes no device (a library, not hardware); Entry asks with one
        add(regs.grammar, "grammar", name, factory,
            (lambda device=None: check()) if check else None, priority=priority,
            description=description)

    def linear_kernel(name, kernel, *, weight_dtype, check=None, priority=0, description="",
                      activations="float32"):
        add(regs.linear_kernels, "linear_kernels", name, kernel, check,
            weight_dtype=weight_dtype, priority=priority, description=description,
            activations=activations)

    def model(arch, cls):
        add(regs.models, "models", arch, cls)

    def speculative(name, factory, *, check=None, description=""):
        add(regs.speculative, "speculative", name, factory, check, description=description)

    def tool_parser(name, factory, *, aliases=(), description=""):
        add(regs.tool_parsers, "tool_parsers", name, factory, None, aliases,
            description=description)

    def reasoning_parser(name, factory, *, aliases=(), description=""):
        add(regs.reasoning_parsers, "reasoning_parsers", name, factory, None, aliases,
            description=description)

    def hicache_storage(name, factory, *, check=None, description=""):
        add(regs.hicache_storage, "hicache_storage", name, factory, check,
            description=description)

    def serve_option(option):
        regs.serve_options.append((info.name, option))
        info.registered.setdefault("serve_options", []).append(option.flag)

    return {
        "register_attention_backends": attention, "register_kv_cache_dtypes": kv_dtype,
        "register_quantization_methods": quantization, "register_schedule_policies": policy,
        "register_parallel_strategies": parallel, "register_models": model,
        "register_serve_options": serve_option, "register_routing_policies": routing,
        "register_grammar_backends": grammar, "register_linear_kernels": linear_kernel,
        "register_speculative_algorithms": speculative, "register_tool_parsers": tool_parser,
        "register_reasoning_parsers": reasoning_parser,
        "register_hicache_storage": hicache_storage,
    }[hook]


REGISTRATION_HOOKS = (
    "register_kv_cache_dtypes", "register_attention_backends", "register_quantization_methods",
    "register_schedule_policies", "register_parallel_strategies", "register_models",
    "register_serve_options", "register_routing_policies", "register_grammar_backends",
    "register_linear_kernels", "register_speculative_algorithms", "register_tool_parsers",
    "register_reasoning_parsers", "register_hicache_storage",
)


def build_registries(manager: pluggy.PluginManager, infos: dict[str, PluginInfo]) -> Registries:
    """Call every registration hook plugin by plugin; a hook that raises is recorded on its
    plugin and skipped. Two plugins claiming one name raises DuplicateRegistration."""
    regs = Registries()
    for info in list(infos.values()):
        for key, names in info.withheld.items() if info.incompatible else ():
            for name in names:
                regs.all()[key].withheld[name] = (
                    f"{info.dist} {info.version}, which is not loaded: it {info.incompatible}")
    for hook in REGISTRATION_HOOKS:
        # pluggy's call order is last-registered first; registration order reads better here
        for impl in reversed(getattr(manager.hook, hook).get_hookimpls()):
            info = infos.setdefault(impl.plugin_name, PluginInfo(impl.plugin_name, "unknown"))
            if hook not in info.hooks:
                info.hooks.append(hook)
            try:
                impl.function(register=_registrar(regs, hook, info))
            except DuplicateRegistration:
                raise
            except Exception as exc:
                info.error = f"{hook} raised {type(exc).__name__}: {exc}"
    for name, plugin in manager.list_name_plugin():
        info = infos.setdefault(name, PluginInfo(name, "unknown"))
        for impl in manager.get_hookcallers(plugin) or ():
            if impl.name not in info.hooks:
                info.hooks.append(impl.name)
    return regs


def get_registries() -> Registries:
    global _registries
    if _registries is None:
        _registries = build_registries(load_plugins(), _infos)
    return _registries


def registries_with(*plugins) -> tuple[pluggy.PluginManager, Registries]:
    """A fresh manager holding the built-ins and ``plugins`` (modules or objects with
    hookimpls; named plugin-0, plugin-1, ...), and its registries: for a plugin's own tests,
    which need neither an installed plugin nor the environment's other plugins."""
    manager, infos = new_plugin_manager(), {}
    register_builtins(manager, infos)
    for i, plugin in enumerate(plugins):
        manager.register(plugin, name=f"plugin-{i}")
        infos[f"plugin-{i}"] = PluginInfo(f"plugin-{i}", "(not installed)")
    manager.check_pending()
    regs = build_registries(manager, infos)
    errors = [f"{i.name}: {i.error}" for i in infos.values() if i.error]
    if errors:
        raise EngineError(f"plugin hooks raised: {'; '.join(errors)}")
    return manager, regs


def list_plugins() -> list[PluginInfo]:
    get_registries()
    return sorted(_infos.values(), key=lambda i: (i.dist == "built-in", i.name))


def call_observers(hook, **kwargs) -> None:
    """Call every implementation of an observer hook (engine_started, step_finished) on its own:
    one that raises is logged with its plugin's name (once per plugin and hook) and the others,
    and the engine, go on."""
    for impl in hook.get_hookimpls():
        try:
            impl.function(**{k: kwargs[k] for k in impl.argnames})
        except Exception as e:  # noqa: BLE001 - an observer must not stop the engine
            key = (hook.name, impl.plugin_name)
            if key not in _observer_errors:
                _observer_errors.add(key)
                logging.getLogger("engine").error(
                    f"plugin {impl.plugin_name}: its {hook.name} hook raised "
                    f"{type(e).__name__}: {e}; ignored (logged once)")


_observer_errors: set = set()
