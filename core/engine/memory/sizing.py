"""From --mem-fraction-static and friends to pool sizes; every derived default is reported."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.errors import EngineError

# What --mem-fraction-static (vLLM: --gpu-memory-utilization) is a fraction of. On a GPU, of its
# *total* memory, as SGLang and vLLM mean it: weights + KV pool (+ the request table) get that
# share, and memory other processes already use at start counts inside it (SGLang computes the
# pool from the memory free after loading minus total x (1 - fraction)); SGLang's default is
# about 0.88 on big GPUs. On a CPU, of the RAM available at start (MemAvailable): the total is
# shared with the OS and everything else running.
FRACTION_OF = {"cuda": "of the GPU's total memory", "cpu": "of the RAM available at start"}
DEFAULT_MEM_FRACTION = {"cuda": 0.88, "cpu": 0.3}
DEFAULT_CHUNKED_PREFILL = {"cuda": 8192, "cpu": 512}
# request-table rows: an upper bound on concurrently running requests
REQUEST_POOL_SIZE = {"cuda": 4096, "cpu": 512}
REQ_TO_TOKEN_ITEMSIZE = 4  # int32 slots
# decode batches up to this many requests replay CUDA graphs unless --cuda-graph-max-bs says
DEFAULT_CUDA_GRAPH_MAX_BS = 160


@dataclass
class SizingReport:
    device: str
    available_memory_bytes: int
    mem_fraction_static: float
    weight_bytes: int
    kv_bytes_per_token: int
    kv_dtype: str
    max_total_tokens: int
    kv_pool_bytes: int
    max_running_requests: int
    chunked_prefill_size: int
    max_prefill_tokens: int
    context_length: int
    page_size: int
    # what the same pool bytes would hold in a reference KV dtype (set for quantized KV caches)
    reference_kv_dtype: str | None = None
    reference_kv_tokens: int | None = None
    # CUDA graphs: the largest captured decode batch (0: none) and the memory they are expected
    # to take, which must fit outside mem_fraction_static
    cuda_graph_max_bs: int = 0
    cuda_graph_reserve_bytes: int = 0
    # piecewise CUDA graphs: the largest captured token count (0: none) and their memory, also
    # outside mem_fraction_static
    piecewise_cuda_graph_max_tokens: int = 0
    piecewise_cuda_graph_reserve_bytes: int = 0
    # the request table (kv_pool.req_to_token: int32, a row per running request + scratch row)
    req_to_token_bytes: int = 0
    total_memory_bytes: int = 0  # the device's (GPU) or the machine's (RAM) total
    fraction_base_bytes: int = 0  # what mem_fraction_static is a fraction of (see FRACTION_OF)
    fraction_of: str = ""  # and in words

    def lines(self) -> list[str]:
        gib = 1 << 30
        compare, ref = [], self.reference_kv_tokens
        if ref:
            compare = [f"KV cache capacity: {self.max_total_tokens} tokens, "
                       f"{self.max_total_tokens / ref:.2f}x the {ref} tokens of a "
                       f"{self.reference_kv_dtype} KV cache in the same "
                       f"{self.kv_pool_bytes / (1 << 20):.1f} MiB"]
        graphs, knobs, switches = [], ["--mem-fraction-static"], []
        room = int(self.fraction_base_bytes * (1 - self.mem_fraction_static))
        outside = f"expected outside mem_fraction_static (which leaves {room / gib:.2f} GiB)"
        if self.cuda_graph_max_bs:
            graphs.append(f"cuda graph: decode batches up to {self.cuda_graph_max_bs} requests, "
                          f"about {self.cuda_graph_reserve_bytes / gib:.2f} GiB {outside}")
            knobs.append("--cuda-graph-max-bs")
            switches.append("--disable-cuda-graph")
        if self.piecewise_cuda_graph_max_tokens:
            graphs.append(f"piecewise cuda graph: batches up to "
                          f"{self.piecewise_cuda_graph_max_tokens} tokens, about "
                          f"{self.piecewise_cuda_graph_reserve_bytes / gib:.2f} GiB {outside}")
            knobs.append("--piecewise-cuda-graph-max-tokens")
            switches.append("run without --enable-piecewise-cuda-graph")
        if graphs and room < self.cuda_graph_reserve_bytes + \
                self.piecewise_cuda_graph_reserve_bytes:
            graphs.append(f"warning: that may not fit: lower {', '.join(knobs[:-1])} or "
                          f"{knobs[-1]} (or {' or '.join(switches)})")
        return [
            f"device: {self.device}, memory: {self.total_memory_bytes / gib:.2f} GiB total, "
            f"{self.available_memory_bytes / gib:.2f} GiB available at start; "
            f"mem_fraction_static={self.mem_fraction_static} {self.fraction_of} "
            f"({self.fraction_base_bytes * self.mem_fraction_static / gib:.2f} GiB for weights + "
            f"KV pool + request table)",
            f"weights: {self.weight_bytes / gib:.3f} GiB; KV cache: {self.kv_bytes_per_token} bytes/token "
            f"({self.kv_dtype}), max_total_num_tokens={self.max_total_tokens}, "
            f"KV pool {self.kv_pool_bytes / gib:.3f} GiB",
            f"max_running_requests={self.max_running_requests}, chunked_prefill_size="
            f"{self.chunked_prefill_size}, max_prefill_tokens={self.max_prefill_tokens}, "
            f"context_len={self.context_length}, page_size={self.page_size}, request table "
            f"{self.req_to_token_bytes / (1 << 20):.1f} MiB (req_to_token)",
            *compare,
            *graphs,
        ]

    def as_dict(self) -> dict:
        return asdict(self)


def cuda_graph_max_bs(config, device) -> int:
    """The largest decode batch to capture (before the cap at max_running_requests); 0: none."""
    if not device.is_cuda or config.disable_cuda_graph:
        return 0
    if config.cuda_graph_bs:
        return max(config.cuda_graph_bs)
    return config.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS


def piecewise_off_reason(config, device) -> str | None:
    """Why the piecewise CUDA graphs (piecewise_cuda_graph.py) are not captured; None: they
    are."""
    if config.disable_piecewise_cuda_graph:
        return "--disable-piecewise-cuda-graph"
    if not config.enable_piecewise_cuda_graph:
        return "not enabled: --enable-piecewise-cuda-graph turns it on"
    if not device.is_cuda:
        return "needs a CUDA GPU; on a CPU the decode steps run as CPU graphs"
    if config.tp_size * config.pp_size > 1:
        return ("--tp-size/--pp-size > 1: the pieces are the single-process model's (a tp "
                "layer's all-reduce, a stage's hand-off to the next rank)")
    if config.enable_dp_attention:
        return ("--enable-dp-attention: the MoE layers' gathers are sized from every rank's "
                "token count, read on the host")
    return None


def piecewise_max_tokens(config, device, chunk: int) -> int:
    """The largest token count the piecewise graphs capture (0: none): the flag's, at most the
    largest prompt chunk a step holds (``chunk``, or --max-prefill-tokens without chunking)."""
    if piecewise_off_reason(config, device) is not None:
        return 0
    largest = chunk if chunk > 0 else config.max_prefill_tokens
    return min(config.piecewise_cuda_graph_max_tokens, largest)


def default_max_running_requests(max_total_tokens: int, kind: str) -> int:
    """--max-running-requests when not given, on a ``kind`` ("cuda", "cpu") device: half the
    KV pool's tokens, at most the request pool's rows."""
    return max(1, min(max_total_tokens // 2, REQUEST_POOL_SIZE[kind]))


def plan(config, device, weight_bytes: int, kv_bytes_per_token: int, kv_dtype: str,
         model_context_len: int, reference_kv: tuple[str, int] | None = None,
         graph_bytes=None, piecewise_bytes=None) -> SizingReport:
    """``reference_kv``: (dtype name, its KV bytes per token) to compare the capacity with;
    ``graph_bytes(max_bs)``: the expected memory of CUDA graphs up to that batch size;
    ``piecewise_bytes(max_tokens)``: the piecewise CUDA graphs' up to that many tokens. Graphs
    live outside mem_fraction_static, so its default leaves room for them (SGLang's guide: a
    larger --cuda-graph-max-bs wants a lower --mem-fraction-static)."""
    kind = "cuda" if device.is_cuda else "cpu"
    chunk = config.chunked_prefill_size
    if chunk is None:
        chunk = DEFAULT_CHUNKED_PREFILL[kind]
    piece_tokens = piecewise_max_tokens(config, device, chunk)
    piece_reserve = piecewise_bytes(piece_tokens) if piece_tokens and piecewise_bytes else 0
    graph_bs = cuda_graph_max_bs(config, device)
    reserve = piece_reserve + (graph_bytes(graph_bs) if graph_bs and graph_bytes else 0)
    # a GPU's total (what others use at start counts inside the share); a CPU's available RAM
    base = device.total_memory if device.is_cuda else device.available_memory
    in_use = device.total_memory - device.available_memory if device.is_cuda else 0
    fraction = config.mem_fraction_static or DEFAULT_MEM_FRACTION[kind]
    if config.mem_fraction_static is None and reserve and base:
        fraction = min(fraction, int(1000 * (1 - reserve / base)) / 1000)
    context = config.max_model_len or model_context_len
    if context > model_context_len:
        raise EngineError(
            f"--max-model-len {context} is longer than the model's max_position_embeddings "
            f"({model_context_len}); its rotary embedding is not defined past that. Use at most "
            f"{model_context_len}.")
    # the request table comes out of the same budget; sized here for the most rows it can have
    table_rows = (config.max_running_requests or REQUEST_POOL_SIZE[kind]) + 1
    if config.max_total_tokens is not None:
        total = config.max_total_tokens
    else:
        budget = int(base * fraction) - in_use - weight_bytes - (
            table_rows * context * REQ_TO_TOKEN_ITEMSIZE)
        total = budget // kv_bytes_per_token
        if total < 1:
            gib = 1 << 30
            others = (f" plus the {in_use / gib:.2f} GiB other processes already use" if in_use
                      else "")
            raise EngineError(
                f"--mem-fraction-static {fraction} leaves no room for the KV cache: {fraction} x "
                f"{base / gib:.2f} GiB ({FRACTION_OF[kind]}) is less than the "
                f"{weight_bytes / gib:.2f} GiB of weights{others}. Raise "
                f"--mem-fraction-static or set --max-total-tokens.")
    page = config.page_size or 1  # the engine has set the backend's default by now
    total -= total % page
    if total < page:
        raise EngineError(f"--max-total-tokens {total} is smaller than one page "
                          f"(--page-size {page}).")
    max_running = config.max_running_requests or default_max_running_requests(total, kind)
    graph_bs = min(graph_bs, max_running)
    reserve = graph_bytes(graph_bs) if graph_bs and graph_bytes else 0
    return SizingReport(
        device=device.describe(), available_memory_bytes=device.available_memory,
        mem_fraction_static=fraction, weight_bytes=weight_bytes,
        kv_bytes_per_token=kv_bytes_per_token, kv_dtype=kv_dtype, max_total_tokens=total,
        kv_pool_bytes=total * kv_bytes_per_token, max_running_requests=max_running,
        chunked_prefill_size=chunk, max_prefill_tokens=config.max_prefill_tokens,
        context_length=context, page_size=page,
        reference_kv_dtype=reference_kv[0] if reference_kv else None,
        reference_kv_tokens=(total * kv_bytes_per_token // reference_kv[1]
                             if reference_kv else None),
        cuda_graph_max_bs=graph_bs, cuda_graph_reserve_bytes=reserve,
        piecewise_cuda_graph_max_tokens=piece_tokens,
        piecewise_cuda_graph_reserve_bytes=piece_reserve,
        req_to_token_bytes=(max_running + 1) * context * REQ_TO_TOKEN_ITEMSIZE,
        total_memory_bytes=device.total_memory, fraction_base_bytes=base,
        fraction_of=FRACTION_OF[kind],
    )
