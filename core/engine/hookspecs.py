"""The contract between the core and its plugins (pluggy project "engine").

Registration hooks are broadcast: every plugin gets a ``register`` callback owned by the core,
which records what is registered together with the plugin's distribution, so that two plugins
claiming one name is an error naming both.
"""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("engine")
hookimpl = pluggy.HookimplMarker("engine")

# The version of this contract, "MAJOR.MINOR". MINOR grows when hooks or keyword arguments are
# added (a plugin built for an older minor still runs); MAJOR when one changes or goes away.
ENGINE_HOOKS_VERSION = "1.6"  # 1.1: register_grammar_backends; 1.2: register_linear_kernels;
# 1.3: CPU graph nodes (LinearKernel.graph_nodes, AttentionBackend.cpu_graph_nodes, graph.h),
# register_linear_kernels(activations=), QuantMethod.gguf_blocks / block_activations;
# 1.4: register_speculative_algorithms, register_tool_parsers, register_reasoning_parsers,
# register_hicache_storage; 1.5: register_attention_backends(mla=),
# AttentionBackend.forward_latent, AttentionLayerSpec.kv_lora_rank (multi-head latent attention);
# 1.6: LinearKernel.group / grouped_linear (an MoE layer's experts in one call) and
# register_linear_kernels(weight_dtype="float32") for them
# A plugin declares the contract it was built for as a module attribute of this name holding
# a literal string (``ENGINE_HOOKS_VERSION = "1.0"``; never imported from here, which would
# always match). One that declares nothing is taken as "1.0", the first versioned contract.
# A plugin built for another major, or a newer minor, is not loaded: `engine plugins` says
# what it needs and what this engine offers (see engine.contract.contract_problem).
PLUGIN_HOOKS_VERSION_ATTRIBUTE = "ENGINE_HOOKS_VERSION"
UNDECLARED_HOOKS_VERSION = "1.0"


@hookspec
def register_attention_backends(register):
    """Register attention backends.

    ``register(name, factory, *, check=None, kv_dtypes=("auto",), priority=0, aliases=(),
    description="", page_sizes=None, dtypes=None, mla=False)``: ``factory(ctx) -> AttentionBackend`` builds the backend for one model runner
    (``ctx`` is an :class:`engine.interfaces.BackendContext`); ``check(device) -> str | None``
    returns None when the backend can run on ``device`` (a :class:`engine.device.DeviceInfo`),
    else a human-readable reason; ``kv_dtypes`` lists the ``--kv-cache-dtype`` names it accepts
    (or is ``"any"``: every registered one, for a backend that reads K/V through the pool's
    dequantizing ``get_kv``);
    ``priority`` orders the candidates of ``--attention-backend auto``; ``page_sizes`` (None:
    any) lists the ``--page-size`` values its kernels take, the last one its default when
    ``--page-size`` is not given (``auto`` skips a backend that cannot take a given one);
    ``dtypes`` (None: any) the model dtypes it computes in ("float16", "bfloat16", "float32"):
    ``auto`` skips it for another, and naming it then is refused with the ``--dtype`` to pass;
    ``mla`` says it implements ``AttentionBackend.forward_latent``, the multi-head latent
    attention of DeepSeek-V2/V3 (contract 1.5): a backend without it is never given such a
    model (``auto`` skips it, naming it is refused).
    """


@hookspec
def register_kv_cache_dtypes(register):
    """Register KV-cache dtypes: ``register(name, kv_dtype)`` with an :class:`engine.interfaces.KVDtype`."""


@hookspec
def register_quantization_methods(register):
    """Register weight quantization methods: ``register(name, method, *, check=None)`` with a
    :class:`engine.interfaces.QuantMethod`."""


@hookspec
def register_schedule_policies(register):
    """Register schedule policies: ``register(name, factory, *, cache_aware=False)``;
    ``factory(config) -> SchedulePolicy``. ``cache_aware`` asks the scheduler to compute radix
    prefix matches before ordering (lpm needs them, fcfs does not)."""


@hookspec
def register_routing_policies(register):
    """Register ``--router-policy`` policies of the ``--dp-size`` front: ``register(name,
    factory, *, description="")``; ``factory(options) -> RoutingPolicy`` (see
    :mod:`engine.router.policy`; ``options`` is an :class:`engine.router.policy.RouterOptions`)."""


@hookspec
def register_parallel_strategies(register):
    """Register parallel strategies: ``register(name, strategy, *, check=None)`` with a
    :class:`engine.interfaces.ParallelStrategy`."""


@hookspec
def register_grammar_backends(register):
    """Register structured-output backends for ``--grammar-backend``: ``register(name, factory,
    *, check=None, priority=0, description="")``; ``factory(tokenizer, vocab_size) ->
    GrammarBackend`` (:class:`engine.interfaces.GrammarBackend`); ``check() -> str | None``
    says why it cannot run here (its library missing); the default backend is the available one
    with the highest ``priority``."""


@hookspec
def register_linear_kernels(register):
    """Register GEMM kernels for the model's linear layers: ``register(name, kernel, *,
    weight_dtype, check=None, priority=0, description="", activations="float32")``. ``kernel``
    is an :class:`engine.interfaces.LinearKernel` (pack a weight once at load, then ``linear(x,
    packed, bias)``); ``weight_dtype`` names the weights it keeps ("bfloat16", "float16", or a
    block format such as "q8_0"; "float32" (contract 1.6): the experts of a float32 model's MoE
    layers, where the kernel has a grouped GEMM, and every linear under
    ``ENGINE_LINEAR_KERNEL=NAME``); ``activations`` (contract 1.3) what it multiplies them with:
    "float32" (the activations as they come, float arithmetic) or "int8" (quantized on the fly,
    e.g. per block of 32 as llama.cpp does), which a quantization method's
    ``block_activations`` asks for; ``check(device) -> str | None`` says why it cannot run here
    (an instruction set this CPU lacks, no compiler): kernels are chosen at run time, per
    machine. ``prepack_linears`` gives the layers, for the weight dtype the model runs with,
    the usable kernel with the highest ``priority`` (``ENGINE_LINEAR_KERNEL=NAME`` forces one,
    ``=torch`` keeps the core's oneDNN/fbgemm/F.linear paths); none usable: the core's own."""


@hookspec
def register_speculative_algorithms(register):
    """Register speculative-decoding drafters for ``--speculative-algorithm`` (contract 1.4):
    ``register(name, factory, *, check=None, description="")``; ``factory(ctx) -> Drafter``
    (:class:`engine.interfaces.Drafter`; ``ctx`` an :class:`engine.interfaces.DraftContext`).
    A drafter only proposes tokens; the core verifies them in one target forward and keeps
    the outputs identical to decoding without speculation."""


@hookspec
def register_tool_parsers(register):
    """Register ``--tool-call-parser`` parsers (contract 1.4): ``register(name, factory, *,
    aliases=(), description="")``; ``factory(tools) -> ToolParser``
    (:class:`engine.parsers.ToolParser`; ``tools`` the request's OpenAI tools), one per choice
    of a chat request with ``tool_choice`` auto: it keeps the state of a streamed response."""


@hookspec
def register_reasoning_parsers(register):
    """Register ``--reasoning-parser`` parsers (contract 1.4): ``register(name, factory, *,
    aliases=(), description="")``; ``factory(thinking) -> ReasoningParser``
    (:class:`engine.parsers.ReasoningParser`), one per choice; ``thinking`` False when the
    request turned thinking off or a grammar forces the output."""


@hookspec
def register_hicache_storage(register):
    """Register HiCache storage backends for ``--hicache-storage-backend`` (contract 1.4):
    ``register(name, factory, *, check=None, description="")``; ``factory(ctx) ->
    HiCacheStorage`` (:class:`engine.interfaces.HiCacheStorage`, bytes under string keys;
    ``ctx`` an :class:`engine.interfaces.HiCacheStorageContext`). The core encodes and checks
    every page (identity, tokens, checksum): a backend only stores bytes."""


@hookspec
def register_models(register):
    """Register model classes: ``register(hf_architecture, model_cls)``, e.g.
    ``register("LlamaForCausalLM", LlamaForCausalLM)``."""


@hookspec
def register_serve_options(register):
    """Register extra ``engine serve`` options: ``register(EngineOption(flag, type, default, help))``.
    Their values arrive in ``EngineConfig.plugin_options[plugin_name][dest]``, and the attention
    backend a plugin registered gets its own plugin's as ``BackendContext.options[dest]``."""


@hookspec
def register_commands(cli):
    """Add subcommands to the ``engine`` click group ``cli``."""


@hookspec(firstresult=True)
def select_attention_backend(device, model_config, kv_dtype, page_size, registries, dtype):
    """Pick the backend for ``--attention-backend auto``: return a registered name or None.
    ``model_config`` is the checkpoint's :class:`engine.models.config.ModelConfig` (None when a
    caller resolves without a model); ``page_size`` is the ``--page-size`` asked for, or None
    when it is left to the backend; ``registries`` are the registries being resolved (pick
    from those, not from the process-wide ones); ``dtype`` is the model's resolved dtype name
    ("bfloat16", ...; None when unknown).

    The first non-None answer wins; the core's own answer is ``trylast`` so that a platform plugin
    can override it.
    """


@hookspec
def engine_started(engine):
    """Called once when an :class:`engine.engine.Engine` is ready to take requests.

    ``engine.scheduler.extra_info`` is a dict an observer may fill with what it wants the server
    to publish (JSON-able values, written on the engine's thread): ``/get_server_info`` shows
    each of its keys that the engine's own answer does not already have (the advisor plugin
    publishes ``"advice"``)."""


@hookspec
def step_finished(stats):
    """Called after each scheduler step with an :class:`engine.stats.StepStats`; never inside a
    forward, at most once per step. ``stats.extra_info`` is the stepping engine's
    ``scheduler.extra_info`` (see ``engine_started``): the same dict at every step of one
    engine, so an observer can publish there and tell engines apart by it."""
