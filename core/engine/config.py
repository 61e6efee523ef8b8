"""Every knob of the engine, named like the SGLang/vLLM flags, with defaults and validation."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.errors import EngineError


class ConfigError(EngineError, ValueError):
    pass


_DEFAULT_MAX_PREFILL_TOKENS = 16384


# --kv-cache-dtype spellings of vLLM and SGLang for the registered names: vLLM's "fp8" is
# fp8_e4m3 (its docs: "fp8 and fp8_e4m3 are the same"), SGLang and vLLM both take "bfloat16"
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3", "bfloat16": "bf16", "float16": "fp16",
                          "float32": "fp32"}


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None  # defaults to model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    page_size: int | None = None  # None: the attention backend's default (1 for most)
    # memory
    mem_fraction_static: float | None = None  # None: per-device default (see memory/sizing.py)
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    max_model_len: int | None = None  # context length; None: the model's
    # scheduling
    schedule_policy: str = "lpm"
    schedule_conservativeness: float | str = 1.0  # or "auto" (scheduler/adaptive.py)
    chunked_prefill_size: int | None = None  # None: per-device default; -1 disables chunking
    max_prefill_tokens: int = _DEFAULT_MAX_PREFILL_TOKENS
    disable_radix_cache: bool = False
    # HiCache (engine/hicache): radix nodes evicted from the device KV pool kept in a host pool
    # (hicache_ratio x the device pool, or hicache_size GiB), and with a storage backend in a
    # third tier keyed by each page's token hash chain (SGLang's flags and defaults)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0  # GiB; 0: hicache_ratio decides
    hicache_write_policy: str = "write_through"  # | write_through_selective | write_back
    hicache_storage_backend: str | None = None  # a register_hicache_storage name (file)
    hicache_storage_prefetch_policy: str = "best_effort"  # | wait_complete | timeout
    hicache_storage_dir: str | None = None  # None: $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR
    # the prefill line's #cached-token per tier and a periodic hit-rate line per tier
    enable_cache_report: bool = False
    decode_log_interval: int = 40
    max_queued_requests: int | None = None
    # the server renders a chat template sent with a request (vLLM's flag; off: refused)
    trust_request_chat_template: bool = False
    # SGLang's overlap scheduler: the next batch is prepared while the model runs this one
    # (off by default here: on a CPU both threads share the cores); disable_... is SGLang's
    # spelling of the default
    enable_overlap_schedule: bool = False
    disable_overlap_schedule: bool = False
    # torch.compile of the decoder stack for forwards of up to torch_compile_max_bs tokens
    enable_torch_compile: bool = False
    torch_compile_max_bs: int = 32
    # CUDA graphs for decode batches of up to cuda_graph_max_bs requests (None: see sizing.py)
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None  # the exact sizes to capture
    disable_cuda_graph: bool = False
    # piecewise CUDA graphs for prompt/extend/mixed batches of up to that many tokens (SGLang's;
    # off by default here: never run on a GPU yet; disable_... is the explicit off)
    enable_piecewise_cuda_graph: bool = False
    disable_piecewise_cuda_graph: bool = False
    piecewise_cuda_graph_max_tokens: int = 4096
    # CPU graphs for steps of up to cpu_graph_max_bs tokens (engine/cpu_graph)
    cpu_graph_max_bs: int = 64
    disable_cpu_graph: bool = False
    # parallelism: tp_size x pp_size ranks (worker processes; engine/ranks), over nnodes
    # nodes that meet at dist_init_addr (host:port); dp_size replicas are the router's (one
    # Engine is one replica)
    tp_size: int = 1
    pp_size: int = 1
    # MoE experts split over the tp ranks into ep_size runs of whole experts (SGLang's
    # --ep-size; must divide tp_size); enable_expert_parallel is vLLM's spelling of ep = tp
    ep_size: int = 1
    enable_expert_parallel: bool = False
    # SGLang's: attention data-parallel over the --tp-size ranks (each its own requests, KV and
    # scheduler, behind one front), the MoE layers over all of them (engine/parallel/
    # dp_attention.py); a rank's own process gets its place in the three below (set by the front)
    enable_dp_attention: bool = False
    dp_attention_rank: int | None = None
    dp_attention_size: int = 1
    dp_attention_init: str | None = None  # tcp://host:port where the ranks meet
    dp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dist_timeout: int = 600  # seconds: joining, and any one collective
    parallel_strategy: str = "auto"  # the torch.distributed backend: auto = gloo / nccl
    # requests per pipeline micro-batch (None: a batch is cut into pp_size micro-batches)
    pp_max_micro_batch_size: int | None = None
    seed: int = 0
    # structured outputs: auto = the usable grammar backend with the highest priority (none
    # installed: constrained requests are refused), none = off, or a registered name
    grammar_backend: str = "auto"
    # chat: tool calls read from the output (SGLang's --tool-call-parser; vLLM's too, with
    # --enable-auto-tool-choice) and the reasoning apart from the answer (--reasoning-parser)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    # speculative decoding (engine/speculative; SGLang's flags; vLLM's --speculative-config
    # JSON is folded into them, a clash being an error, by speculative/settings.py, which
    # checks them when the Engine resolves its names): the drafter is a plugin's
    # (register_speculative_algorithms), the core verifies
    speculative_algorithm: str | None = None  # NGRAM | STANDALONE | EAGLE | EAGLE3
    speculative_num_draft_tokens: int | None = None  # per request and step, its last included
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    speculative_ngram_max_bfs_breadth: int | None = None
    speculative_config: str | dict | None = None  # vLLM's JSON
    plugin_options: dict = field(default_factory=dict)
    # vLLM's spellings (validate() folds each into the SGLang knob above; both with different
    # values is an error naming both)
    gpu_memory_utilization: float | None = None  # = mem_fraction_static
    max_num_seqs: int | None = None  # = max_running_requests
    # with chunked prefill (vLLM's default) the token budget of a step = chunked_prefill_size;
    # without it, the prompt tokens of a step = max_prefill_tokens
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None  # False = chunked_prefill_size -1

    def validate(self) -> "EngineConfig":
        def need(ok: bool, msg: str):
            if not ok:
                raise ConfigError(msg)

        self._fold_vllm_spellings(need)
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)

        need(self.dtype in ("auto", "float32", "bfloat16", "float16"),
             f"--dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}")
        need(self.device in ("auto", "cpu", "cuda"),
             f"--device must be one of auto, cpu, cuda, got {self.device!r}")
        need(self.page_size is None or self.page_size >= 1,
             f"--page-size must be >= 1, got {self.page_size}")
        if self.mem_fraction_static is not None:
            need(0 < self.mem_fraction_static < 1,
                 f"--mem-fraction-static (--gpu-memory-utilization) must be in (0, 1), got "
                 f"{self.mem_fraction_static}")
        for name in ("max_total_tokens", "max_running_requests", "max_model_len",
                     "max_queued_requests"):
            value = getattr(self, name)
            need(value is None or value >= 1,
                 f"--{name.replace('_', '-')} must be >= 1, got {value}")
        sc = self.schedule_conservativeness
        need(sc == "auto" or (isinstance(sc, (int, float)) and not isinstance(sc, bool)
                              and sc > 0),
             f"--schedule-conservativeness must be a number > 0 (1.0: SGLang's default; lower "
             f"admits more) or 'auto' (adapts to the output lengths observed), got {sc!r}")
        c = self.chunked_prefill_size
        need(c is None or c == -1 or c >= 1,
             f"--chunked-prefill-size must be -1 (disabled) or >= 1, got {c}")
        need(self.max_prefill_tokens >= 1,
             f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        need(self.torch_compile_max_bs >= 1,
             f"--torch-compile-max-bs must be >= 1, got {self.torch_compile_max_bs}")
        need(self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
             f"--cuda-graph-max-bs must be >= 1, got {self.cuda_graph_max_bs}")
        need(self.cpu_graph_max_bs >= 1,
             f"--cpu-graph-max-bs must be >= 1, got {self.cpu_graph_max_bs}")
        need(not self.cuda_graph_bs or min(self.cuda_graph_bs) >= 1,
             f"--cuda-graph-bs sizes must be >= 1, got {self.cuda_graph_bs}")
        self._check_piecewise(need)
        need(self.decode_log_interval >= 1,
             f"--decode-log-interval must be >= 1, got {self.decode_log_interval}")
        self._check_parallel(need)
        self._check_hicache(need)
        need(not (self.enable_overlap_schedule and self.disable_overlap_schedule),
             "--enable-overlap-schedule and --disable-overlap-schedule contradict each other; "
             "give one of them (off is the default).")
        need(not self.enable_overlap_schedule or self.tp_size * self.pp_size == 1,
             "--enable-overlap-schedule with --tp-size or --pp-size > 1 is not supported yet; "
             "drop one of them.")
        need(isinstance(self.grammar_backend, str) and bool(self.grammar_backend),
             f"--grammar-backend must be auto, none or a grammar backend's name, got "
             f"{self.grammar_backend!r}")
        need(not self.enable_auto_tool_choice or bool(self.tool_call_parser),
             "--enable-auto-tool-choice needs --tool-call-parser NAME (the format the model "
             "writes its calls in: `engine plugins` lists the installed parsers)")
        need(self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}")
        need(self.dp_size == 1,
             f"dp_size {self.dp_size}: one Engine is one replica; N replicas are N processes "
             f"behind a router: run `engine serve --dp-size {self.dp_size}`")
        return self

    def _check_piecewise(self, need) -> None:
        need(self.piecewise_cuda_graph_max_tokens >= 1,
             f"--piecewise-cuda-graph-max-tokens must be >= 1, got "
             f"{self.piecewise_cuda_graph_max_tokens}")
        need(not (self.enable_piecewise_cuda_graph and self.disable_piecewise_cuda_graph),
             "--enable-piecewise-cuda-graph and --disable-piecewise-cuda-graph contradict each "
             "other; give one of them (off is the default).")
        need(not (self.enable_piecewise_cuda_graph and self.enable_torch_compile),
             "--enable-piecewise-cuda-graph with --enable-torch-compile is not supported: the "
             "pieces run the eager layers, not the compiled decoder; drop one of them.")

    def _check_hicache(self, need) -> None:
        from engine.hicache.settings import check_hicache

        check_hicache(self, need)

    def _check_parallel(self, need) -> None:
        from engine.parallel.topology import Topology

        Topology(self.tp_size, self.pp_size, self.nnodes, self.node_rank)  # raises on bad sizes
        need(self.pp_max_micro_batch_size is None or self.pp_max_micro_batch_size >= 1,
             f"--pp-max-micro-batch-size must be >= 1, got {self.pp_max_micro_batch_size}")
        need(self.dist_timeout >= 1, f"--dist-timeout must be >= 1 second, got "
                                     f"{self.dist_timeout}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            need(bool(host) and port.isdigit() and 0 < int(port) < 65536,
                 f"--dist-init-addr must be host:port (e.g. 10.0.0.1:5000), got "
                 f"{self.dist_init_addr!r}")
        need(not self.enable_torch_compile or self.tp_size * self.pp_size == 1,
             "--enable-torch-compile with --tp-size or --pp-size > 1 is not supported yet (the "
             "compiled decoder would hold the ranks' collectives); drop one of them.")
        need(self.ep_size >= 1, f"--ep-size must be >= 1, got {self.ep_size}")
        # the ranks the experts are split over: the tp group, or a data-parallel attention
        # rank's peers (its own process has --tp-size 1)
        ranks = self.dp_attention_size if self.dp_attention_rank is not None else self.tp_size
        if self.enable_expert_parallel:
            need(self.ep_size in (1, ranks),
                 f"--ep-size {self.ep_size} and --enable-expert-parallel (vLLM's: ep = --tp-size "
                 f"{ranks}) set the same knob to different values; give one of them.")
            self.ep_size = ranks
        need(ranks % self.ep_size == 0,
             f"--ep-size {self.ep_size} must divide --tp-size {ranks}: the experts are "
             f"split over the ranks of the tp group; use e.g. --tp-size {self.ep_size} "
             f"--ep-size {self.ep_size}.")
        self._check_dp_attention(need)
        need(self.nnodes == 1 or self.dist_init_addr is not None,
             f"--nnodes {self.nnodes} needs --dist-init-addr host:port: the address of node 0, "
             f"where the other nodes meet it (give every node the same one).")

    def _check_dp_attention(self, need) -> None:
        """--enable-dp-attention: as given to engine serve (tp_size ranks to start), or as a
        rank's own process sees it (tp_size 1, its rank among dp_attention_size)."""
        if self.dp_attention_rank is not None:  # one rank's process, started by the front
            need(self.enable_dp_attention and self.tp_size == 1 and self.pp_size == 1
                 and 0 <= self.dp_attention_rank < self.dp_attention_size
                 and self.dp_attention_init is not None,
                 "--dp-attention-rank/-size/-init are set by `engine serve "
                 "--enable-dp-attention` for each rank it starts; do not give them.")
            return
        need(self.dp_attention_size == 1 and self.dp_attention_init is None,
             "--dp-attention-size/-init are set by `engine serve --enable-dp-attention` with "
             "--dp-attention-rank for each rank it starts; do not give them.")
        if not self.enable_dp_attention:
            return
        need(self.tp_size > 1,
             "--enable-dp-attention runs the attention data-parallel over the --tp-size ranks "
             "(each its own requests and KV cache) and the MoE layers over all of them: give "
             "--tp-size 2 or more.")
        need(self.pp_size == 1 and self.nnodes == 1,
             "--enable-dp-attention runs on one node without pipeline stages: drop --pp-size "
             "and --nnodes.")
        need(self.dp_size in (1, self.tp_size),
             f"--dp-size {self.dp_size} with --enable-dp-attention: the data-parallel "
             f"attention replicas are the --tp-size {self.tp_size} ranks (SGLang's --dp equal "
             f"to --tp); drop --dp-size or give {self.tp_size}.")
        need(not self.enable_torch_compile and not self.enable_overlap_schedule
             and self.speculative_algorithm is None and self.speculative_config is None,
             "--enable-dp-attention runs every rank's forward in step with the others' MoE "
             "layers (a collective per layer); not yet with --enable-torch-compile, "
             "--enable-overlap-schedule or speculative decoding: drop them.")

    def _fold_vllm_spellings(self, need) -> None:
        def same(ours: str, theirs: str, value, default=None) -> None:
            """Set knob ``ours`` from vLLM's ``theirs`` (``value``), unless it is already set to
            something else (``default``: what "not set" looks like)."""
            if value is None:
                return
            current = getattr(self, ours)
            need(current in (default, value),
                 f"--{ours.replace('_', '-')} {current} and --{theirs.replace('_', '-')} {value} "
                 f"set the same knob to different values; give one of them.")
            setattr(self, ours, value)

        same("mem_fraction_static", "gpu_memory_utilization", self.gpu_memory_utilization)
        same("max_running_requests", "max_num_seqs", self.max_num_seqs)
        chunked, batched = self.enable_chunked_prefill, self.max_num_batched_tokens
        if chunked is False:
            need(self.chunked_prefill_size in (None, -1),
                 f"--no-enable-chunked-prefill and --chunked-prefill-size "
                 f"{self.chunked_prefill_size} contradict each other; give one of them.")
            self.chunked_prefill_size = -1
            same("max_prefill_tokens", "max_num_batched_tokens", batched,
                 default=_DEFAULT_MAX_PREFILL_TOKENS)
        else:
            need(not (chunked and self.chunked_prefill_size == -1),
                 "--enable-chunked-prefill and --chunked-prefill-size -1 contradict each other; "
                 "give one of them.")
            same("chunked_prefill_size", "max_num_batched_tokens", batched)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s): {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(known))}")
        return cls(**kwargs).validate()
