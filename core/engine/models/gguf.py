"""GGUF files (llama.cpp's format) read with the ``gguf`` package: the file opened and checked,
its metadata (made an HF config.json dict by gguf_config.py), and the tensors dequantized,
renamed to the HF names our models load, with llama.cpp's Q/K rotary permutation undone.

llama.cpp's converter permutes the rows of q_proj and k_proj of "llama" models (its rope rotates
adjacent pairs; HF's rotates the two halves of a head); Qwen2/Qwen3 are converted unpermuted.
DeepSeek-V2/V3 ("deepseek2") files hold MLA's kv_b_proj split in two for llama.cpp's absorbed
attention (attn_k_b: each head's nope rows transposed, [heads, kv_lora_rank, nope]; attn_v_b:
[heads, v_head_dim, kv_lora_rank]), put back together here; older files hold attn_kv_b whole.
Every error names the file and the tensor or metadata key it is about."""

from __future__ import annotations

import os
from typing import Any, Iterator, NamedTuple

import numpy as np
import torch

from engine.errors import EngineError

PERMUTED_ARCHS = ("llama",)
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # DeepSeek-V2/V3 (deepseek2): MLA's projections and the shared experts
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# deepseek2's split kv_b_proj (see the module docstring): llama.cpp's tensor -> which half
KV_B_HALVES = {"attn_k_b": "k", "attn_v_b": "v"}
# deepseek2's noaux_tc correction bias: llama.cpp's name -> ours (HF's, a parameter of the gate)
SCORE_BIAS = ("exp_probs_b", "mlp.gate.e_score_correction_bias")


class MoENames(NamedTuple):
    """Where a sparse layer's GGUF tensors go in HF's names: the router (ffn_gate_inp) and the
    experts, each projection of which the file stacks in one [experts, out, in] tensor
    (ffn_*_exps), loaded as HF's per-expert tensors."""

    router: str
    experts: str
    projections: dict  # llama.cpp's stacked tensor -> HF's projection


MOE_NAMES = {  # general.architecture -> its experts' names (a "llama" file with experts: Mixtral)
    "qwen3moe": MoENames("mlp.gate", "mlp.experts", {
        "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}),
    "llama": MoENames("block_sparse_moe.gate", "block_sparse_moe.experts", {
        "ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
    "deepseek2": MoENames("mlp.gate", "mlp.experts", {
        "ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}),
}
# GGUF block types a registered linear kernel may run as they are (weight_dtype names)
BLOCK_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-frequency rope factors: config, not a weight
TOKENIZER_KEY = "tokenizer.ggml.model"
MISSING = object()


class GGUFError(EngineError):
    pass


def hf_name(name: str, moe: MoENames | None = None) -> str | None:
    """llama.cpp's tensor name -> ours (HF's), or None when it has no counterpart (``moe``:
    the architecture's expert names, for its router)."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    if moe is not None and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and \
            parts[2] == "ffn_gate_inp":
        return f"model.layers.{parts[1]}.{moe.router}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and \
            parts[2] == SCORE_BIAS[0] and suffix == "bias":
        return f"model.layers.{parts[1]}.{SCORE_BIAS[1]}"
    return None


def kv_b_half(name: str) -> tuple[int, str] | None:
    """(layer, "k" or "v") of deepseek2's split kv_b_proj tensor ``name``, else None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and \
            parts[2] in KV_B_HALVES and parts[3] == "weight":
        return int(parts[1]), KV_B_HALVES[parts[2]]
    return None


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads * (nope + v), kv_lora_rank] from llama.cpp's halves: k_b [heads,
    kv_lora_rank, nope] (each head's nope rows transposed), v_b [heads, v, kv_lora_rank]."""
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or \
            k_b.shape[1] != v_b.shape[2]:
        raise GGUFError(f"attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} are not "
                        f"[heads, kv_lora_rank, nope] and [heads, v_head_dim, kv_lora_rank]")
    heads = k_b.shape[0]
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * (k_b.shape[2] +
                                                                          v_b.shape[1]), -1)


def expert_stack(name: str, moe: MoENames | None) -> tuple[int, str] | None:
    """(layer, HF projection) of llama.cpp's stacked expert tensor ``name``, else None."""
    parts = name.split(".")
    if moe is not None and len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and \
            parts[2] in moe.projections and parts[3] == "weight":
        return int(parts[1]), moe.projections[parts[2]]
    return None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q/k rows: within each head it stores the rows as
    (pair, half) where HF stores (half, pair)."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        return w  # not the shape the config implies: the loader's shape check reports it
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_package():
    try:
        import gguf
    except ImportError:  # engine-core depends on it; a broken environment gets told so
        raise EngineError("Reading GGUF files needs the 'gguf' package: pip install gguf") from None
    return gguf


def _reader_class():
    """gguf's GGUFReader, checking each tensor's type and extent as it is read, so that a
    damaged file is reported with the tensor's name (the reader would fail without it)."""
    gguf = gguf_package()

    class Reader(gguf.GGUFReader):
        def _build_tensors(self, start_offs, fields):
            known = {t.value for t in gguf.GGMLQuantizationType}
            for field in fields:
                try:
                    _, name, _, dims, raw_type, offset = field.parts
                    name, raw = bytes(name).decode("utf-8", "replace"), int(raw_type[0])
                except (ValueError, IndexError):  # another layout: let the reader judge
                    continue
                if raw not in known:
                    raise GGUFError(f"tensor '{name}' has quantization type {raw}, which the "
                                    f"gguf package ({_version()}) does not know")
                block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw)]
                end = start_offs + int(offset[0]) + int(np.prod(dims)) * size // block
                if end > len(self.data):
                    raise GGUFError(f"tensor '{name}' ends at byte {end} but the file has "
                                    f"{len(self.data)}: the file is truncated (an interrupted "
                                    f"download or copy?)")
            return super()._build_tensors(start_offs, fields)

    return Reader


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "gguf " + version("gguf")
    except PackageNotFoundError:
        return "gguf"


def can_dequantize(qtype) -> bool:
    gguf = gguf_package()
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    except Exception:  # noqa: BLE001 - a type with another layout (integers): not a weight type
        return False
    return True


class GGUFFile:
    """One GGUF file, opened (its header, metadata and tensor table parsed; data memory-mapped)."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"cannot read '{path}': {e.strerror}.") from None
        if magic != b"GGUF":
            raise EngineError(f"'{path}' is not a GGUF file: it starts with {magic!r}, not the "
                              f"magic bytes b'GGUF'.")
        try:
            self.reader = _reader_class()(path)
        except GGUFError as e:
            raise GGUFError(f"'{path}': {e}.") from None
        except Exception as e:  # noqa: BLE001 - the reader's own errors on a damaged header
            raise GGUFError(
                f"'{path}' could not be read as a GGUF file ({type(e).__name__}: {e}); it is "
                f"truncated or damaged ({os.path.getsize(path)} bytes).") from None
        self.tensor_infos = {t.name: t for t in self.reader.tensors}
        self.arch = self.get("general.architecture")
        # the experts' names where the file has experts (a dense "llama" file: None)
        self.moe = MOE_NAMES.get(self.arch) if self.has(f"{self.arch}.expert_count") else None
        self._check_types()

    # -- metadata --------------------------------------------------------------------------
    def get(self, key: str, default: Any = MISSING) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is MISSING:
                raise GGUFError(f"'{self.path}' lacks the metadata key '{key}', which the model "
                                f"config needs.")
            return default
        return field.contents()

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def _check_types(self) -> None:
        checked: dict = {}
        for t in self.reader.tensors:
            if t.tensor_type not in checked:
                checked[t.tensor_type] = can_dequantize(t.tensor_type)
            loaded = hf_name(t.name, self.moe) is not None or \
                expert_stack(t.name, self.moe) is not None or kv_b_half(t.name) is not None
            if not checked[t.tensor_type] and loaded:
                gguf = gguf_package()
                ok = [q.name for q in gguf.GGMLQuantizationType if can_dequantize(q)]
                raise GGUFError(
                    f"'{self.path}': tensor '{t.name}' has quantization type "
                    f"{t.tensor_type.name}, which {_version()} cannot dequantize (it can: "
                    f"{', '.join(ok)}).")

    def tokenizer_type(self) -> str:
        if not self.has(TOKENIZER_KEY):
            raise GGUFError(f"'{self.path}' carries no tokenizer (no '{TOKENIZER_KEY}' key in its "
                            f"metadata): pass --tokenizer DIR, a directory with the model's "
                            f"tokenizer.json / tokenizer_config.json.")
        return self.get(TOKENIZER_KEY)

    # -- tensors ---------------------------------------------------------------------------
    def array(self, info, expert: int | None = None) -> np.ndarray:
        """The tensor dequantized to float32, in numpy's (row-major, HF) shape (``expert``: only
        that expert's [rows, columns] of a stacked [experts, rows, columns] tensor, so that a
        large model's stack is never dequantized whole)."""
        gguf = gguf_package()
        shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        data = info.data
        if expert is not None:
            if len(shape) != 3 or data.ndim != 3:
                raise GGUFError(f"'{self.path}': tensor '{info.name}' has shape {list(shape)}; "
                                f"stacked experts are [experts, rows, columns]")
            data, shape = data[expert], shape[1:]
        try:
            arr = gguf.quants.dequantize(data, info.tensor_type)
        except Exception as e:  # noqa: BLE001
            raise GGUFError(f"'{self.path}': tensor '{info.name}' ({info.tensor_type.name}) could "
                            f"not be dequantized: {e}") from None
        arr = arr.reshape(shape)
        return arr if arr.flags.writeable and arr.dtype == np.float32 else \
            np.array(arr, dtype=np.float32)

    def blocks(self, name: str, hf: dict) -> tuple[str, torch.Tensor] | None:
        """The 2-D weight our loader knows as ``name`` as the file stores it, when that is a
        block format a linear kernel may run as it is (BLOCK_FORMATS): (format, uint8 tensor
        [rows, bytes per row]), q/k rows unpermuted as ``tensors`` does (a block holds 32
        weights of one row, so moving rows moves whole blocks); None for another type."""
        info = self._infos_by_hf_name().get(name)
        if info is None:  # an expert's slice of a stacked [experts, rows, columns] tensor?
            stacked = self._expert_infos().get(name)
            if stacked is None or BLOCK_FORMATS.get(stacked[0].tensor_type.name) is None:
                return None
            info, e = stacked
            rows = int(info.shape[1])
            data = np.asarray(info.data)
            if data.ndim != 3:
                return None
            raw = torch.from_numpy(np.array(data[e], dtype=np.uint8).reshape(rows, -1))
            return BLOCK_FORMATS[info.tensor_type.name], raw.contiguous()
        if len(info.shape) != 2:
            return None
        fmt = BLOCK_FORMATS.get(info.tensor_type.name)
        if fmt is None:
            return None
        rows = int(info.shape[1])
        raw = torch.from_numpy(np.array(info.data, dtype=np.uint8).reshape(rows, -1))
        return fmt, self._unpermuted(name, raw, hf).contiguous()

    def _expert_name(self, layer: int, expert: int, proj: str) -> str:
        """Our (HF's) name of one expert's projection weight of a stacked tensor."""
        return f"model.layers.{layer}.{self.moe.experts}.{expert}.{proj}.weight"

    def _expert_infos(self) -> dict:
        """Our name of each expert's weight -> (its stacked tensor's info, the expert)."""
        if not hasattr(self, "_by_expert"):
            self._by_expert = {}
            for n, t in self.tensor_infos.items():
                stack = expert_stack(n, self.moe)
                if stack is not None and len(t.shape) == 3:
                    layer, proj = stack
                    for e in range(int(t.shape[-1])):
                        self._by_expert[self._expert_name(layer, e, proj)] = (t, e)
        return self._by_expert

    def _unpermuted(self, name: str, rows: torch.Tensor, hf: dict) -> torch.Tensor:
        """``rows`` of the weight ``name`` with llama.cpp's q/k row permutation undone (for the
        architectures it permutes); any other tensor as it is."""
        if self.arch not in PERMUTED_ARCHS:
            return rows
        heads = {"self_attn.q_proj": hf["num_attention_heads"],
                 "self_attn.k_proj": hf["num_key_value_heads"]}
        proj = name.rpartition(".")[0].split(".", 3)[-1]
        return unpermute_rows(rows, heads[proj]) if proj in heads else rows

    def block_names(self) -> list[str]:
        """Our names of the 2-D weights stored in a BLOCK_FORMATS type, experts' included
        (each expert's slice of a stacked tensor in one)."""
        return [n for n, t in self._infos_by_hf_name().items()
                if len(t.shape) == 2 and t.tensor_type.name in BLOCK_FORMATS] + \
            [n for n, (t, _) in self._expert_infos().items()
             if t.tensor_type.name in BLOCK_FORMATS]

    def _infos_by_hf_name(self) -> dict:
        if not hasattr(self, "_by_hf"):
            self._by_hf = {hf_name(n, self.moe): t for n, t in self.tensor_infos.items()
                           if hf_name(n, self.moe)}
        return self._by_hf

    def label(self, name: str) -> str:
        """How an error names the tensor our loader knows as ``name``."""
        info = self._infos_by_hf_name().get(name)
        original = info.name if info is not None else name
        return f"'{original}' of {self.path}" + (f" (loaded as '{name}')" if original != name
                                                  else "")

    def tensors(self, dtype: torch.dtype, hf: dict, keep=None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(our name, tensor in ``dtype``) for every weight; unknown names are passed through for
        the loader to refuse. ``keep``: only the names it accepts, the others not dequantized."""
        halves: dict[int, dict[str, torch.Tensor]] = {}
        for info in self.reader.tensors:
            if info.name == ROPE_FREQS:
                continue  # read into the config's rope_scaling
            half = kv_b_half(info.name)
            if half is not None:  # deepseek2's kv_b_proj in two: whole once both are read
                layer, which = half
                name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
                if keep is not None and not keep(name):
                    continue
                halves.setdefault(layer, {})[which] = torch.from_numpy(self.array(info))
                if len(halves[layer]) == 2:
                    kv = halves.pop(layer)
                    try:
                        yield name, join_kv_b(kv["k"], kv["v"]).to(dtype).contiguous()
                    except GGUFError as e:
                        raise GGUFError(f"'{self.path}', layer {layer}: {e}.") from None
                continue
            stack = expert_stack(info.name, self.moe)
            if stack is not None:  # one tensor per expert, as HF checkpoints hold them
                yield from self._experts(info, *stack, dtype, keep)
                continue
            name = hf_name(info.name, self.moe) or info.name
            if keep is not None and not keep(name):
                continue
            tensor = self._unpermuted(name, torch.from_numpy(self.array(info)), hf)
            yield name, tensor.to(dtype).contiguous()
        if halves:
            layer, kv = next(iter(halves.items()))
            raise GGUFError(f"'{self.path}': layer {layer} has blk.{layer}.attn_"
                            f"{next(iter(kv))}_b.weight but not its other half of kv_b_proj")

    def _experts(self, info, layer: int, proj: str, dtype: torch.dtype, keep
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stacked tensor ``info`` as its experts' weights, each dequantized on its own
        (only those ``keep`` accepts)."""
        names = [self._expert_name(layer, e, proj) for e in range(int(info.shape[-1]))]
        for e, name in enumerate(names):
            if keep is None or keep(name):
                yield name, torch.from_numpy(self.array(info, e)).to(dtype).contiguous()
