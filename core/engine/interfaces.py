"""The abstract types plugins implement. Nothing heavy is imported here."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

from engine.memory.kv_dtype import KVDtype  # noqa: F401  (plugins implement it from here)

if TYPE_CHECKING:
    import torch

    from engine.forward_batch import ForwardBatch
    from engine.memory.kv_pool import KVPool


class GraphUnsupported(Exception):
    """A part of the model cannot run in a CPU graph, or be cut into piecewise CUDA graphs: the
    message says which and why (the start log's "cpu graph: off (...)", "piecewise cuda graph:
    off (...)")."""


@dataclass
class AttentionLayerSpec:
    """What a backend needs to know about one attention layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # attend to at most this many most recent keys
    # multi-head latent attention (DeepSeek-V2/V3's MLA; 0: none). The pool then holds one row
    # of ``head_dim`` values per token (num_kv_heads 1): the compressed latent, its first
    # ``kv_lora_rank`` values, then the rotated rope key; there is no separate V. Queries come
    # in the latent space (W_UK absorbed, ``head_dim`` wide), the keys are the rows, the values
    # the rows' first ``kv_lora_rank`` values, and the output is ``kv_lora_rank`` wide per head
    # (the model applies W_UV after). See ``AttentionBackend.forward_latent``.
    kv_lora_rank: int = 0
    # the query's nope dims before absorption (contract 1.6; 0 unknown): kernels that check
    # the model's geometry (trtllm-gen's MLA decode) take it
    qk_nope_head_dim: int = 0

    def kv_values_per_token(self) -> int:
        """Values one token keeps in the pool for this layer: K and V per KV head, or the
        latent row of an MLA layer."""
        return self.num_kv_heads * self.head_dim * (1 if self.kv_lora_rank else 2)


@dataclass
class BackendContext:
    """Handed to an attention backend factory: the pool it reads and the layers it serves."""

    kv_pool: "KVPool"
    layers: list[AttentionLayerSpec]
    device: Any
    dtype: Any
    # the values of the serve options (EngineOption) registered by the backend's own plugin,
    # by dest: ``engine serve --my-backend-knob 3`` arrives as options["my_backend_knob"] == 3
    options: dict = field(default_factory=dict)


class AttentionBackend(ABC):
    """Computes attention over the paged KV pool for one batch.

    Per step the runner calls :meth:`init_forward_metadata` once, then :meth:`forward` for each
    layer. Backends build their own metadata (flashinfer indptr/indices, FA3 page tables, ...)
    from the :class:`ForwardBatch`, write the new K/V into the pool at ``batch.out_cache_loc``
    and return the attention output.
    """

    def __init__(self, ctx: BackendContext):
        self.ctx = ctx

    @abstractmethod
    def init_forward_metadata(self, batch: "ForwardBatch") -> None:
        """Prepare per-step metadata; called once per forward, before the first layer."""

    @abstractmethod
    def forward(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", layer_id: int,
        batch: "ForwardBatch",
    ) -> "torch.Tensor":
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] for the T new tokens.
        Stores k/v in the pool and returns [T, num_heads, head_dim]."""

    def forward_latent(self, q: "torch.Tensor", latent: "torch.Tensor", layer_id: int,
                       batch: "ForwardBatch") -> "torch.Tensor":
        """An MLA layer (``AttentionLayerSpec.kv_lora_rank``): q [T, num_heads, head_dim] in
        the latent space, latent [T, 1, head_dim] the new tokens' rows. Stores the rows in the
        pool (``KVPool.set_latent``) and returns [T, num_heads, kv_lora_rank]: each head's
        softmax(q . rows * scaling) over the rows' first kv_lora_rank values. A backend that
        implements it registers with ``mla=True``; the others are never handed an MLA model."""
        raise NotImplementedError(f"{type(self).__name__} has no MLA attention")

    # -- CUDA graphs (decode batches; see cuda_graph.py) ----------------------------------------
    # A backend that can run inside a captured graph sets ``supports_cuda_graph`` and implements
    # the three methods below. The graph runner owns one padded decode ForwardBatch per captured
    # size whose tensors never move; ``forward`` then must read only tensors that stay put too.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Allocate fixed metadata buffers for decode batches of up to ``max_bs`` requests."""
        raise NotImplementedError(f"{type(self).__name__} cannot be captured in a CUDA graph")

    def init_forward_metadata_capture_cuda_graph(self, bs: int, batch: "ForwardBatch") -> None:
        """Before capturing the graph for ``bs`` requests: point this size's metadata at the
        fixed buffers (``batch`` is the runner's fixed batch for that size)."""
        raise NotImplementedError

    def init_forward_metadata_replay_cuda_graph(self, bs: int, batch: "ForwardBatch") -> None:
        """Before each replay, outside the graph: refill the fixed buffers for ``batch`` (the
        same fixed batch, now holding the step's requests and padding rows; its host lists are
        current). Must not allocate tensors the captured graph would read."""
        raise NotImplementedError

    # -- CPU graphs (decode batches on a CPU; see engine/cpu_graph) -----------------------------
    def cpu_graph_nodes(self, layer_id: int, q: "torch.Tensor", k: "torch.Tensor",
                        v: "torch.Tensor", out: "torch.Tensor", max_rows: int) -> list:
        """C nodes (``engine.cpu_graph.GraphNode``) that do what :meth:`forward` does for a
        decode step of up to ``max_rows`` requests, reading the step (rows, positions, slots,
        request rows, lengths) from graph.h's ``ek_step_t``: store row r's k and v at
        ``out_cache_loc[r]`` and write its attention output. ``q`` [max_rows, H * D], ``k`` and
        ``v`` [max_rows, KVH * D] and ``out`` [max_rows, H * D] are float32 buffers (views with
        a row stride) that stay put. Raise ``GraphUnsupported`` saying why not (the default)."""
        raise GraphUnsupported(f"attention backend {type(self).__name__} has no CPU graph "
                               f"nodes (the cpu backend has)")


class SchedulePolicy(ABC):
    """Orders the waiting queue each step."""

    @abstractmethod
    def order(self, waiting: Sequence[Any], prefix_len: Callable[[Any], int]) -> list[Any]:
        """Return ``waiting`` in admission order. ``prefix_len(req)`` gives the number of the
        request's prompt tokens found in the prefix cache (computed only for cache-aware
        policies; 0 otherwise). Requests carry ``arrival`` (a monotonically increasing number)."""


class QuantMethod(ABC):
    """A weight quantization method (a module swap, gpt-fast style).

    The loader builds the model on the meta device, casts it to the activation dtype, calls
    :meth:`convert`, materializes it, loads the checkpoint, then calls :meth:`process_weights`
    on every module. Swappable layers carry ``quantizable = True``, ``in_features``,
    ``out_features``, ``bias`` (a parameter or None) and ``shards`` (None, or for a packed
    projection like qkv_proj: checkpoint projection name -> output rows, in order). A swapped-in
    module keeps ``forward(x)``, and for a packed one ``shard_names``, ``shard_rows(name) ->
    (first row, rows)`` and ``forward_split(x)``. It may take its checkpoint tensors over (a
    bf16 weight to quantize, an fp8 weight plus its ``weight_scale``): it then defines
    ``checkpoint_tensors() -> (required names, optional names)`` and ``load_tensor(name, tensor,
    shard)`` (see models/loader.py). ``model.config.hf_config`` is the checkpoint's config.json.
    """

    #: GGUF block formats ("q8_0", ...) whose arithmetic is this method's own, so that their
    #: blocks may run as they are (contract 1.3; an older engine ignores it). On a GGUF whose
    #: blocks (every tensor it holds as blocks) are all in these formats, on a CPU, in float32,
    #: without tensor parallelism, where a registered linear kernel for each format with
    #: :attr:`block_activations` is usable, the engine packs the blocks for that kernel and
    #: calls neither :meth:`convert` nor :meth:`process_weights`; anywhere else the method
    #: runs as usual.
    gguf_blocks: tuple[str, ...] = ()
    #: The activations those kernels take (their ``activations`` at ``register_linear_kernels``,
    #: e.g. "int8": quantized per block of 32, as llama.cpp does); None: no block path.
    block_activations: str | None = None

    @abstractmethod
    def detect(self, hf_config: dict) -> bool:
        """True when the checkpoint is already quantized with this method."""

    @abstractmethod
    def convert(self, model: Any) -> Any:
        """Swap the model's linear layers for quantized ones (on the meta device, before the
        weights are loaded); returns the model."""

    def process_weights(self, module: Any) -> None:
        """Post-process one module after all weights are loaded (check, repack, ...)."""


class LinearKernel(ABC):
    """A GEMM for the model's linear layers with weights packed once at load in the kernel's
    own layout (``register_linear_kernels``): ``prepack_linears`` calls :meth:`pack` on each
    layer's weight and :meth:`linear` in its forward, for every number of rows (the kernel
    chooses how to run a large batch). ``linear`` returns the activations' dtype and must not
    keep ``x``; it is called inside torch.compile graphs through an opaque custom op."""

    @abstractmethod
    def pack(self, weight: torch.Tensor) -> Any:
        """``weight`` [out, in] in the model's dtype -> the packed weight (any object)."""

    @abstractmethod
    def linear(self, x: torch.Tensor, packed: Any,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., in] -> ``x @ W.T + bias`` [..., out]."""

    def packed_bytes(self, packed: Any) -> int:
        """Bytes the packed weight holds (the weight memory the engine reports)."""
        return 0

    def pack_blocks(self, raw: torch.Tensor, fmt: str, n: int, k: int) -> Any:
        """A kernel registered for a block ``weight_dtype`` ("q4_0", "q4_1", "q8_0": GGUF's
        blocks of 32) packs a checkpoint's blocks as they are: ``raw`` is uint8 [n, bytes per
        row] in the file's layout, the weight [n, k]. Optional (a kernel for float weights
        has none)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no {fmt} blocks")

    def graph_nodes(self, packed: Any, bias: "torch.Tensor | None", x: "torch.Tensor",
                    y: "torch.Tensor", max_rows: int) -> list:
        """C nodes (``engine.cpu_graph.GraphNode``) computing ``y[:rows] = x[:rows] @ W.T +
        bias`` for the rows of a CPU-graph step (graph.h's ``ek_step_t.rows`` <= ``max_rows``);
        ``x`` and ``y`` are float32 buffers [max_rows, ...] (views with a row stride) that stay
        put. Optional: raise ``GraphUnsupported`` saying why not (the default)."""
        raise GraphUnsupported(f"linear kernel {type(self).__name__} has no CPU graph nodes")

    def group(self, packed: list) -> Any:
        """An MoE layer's experts' packed weights (each :meth:`pack`'s result, or None for an
        expert another rank holds; one shape) as one object for :meth:`grouped_linear`, built
        once at load. Optional (contract 1.6): raise NotImplementedError (the default), and the
        layer runs one :meth:`linear` per expert."""
        raise NotImplementedError(f"linear kernel {type(self).__name__} has no grouped GEMM")

    def grouped_linear(self, x: torch.Tensor, group: Any, offsets: torch.Tensor) -> torch.Tensor:
        """Every expert's GEMM in one call: rows ``offsets[e]:offsets[e + 1]`` of ``x``
        [rows, in] (sorted by expert; ``offsets`` int64 [experts + 1], from 0 to rows) times
        expert e's weight, into the same rows of the result [rows, out] (x's dtype); an
        expert without a weight (None in :meth:`group`) gives zero rows."""
        raise NotImplementedError(f"linear kernel {type(self).__name__} has no grouped GEMM")

    @property
    def has_grouped(self) -> bool:
        """Whether this kernel overrides :meth:`grouped_linear`."""
        return type(self).grouped_linear is not LinearKernel.grouped_linear


class ParallelStrategy(ABC):
    """How the ranks of ``--tp-size`` x ``--pp-size`` talk: a torch.distributed backend for
    one device type. ``--parallel-strategy auto`` takes the one registered for the device
    (the built-ins: gloo on CPU, nccl on CUDA)."""

    backend: str = ""  # the torch.distributed backend name ("gloo", "nccl", a plugin's)
    device_type: str = "cpu"  # the device its ranks compute on: "cpu" or "cuda"

    @abstractmethod
    def init_rank(self, rank: int, world_size: int, store: Any, timeout_s: int) -> None:
        """Join the default process group as ``rank`` of ``world_size`` on ``store`` (a
        torch.distributed Store node 0 hosts); every collective waits at most ``timeout_s``."""


@dataclass(frozen=True)
class EngineOption:
    """An extra ``engine serve`` option contributed by a plugin."""

    flag: str
    type: Any = str
    default: Any = None
    help: str = ""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


# -- structured outputs (register_grammar_backends) ------------------------------------------------
class GrammarError(ValueError):
    """A constraint a grammar backend cannot compile (malformed, or a feature it does not
    support): the request is refused with a 400 naming ``field`` and the backend's message."""

    def __init__(self, message: str, field: str = ""):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Constraint:
    """What a request's output must match. ``kind``: "json_object" (any JSON object; ``spec``
    ""), "json_schema" (``spec``: the schema as JSON text), "regex", "ebnf" (a GBNF/Lark-style
    grammar, as the backend reads it) or "choice" (``spec``: a JSON list of strings: the output
    is exactly one of them). ``field``: the request field it came from, for error messages
    (e.g. "response_format.json_schema"). Hashable: compiled grammars are cached by it."""

    kind: str
    spec: str
    field: str = ""


class GrammarMatcher(ABC):
    """One sequence's position in its grammar (each of ``n`` samples has its own)."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``: an int32 tensor [B, ceil(V/32)]
        on the host where bit j of word i allows token 32*i + j (xgrammar's and llguidance's
        layout). Called once per step for each constrained row, on the scheduler's thread."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance past the sampled token; False when the grammar rejects it."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete: the sequence ends here (finish reason "stop")."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer. Built once per engine by the factory registered
    with ``register_grammar_backends``: ``factory(tokenizer, vocab_size) -> GrammarBackend``
    (``tokenizer``: the engine's transformers tokenizer; ``vocab_size``: the model's logits
    width, which may exceed the tokenizer's vocabulary)."""

    kinds: tuple[str, ...] = ("json_object", "json_schema", "regex", "ebnf", "choice")

    @abstractmethod
    def compile(self, constraint: Constraint) -> Any:
        """The compiled grammar (may take a while; called on a worker thread, so it must be
        thread-safe). Raises GrammarError for a malformed or unsupported constraint."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled``."""


class Draft(NamedTuple):
    """A drafter's proposal for one request: ``tokens`` to follow its sequence, and a
    ``kind``: drafts of one kind share acceptance statistics (an n-gram drafter's kind is
    its match length: long matches are right more often), so the core learns which drafts
    pay.

    A tree of drafts (``parents``): token ``j`` follows token ``parents[j]`` (-1: the
    request's sequence itself), every parent listed before its children and the most likely
    branches first, so that any first ``k`` tokens are a tree too (the core verifies the first
    ``k`` its policy picks). None: a chain, each token following the one before."""

    tokens: list[int]
    kind: int = 0
    parents: list[int] | None = None

    def first(self, k: int) -> "Draft":
        """The first ``k`` tokens (a tree's first ``k`` nodes are a tree)."""
        return Draft(self.tokens[:k], self.kind,
                     None if self.parents is None else self.parents[:k])

    def depths(self) -> list[int]:
        """Each token's depth (1: it follows the sequence itself)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out


@dataclass(frozen=True)
class DraftContext:
    """What a drafter's factory (``register_speculative_algorithms``, contract 1.4) is built
    with: the engine's speculative settings (an :class:`engine.speculative.SpecSettings`:
    ``algorithm``, ``num_draft_tokens``, ``num_steps``, ``eagle_topk``, ``draft_model_path``,
    ``ngram_min_match_window``, ``ngram_max_match_window``, ``ngram_max_bfs_breadth``), the
    model's vocabulary size (its logits width), the device the target runs on, a loader of
    draft models and the target's runner."""

    settings: Any
    vocab_size: int
    device: Any
    #: ``load_model(path, model_cls=None) -> ModelRunner``: a draft model on the target's
    #: device, dtype and attention backend, with its own KV pool (sized like the target's),
    #: ready to forward; what a model-based drafter (engine.speculative.ModelDrafter) drafts
    #: with. ``model_cls``: build that class (a draft head's, e.g. EAGLE's) whatever the
    #: checkpoint's architecture; its forward takes ``hidden`` from ``runner.forward(batch,
    #: hidden=...)``
    load_model: Any = None
    #: the target's ModelRunner, to read: ``model_config``, and ``model`` whose embedding and
    #: LM head a draft head may share (EAGLE's)
    target: Any = None


class Drafter(ABC):
    """Proposes draft tokens for running requests; the core verifies them in one target
    forward and keeps what the target itself would have produced, so a drafter can be wrong
    at no cost to the output (only to speed). Built once per engine; used from one thread."""

    #: the target's hidden states this drafter reads (EAGLE), side by side in this order: an
    #: int ``i`` is layer ``i``'s output (the residual stream), "norm" the last layer's output
    #: after the final norm (what the LM head reads); () (the default): none. When set, the
    #: core hands them to ``observe`` after every target forward, which then runs eagerly
    #: (no CPU/CUDA graph)
    hidden_states: tuple = ()

    def observe(self, reqs: list, starts: list[int], hidden: list) -> None:
        """With ``hidden_states`` set, after every target forward (prompt chunks, decodes,
        verify steps): ``hidden[i]`` [n, D] are the hidden states of positions ``starts[i]``
        .. ``starts[i] + n - 1`` of request ``reqs[i]``'s sequence (prompt + output), the
        positions the forward computed and kept (a verify step's accepted ones only; a
        radix-cache hit's prefix never comes). The tensors are the forward's own: copy what
        is kept past the next forward."""

    @abstractmethod
    def propose(self, reqs: list, max_tokens: list[int]) -> list[Draft]:
        """For each request of ``reqs`` (objects with ``rid``, ``prompt_ids`` and
        ``output_ids``: their sequence is prompt + output, the last token not yet run through
        the target), a :class:`Draft` of at most ``max_tokens[i]`` tokens (possibly none).
        A request is proposed for every step it decodes until ``release``."""

    def release(self, rid: str) -> None:
        """Request ``rid`` finished, or was retracted (it may come back): forget its state."""

    def describe(self) -> str:
        """One line for the start log (its settings)."""
        return type(self).__name__


@dataclass(frozen=True)
class HiCacheStorageContext:
    """What a HiCache storage backend's factory (``register_hicache_storage``, contract 1.4) is
    built with: ``directory`` (--hicache-storage-dir, else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR,
    else /tmp/hicache; a backend that is no directory may ignore it), ``identity`` (the model,
    dtypes and page sizes every page records; the core checks it on every read) and
    ``options`` (the backend plugin's own ``--plugin-option``s)."""

    directory: str
    identity: dict
    options: dict = field(default_factory=dict)


class HiCacheStorage(ABC):
    """The storage tier of ``--enable-hierarchical-cache``: opaque pages of bytes under string
    keys (the hash chain of a prefix's pages: servers that share a store share prefixes; with
    ranks, rank r > 0 stores its shard under the key + ``-r{r}``). The core encodes and checks
    pages (identity, tokens, checksum), so a backend stores bytes as
    given. Called from the core's background threads (one writer, one reader): a backend
    must be thread-safe. ``get`` of a missing key returns None; a failing store raises."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or None."""

    @abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (a reader never sees half a page: write, then publish)."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is stored (cheap: asked for each page of a prefix)."""

    def describe(self) -> str:
        """One line for the start log (where the pages go)."""
        return type(self).__name__
