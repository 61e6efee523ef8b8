"""GGUF files (llama.cpp's format) read with the ``gguf`` package: the model config from the
metadata (as an HF config.json dict), and the tensors dequantized, renamed to the HF names our
models load, with llama.cpp's Q/K rotary permutation undone.

llama.cpp's converter permutes the rows of q_proj and k_proj of "llama" models (its rope rotates
adjacent pairs; HF's rotates the two halves of a head); Qwen2/Qwen3 are converted unpermuted.
Every error names the file and the tensor or metadata key it is about."""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import torch

from engine.registry import EngineError

# general.architecture -> the HF architecture our model registry knows. Mistral's GGUFs say
# "llama" (llama.cpp converts MistralForCausalLM as a Llama, without a sliding window).
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
PERMUTED_ARCHS = ("llama",)
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGUF block types a registered linear kernel may run as they are (weight_dtype names)
BLOCK_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's per-frequency rope factors: config, not a weight
TOKENIZER_KEY = "tokenizer.ggml.model"
MISSING = object()


class GGUFError(EngineError):
    pass


def hf_name(name: str) -> str | None:
    """llama.cpp's tensor name -> ours (HF's), or None when it has no counterpart."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of q/k rows: within each head it stores the rows as
    (pair, half) where HF stores (half, pair)."""
    rows = w.shape[0]
    if heads <= 0 or rows % (2 * heads):
        return w  # not the shape the config implies: the loader's shape check reports it
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf():
    try:
        import gguf
    except ImportError:  # engine-core depends on it; a broken environment gets told so
        raise EngineError("Reading GGUF files needs the 'gguf' package: pip install gguf") from None
    return gguf


def _reader_class():
    """gguf's GGUFReader, checking each tensor's type and extent as it is read, so that a
    damaged file is reported with the tensor's name (the reader would fail without it)."""
    gguf = _gguf()

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
    gguf = _gguf()
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
            if not checked[t.tensor_type] and hf_name(t.name) is not None:
                gguf = _gguf()
                ok = [q.name for q in gguf.GGMLQuantizationType if can_dequantize(q)]
                raise GGUFError(
                    f"'{self.path}': tensor '{t.name}' has quantization type "
                    f"{t.tensor_type.name}, which {_version()} cannot dequantize (it can: "
                    f"{', '.join(ok)}).")

    def checkpoint_dtype(self) -> str:
        """The dtype the weights were stored in, as config.json would name it: a quantized file
        counts as float16 (its blocks' scales are float16; a CPU computes in float32 anyway)."""
        gguf = _gguf()
        types = {t.tensor_type for t in self.reader.tensors if len(t.shape) > 1}
        Q = gguf.GGMLQuantizationType
        if types <= {Q.F32}:
            return "float32"
        if types <= {Q.F32, Q.BF16}:
            return "bfloat16"
        return "float16"

    def hf_config(self) -> dict:
        """The metadata as an HF config.json dict (what ModelConfig.from_hf reads)."""
        arch = self.arch
        if arch not in ARCHITECTURES:
            raise GGUFError(
                f"Unsupported GGUF architecture '{arch}' (general.architecture in "
                f"'{self.path}'). Supported: {', '.join(ARCHITECTURES)} (the Llama family: "
                f"Llama, Mistral, Qwen2, Qwen3).")
        p = f"{arch}."
        hidden = int(self.get(p + "embedding_length"))
        heads = self._uniform(p + "attention.head_count")
        kv_heads = self._uniform(p + "attention.head_count_kv", heads)
        head_dim = int(self.get(p + "attention.key_length", hidden // heads))
        rope_dim = int(self.get(p + "rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise GGUFError(f"'{self.path}': {p}rope.dimension_count is {rope_dim} but heads have "
                            f"{head_dim} dimensions; partial rotary embeddings are not supported.")
        embed = self.tensor_infos.get("token_embd.weight")
        vocab = self.get(p + "vocab_size", None)
        if vocab is None:
            if embed is None:
                raise GGUFError(f"'{self.path}' has neither {p}vocab_size nor token_embd.weight.")
            vocab = int(embed.shape[-1])
        hf: dict = {
            "architectures": [ARCHITECTURES[arch]],
            "model_type": arch,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "intermediate_size": self._uniform(p + "feed_forward_length"),
            "num_hidden_layers": int(self.get(p + "block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": int(vocab),
            "rms_norm_eps": float(self.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.get(p + "rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.get(p + "context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensor_infos,
            "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in self.tensor_infos,
            "mlp_bias": "blk.0.ffn_up.bias" in self.tensor_infos,
            "torch_dtype": self.checkpoint_dtype(),
            "engine_source": {"format": "gguf", "file": os.path.basename(self.path),
                              "general.name": self.get("general.name", None)},
        }
        rope = self._rope_scaling(p, head_dim)
        if rope is not None:
            hf["rope_scaling"] = rope
        for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
            value = self.get(f"tokenizer.ggml.{key}", None)
            if value is not None:
                hf[hf_key] = int(value)
        eot = self.get("tokenizer.ggml.eot_token_id", None)  # llama.cpp stops on it too
        if eot is not None and eot != hf.get("eos_token_id"):
            hf["eos_token_id"] = [x for x in (hf.get("eos_token_id"), int(eot)) if x is not None]
        return hf

    def _uniform(self, key: str, default: Any = MISSING) -> int:
        value = self.get(key, default)
        if isinstance(value, list):  # per-layer values: we support only uniform ones
            if len(set(value)) != 1:
                raise GGUFError(f"'{self.path}': {key} differs between layers ({value[:8]}...); "
                                f"only uniform layers are supported.")
            value = value[0]
        return int(value)

    def _rope_scaling(self, p: str, head_dim: int) -> dict | None:
        kind = self.get(p + "rope.scaling.type", "none")
        if ROPE_FREQS in self.tensor_infos:  # Llama 3.1 ships its factors as a tensor
            factors = self._array(self.tensor_infos[ROPE_FREQS]).reshape(-1)
            if len(factors) != head_dim // 2:
                raise GGUFError(f"'{self.path}': tensor '{ROPE_FREQS}' has {len(factors)} "
                                f"values; heads of {head_dim} dimensions need {head_dim // 2}.")
            return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
        if kind in ("none", None):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.get(p + "rope.scaling.factor"))}
        raise GGUFError(f"'{self.path}': {p}rope.scaling.type '{kind}' is not supported "
                        f"(supported: none, linear, and Llama 3's {ROPE_FREQS}).")

    def tokenizer_type(self) -> str:
        if not self.has(TOKENIZER_KEY):
            raise GGUFError(f"'{self.path}' carries no tokenizer (no '{TOKENIZER_KEY}' key in its "
                            f"metadata): pass --tokenizer DIR, a directory with the model's "
                            f"tokenizer.json / tokenizer_config.json.")
        return self.get(TOKENIZER_KEY)

    # -- tensors ---------------------------------------------------------------------------
    def _array(self, info) -> np.ndarray:
        """The tensor dequantized to float32, in numpy's (row-major, HF) shape."""
        gguf = _gguf()
        try:
            arr = gguf.quants.dequantize(info.data, info.tensor_type)
        except Exception as e:  # noqa: BLE001
            raise GGUFError(f"'{self.path}': tensor '{info.name}' ({info.tensor_type.name}) could "
                            f"not be dequantized: {e}") from None
        shape = tuple(int(d) for d in reversed(info.shape.tolist()))
        arr = arr.reshape(shape)
        return arr if arr.flags.writeable and arr.dtype == np.float32 else \
            np.array(arr, dtype=np.float32)

    def blocks(self, name: str, hf: dict) -> tuple[str, torch.Tensor] | None:
        """The 2-D weight our loader knows as ``name`` as the file stores it, when that is a
        block format a linear kernel may run as it is (BLOCK_FORMATS): (format, uint8 tensor
        [rows, bytes per row]), q/k rows unpermuted as ``tensors`` does (a block holds 32
        weights of one row, so moving rows moves whole blocks); None for another type."""
        info = self._infos_by_hf_name().get(name)
        if info is None or len(info.shape) != 2:
            return None
        fmt = BLOCK_FORMATS.get(info.tensor_type.name)
        if fmt is None:
            return None
        rows = int(info.shape[1])
        raw = torch.from_numpy(np.array(info.data, dtype=np.uint8).reshape(rows, -1))
        return fmt, self._unpermuted(name, raw, hf).contiguous()

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
        """Our names of the 2-D weights stored in a BLOCK_FORMATS type."""
        return [n for n, t in self._infos_by_hf_name().items()
                if len(t.shape) == 2 and t.tensor_type.name in BLOCK_FORMATS]

    def _infos_by_hf_name(self) -> dict:
        if not hasattr(self, "_by_hf"):
            self._by_hf = {hf_name(n): t for n, t in self.tensor_infos.items() if hf_name(n)}
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
        for info in self.reader.tensors:
            if info.name == ROPE_FREQS:
                continue  # read into the config's rope_scaling
            name = hf_name(info.name) or info.name
            if keep is not None and not keep(name):
                continue
            tensor = self._unpermuted(name, torch.from_numpy(self._array(info)), hf)
            yield name, tensor.to(dtype).contiguous()
