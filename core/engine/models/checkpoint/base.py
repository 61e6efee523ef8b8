"""What every checkpoint format gives the loader: an HF config dict, tensors under HF names (a
pipeline stage's only, when asked), a tokenizer, and notes on how it was read for the start log."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

Keep = Callable[[str], bool]  # which tensors (by HF name) a reader reads; the rest it skips


class Checkpoint:
    format = ""
    path = ""           # the directory or file read
    config_source = ""  # how errors name the config
    mismatch_hint = ""  # what a wrong tensor suggests
    hf_config: dict

    def __init__(self) -> None:
        self.notes: list[str] = []  # how it was read (cache used, conversion time): for the log

    def tensors(self, dtype: torch.dtype, keep: Keep | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every weight; ``keep``: only those whose name it accepts, the
        others never read (a pipeline stage's)."""
        raise NotImplementedError

    def label(self, name: str) -> str:
        return f"'{name}'"

    def blocks(self, name: str) -> tuple[str, torch.Tensor] | None:
        """A weight kept in a quantized block format a linear kernel may run as it is (a
        GGUF's Q4_1, ...): (format, raw bytes [rows, bytes per row]); None: only ``tensors``."""
        return None

    def block_formats(self) -> set[str]:
        """The block formats of every weight ``blocks`` gives ({"q8_0"}, ...); empty: none."""
        return set()

    def load_tokenizer(self):
        raise NotImplementedError


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
