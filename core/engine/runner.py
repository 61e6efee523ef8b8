"""ModelRunner: owns the model, the KV pool and the attention backend; runs one batch forward."""

from __future__ import annotations

import importlib

import torch

from engine.device import DeviceInfo
from engine.errors import EngineError
from engine.forward_batch import ForwardBatch
from engine.interfaces import BackendContext, KVDtype
from engine.layers.attention import Attention, forward_context
from engine.layers.linear import prepack_linears
from engine.layers.moe_fused import fuse_moe_layers
from engine.layers.moe_grouped import group_moe_layers
from engine.memory.kv_pool import KVPool
from engine.models.block_weights import (block_note, block_reason, pack_block_linears,
                                         quant_block_reason)
from engine.models.checkpoint import Checkpoint, open_checkpoint
from engine.models.config import ModelConfig
from engine.models.dtype import cpu_half_weights, resolve_dtype
from engine.models.loader import load_model, weight_bytes


def resolve_model_class(registries, architecture: str):
    """The registered class for ``architecture``; a "module:attr" string is imported now."""
    obj = registries.models.get(architecture).obj
    if isinstance(obj, str):
        module, _, attr = obj.partition(":")
        obj = getattr(importlib.import_module(module), attr)
    return obj


class ModelRunner:
    def __init__(self, model: str | Checkpoint, *, registries, device: DeviceInfo,
                 dtype: str = "auto", attention_factory=None, kv_dtype: KVDtype | None = None,
                 quant_method=None, compile_max_tokens: int | None = None,
                 backend_options: dict | None = None, tp=None, pp=None, model_cls=None):
        """``model``: a path (HF directory or GGUF file) or an opened Checkpoint;
        ``model_cls``: the class to build, whatever the checkpoint's architecture (a draft
        head a plugin defines, e.g. EAGLE's; None: the registered class of its architecture);
        ``compile_max_tokens``: torch.compile the decoder stack for forwards up to that many
        tokens (``--enable-torch-compile``; see compile.py); ``tp``: this rank's TPGroup and
        ``pp``: its PPStage (engine.parallel): it holds and computes only its shard."""
        # --enable-dp-attention: the model's MoE layers over the ranks, the rest whole (as
        # with no tp: this rank's own requests and KV); forwards run in step (dp_idle)
        self.dp = tp if getattr(tp, "dp_attention", False) else None
        if self.dp is not None:
            tp = None
        self.device, self.tp, self.pp = device, tp, pp
        self.forwards = 0  # forwards run (the engine loop's idle steps tell one from none)
        self._dp_blocks = None  # dp_idle's MoE blocks, found once
        self.checkpoint = ckpt = open_checkpoint(model) if isinstance(model, str) else model
        self.model_config = ModelConfig.from_checkpoint(
            ckpt, registries.models if model_cls is None else None)
        self.dtype, self.dtype_reason = resolve_dtype(dtype, self.model_config.torch_dtype, device)
        half_weights = cpu_half_weights(dtype, device)
        model_cls = model_cls or resolve_model_class(registries, self.model_config.architecture)
        parallel = {"tp": tp or self.dp} if (tp or self.dp) is not None else {}
        if pp is not None:
            parallel["pp"] = pp
        # a quantization method whose arithmetic the GGUF's blocks are runs as them (see
        # QuantMethod.gguf_blocks): the model is not converted, the blocks are packed for the
        # kernels taking its activations, and the start log's quantization line says so
        self.quant_note, activations = None, None
        if quant_method is not None and quant_block_reason(
                quant_method, ckpt, device.torch_device, self.dtype, half_weights,
                bool(parallel), registries) is None:
            activations = quant_method.block_activations
            self.quant_note = block_note(ckpt.block_formats(), activations)
            quant_method = None
        self.model = load_model(model_cls, self.model_config, ckpt, self.dtype,
                                device.torch_device, quant_method, **parallel)
        self.compiled = None
        # oneDNN-prepacked float32 weights on CPU (float16 ones for fbgemm with --dtype float16;
        # a plugin's kernel for float16/bfloat16 weights where one runs on this CPU), F.linear
        # elsewhere: the log line says which (a compiled graph calls the packed linears
        # as opaque ops, see compile.py)
        self.linear_kernel = self._pack_linears(ckpt, registries, half_weights,
                                                parallel=bool(parallel),
                                                quantized=quant_method is not None,
                                                activations=activations)
        # an MoE model's sparse layers: grouped GEMMs on a CPU (packed with the linears,
        # above), the fused Triton kernel on CUDA (experts stacked once), else the per-expert
        # GEMMs; the start log's line says which and why ("" if none)
        self.moe_kernel = self.moe_grouped or fuse_moe_layers(self.model, device.torch_device)
        if compile_max_tokens:
            from engine.compile import CompiledDecoder

            decoder = getattr(self.model, "model", None)
            if decoder is None:
                raise EngineError(f"--enable-torch-compile: {type(self.model).__name__} has no "
                                  f"decoder stack at .model to compile.")
            self.compiled = CompiledDecoder(decoder, compile_max_tokens)
        self.weight_bytes = weight_bytes(self.model)  # as stored: quantized tensors count as such
        self.attention_factory = attention_factory or registries.attention.get("torch_native").obj
        self.kv_dtype = kv_dtype or KVDtype()
        self.backend_options = dict(backend_options or {})
        self.kv_pool: KVPool | None = None
        self.backend = None
        self.cuda_graphs = None  # a CudaGraphRunner once init_cuda_graphs() captured them
        self.last_cuda_graph = False  # whether the latest forward replayed a graph
        self.cpu_graph = None  # a CpuGraphRunner once init_cpu_graph() recorded it
        # a PiecewiseCudaGraphRunner once init_piecewise_cuda_graphs() captured them
        self.piecewise_graphs = None
        self.last_piecewise_graph = False  # whether the latest forward replayed its pieces

    def _pack_linears(self, ckpt, registries, half_weights: bool, parallel: bool,
                      quantized: bool, activations: str | None = None) -> str:
        """Pack the linears for the kernels that run them here (a GGUF's Q4_1/Q8_0 blocks as
        they are where a kernel for them runs, see block_weights.py: with ``activations``,
        a kernel taking those; the others by prepack_linears); returns the log line."""
        device = self.device.torch_device
        parts = []
        if block_reason(ckpt, device, self.dtype, half_weights, parallel, quantized) is None:
            parts = pack_block_linears(self.model, ckpt, registries, activations)
        # an MoE model's experts, for a kernel's grouped GEMM where one runs (CPU)
        self.moe_grouped = group_moe_layers(self.model, device, self.dtype, half_weights,
                                            registries)
        rest = prepack_linears(self.model, device, self.dtype, half_weights, registries)
        if not parts:
            return rest
        if rest:
            parts.append(rest.removeprefix("linear layers: "))
        return "linear layers: " + "; ".join(parts)

    @property
    def kv_storage_dtype(self) -> torch.dtype:
        return self.kv_dtype.storage or self.dtype

    @property
    def layer_specs(self) -> list:
        """The attention layers this rank computes, with its head counts."""
        if self.tp is None and self.pp is None:
            return self.model_config.layer_specs()
        from engine.parallel.shard import rank_layer_specs

        return rank_layer_specs(self.model_config, 1 if self.tp is None else self.tp.size,
                                pp=self.pp)

    @property
    def is_last_stage(self) -> bool:
        return self.pp is None or self.pp.is_last

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of K and V per token (on this rank; an MLA model's latent rows), in the
        pool's dtype or in ``dtype``."""
        size = torch.empty((), dtype=dtype or self.kv_storage_dtype).element_size()
        return sum(s.kv_values_per_token() * size for s in self.layer_specs)

    def init_kv_pool(self, num_tokens: int, page_size: int = 1, max_reqs: int = 256,
                     max_context_len: int = 4096) -> KVPool:
        specs = self.layer_specs
        self.kv_pool = KVPool(len(specs), specs[0].num_kv_heads, specs[0].head_dim, num_tokens,
                              self.kv_storage_dtype, self.device.torch_device, page_size,
                              max_reqs, max_context_len, kv_dtype=self.kv_dtype,
                              latent=bool(specs[0].kv_lora_rank))
        self.kv_scales_from_checkpoint = False
        if self.kv_dtype.needs_scale:  # the checkpoint's scales where it has them, else 1.0
            for m in self.model.modules():
                if isinstance(m, Attention):
                    for name in ("k_scale", "v_scale"):
                        if getattr(m, name) is not None:
                            getattr(self.kv_pool, name)[m.layer_id] = getattr(m, name)
                            self.kv_scales_from_checkpoint = True
        ctx = BackendContext(self.kv_pool, specs, self.device.torch_device, self.dtype,
                             self.backend_options)
        self.backend = self.attention_factory(ctx)
        return self.kv_pool

    def init_cuda_graphs(self, sizes: list[int], graph_cls=None) -> float:
        """Capture decode forwards of ``sizes`` requests (see cuda_graph.py); returns seconds.
        ``graph_cls``: a stand-in for torch.cuda.CUDAGraph (the CPU tests' EagerGraph)."""
        from engine.cuda_graph import CudaGraphRunner

        assert self.backend is not None, "call init_kv_pool() before init_cuda_graphs()"
        if not self.backend.supports_cuda_graph:
            raise EngineError(f"attention backend {type(self.backend).__name__} cannot run "
                              f"inside a CUDA graph")
        self.cuda_graphs = CudaGraphRunner(self, sizes, graph_cls)
        return self.cuda_graphs.capture()

    def init_piecewise_cuda_graphs(self, max_tokens: int, graph_cls=None) -> float:
        """Capture the layers between attentions for batches of up to ``max_tokens`` tokens
        (see piecewise_cuda_graph.py); returns seconds. Raises GraphUnsupported when the model
        cannot be cut (no piecewise_parts, tensor- or pipeline-parallel layers)."""
        from engine.piecewise_cuda_graph import PiecewiseCudaGraphRunner, capture_sizes

        assert self.backend is not None, "call init_kv_pool() before init_piecewise_cuda_graphs()"
        graphs = PiecewiseCudaGraphRunner(self, capture_sizes(max_tokens), graph_cls)
        seconds = graphs.capture()
        self.piecewise_graphs = graphs
        return seconds

    def init_cpu_graph(self, max_rows: int):
        """Record the forward as a CPU graph for steps of up to ``max_rows`` tokens (see
        engine/cpu_graph); raises GraphUnsupported saying why it cannot."""
        from engine.cpu_graph.replay import CpuGraphRunner

        assert self.backend is not None, "call init_kv_pool() before init_cpu_graph()"
        self.cpu_graph = CpuGraphRunner(self, max_rows)
        return self.cpu_graph

    def capture_hidden(self, which: tuple) -> None:
        """From now on every forward keeps the hidden states ``which`` of every new token in
        ``last_hidden`` (see LlamaForCausalLM.capture_hidden), for a drafter that reads them
        (EAGLE). Those forwards run eagerly: the CPU/CUDA graphs are dropped."""
        capture = getattr(self.model, "capture_hidden", None)
        arch = self.model_config.architecture
        if capture is None or self.tp is not None or self.pp is not None:
            raise EngineError(f"{arch}{' on several ranks' if capture else ''} cannot hand its "
                              f"hidden states to a drafter yet (a Llama-family model on one "
                              f"process can)")
        if self.compiled is not None:
            raise EngineError("a drafter reading the target's hidden states with "
                              "--enable-torch-compile is not supported yet: drop one of them")
        capture(tuple(which))
        self.cuda_graphs = self.piecewise_graphs = self.cpu_graph = None

    @property
    def last_hidden(self) -> torch.Tensor | None:
        """[T, D]: the latest forward's hidden states that ``capture_hidden`` asked for."""
        return getattr(self.model, "captured", None)

    def forward(self, batch: ForwardBatch, return_all_logits: bool = False,
                hidden: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [B, V] at each request's last new token ([T, V] with
        ``return_all_logits``). A pipeline stage (``pp``) after the first takes the previous
        stage's ``hidden`` [T, hidden_size]; one before the last returns its own. A draft head
        that reads the target's hidden states (EAGLE) takes them as ``hidden``."""
        assert self.backend is not None, "call init_kv_pool() before forward()"
        self.forwards += 1
        if self.dp is not None:  # every rank's token count: the MoE layers' gathers
            self.dp.begin(batch.num_tokens)
        graphs = self.cuda_graphs  # never captured with pp (a stage waits on another rank)
        self.last_cuda_graph = (graphs is not None and not return_all_logits
                                and graphs.can_run(batch))
        if self.last_cuda_graph:
            with torch.inference_mode():
                return graphs.replay(batch).float()
        pieces = self.piecewise_graphs  # never captured with pp or tp
        self.last_piecewise_graph = (pieces is not None
                                     and pieces.can_run(batch, return_all_logits))
        if self.last_piecewise_graph:
            with torch.inference_mode():
                return pieces.replay(batch, return_all_logits).float()
        cpu_graph = self.cpu_graph
        if cpu_graph is not None and cpu_graph.can_run(batch):
            return cpu_graph.replay(batch, return_all_logits)
        stage = {} if self.pp is None and hidden is None else {"hidden": hidden}
        with torch.inference_mode():
            self.backend.init_forward_metadata(batch)
            with forward_context(self.backend, batch):
                out = self.model(batch, return_all_logits, **stage)
        return out.float() if self.is_last_stage else out

    def dp_idle(self) -> bool:
        """A data-parallel attention rank with nothing to run: its part in the other ranks'
        forward if one runs (the count exchange, then each MoE layer's collectives with no
        tokens of its own). False when no rank had tokens (nothing ran)."""
        if not any(self.dp.begin(0)):
            return False
        if self._dp_blocks is None:  # the MoE blocks in the order a forward runs them
            from engine.layers.moe import SparseMoE

            self._dp_blocks = [m for m in self.model.modules() if isinstance(m, SparseMoE)]
        x = torch.zeros(0, self.model_config.hidden_size, dtype=self.dtype,
                        device=self.device.torch_device)
        with torch.inference_mode():
            for block in self._dp_blocks:
                block(x)
        return True


def build_runner(config, checkpoint, registries, device, attn_entry, kv_entry, quant_entry,
                 tp=None, pp=None, model_cls=None) -> ModelRunner:
    """The ModelRunner of ``config`` once its names are resolved (the engine's, and every
    tp/pp rank's: they must build alike); ``model_cls``: a draft head's class (see
    ModelRunner), never compiled."""
    return ModelRunner(
        checkpoint, registries=registries, device=device, dtype=config.dtype,
        attention_factory=attn_entry.obj, kv_dtype=kv_entry.obj,
        # the backend's plugin's own serve options (EngineOption), as BackendContext.options
        backend_options=config.plugin_options.get(attn_entry.plugin, {}),
        quant_method=quant_entry.obj if quant_entry else None,
        compile_max_tokens=(config.torch_compile_max_bs
                            if config.enable_torch_compile and model_cls is None else None),
        tp=tp, pp=pp, model_cls=model_cls)
