"""The hook contract's version: a plugin declares the contract it was built for
(``ENGINE_HOOKS_VERSION = "MAJOR.MINOR"`` in its module; undeclared means 1.0); one built for
another major, or a newer minor, than this engine's ``hookspecs.ENGINE_HOOKS_VERSION`` is not
loaded, and the names it would have registered say why (``Registry.withheld``)."""

from __future__ import annotations

from engine import hookspecs


def _parse_version(text) -> tuple[int, int] | None:
    parts = text.split(".") if isinstance(text, str) else ()
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def contract_problem(declared: str | None) -> str | None:
    """None when a plugin built for hook contract ``declared`` (None: undeclared) runs on this
    engine's; else what it needs, what this engine offers and what to do."""
    offered = hookspecs.ENGINE_HOOKS_VERSION
    major, minor = _parse_version(offered)
    wanted = _parse_version(declared or hookspecs.UNDECLARED_HOOKS_VERSION)
    if wanted is None:
        return (f"declares {hookspecs.PLUGIN_HOOKS_VERSION_ATTRIBUTE} = {declared!r}, which is "
                f"not a hook contract version: it must be a string \"MAJOR.MINOR\" (this "
                f"engine offers \"{offered}\")")
    if wanted[0] < major:
        return (f"was built for the engine hook contract {declared}, and this engine offers "
                f"{offered}, which no longer runs {wanted[0]}.x plugins: install a release of "
                f"the plugin built for {major}.x")
    if wanted[0] > major or wanted[1] > minor:
        return (f"needs the engine hook contract {declared}, and this engine offers {offered}: "
                f"upgrade the engine (pip install -U engine-core engine-cli), or install a "
                f"release of the plugin built for {major}.x, at most {offered}")
    return None


HOOK_REGISTRY = {
    "register_attention_backends": "attention", "register_kv_cache_dtypes": "kv_dtypes",
    "register_quantization_methods": "quantization", "register_schedule_policies": "policies",
    "register_parallel_strategies": "parallel", "register_models": "models",
    "register_routing_policies": "routing", "register_grammar_backends": "grammar",
    "register_linear_kernels": "linear_kernels",
    "register_speculative_algorithms": "speculative", "register_tool_parsers": "tool_parsers",
    "register_reasoning_parsers": "reasoning_parsers",
    "register_hicache_storage": "hicache_storage",
}


def withheld_names(plugin) -> dict[str, list[str]]:
    """The names a plugin that is not loaded would register, by registry, so that asking for
    one says why it is missing. Its registration hooks are called with a recorder only."""
    names: dict[str, list[str]] = {}
    for hook, key in HOOK_REGISTRY.items():
        impl = getattr(plugin, hook, None)
        if impl is None or not hasattr(impl, "engine_impl"):
            continue
        try:
            impl(register=lambda name, *a, **k: names.setdefault(key, []).append(name))
        except Exception:  # noqa: BLE001 - a best effort: the plugin is reported as not loaded
            pass
    return names
