"""KVDtype: how the KV cache is stored, below the pool that stores through it (plugins subclass
it as ``engine.interfaces.KVDtype``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVDtype:
    """How the KV cache is stored: the pool writes through :meth:`store` and reads through
    :meth:`load`, so a plugin adds a KV format by subclassing this and overriding them.

    ``storage`` is the torch dtype of the pool, or None for "the model's dtype" (``auto``).
    ``needs_scale`` says that values are stored scaled: the pool keeps a per-layer K and a V
    scale (1.0, or the checkpoint's ``k_scale`` / ``v_scale``), and stored ≈ value / scale.
    Backends that read the pool's buffers directly (fused kernels) rely on exactly that rule
    and pass the scales to their kernels; ``torch_native`` reads through :meth:`load`.

    The defaults: plain storage is a cast each way; scaled storage divides by the scale,
    clamps to the storage dtype's finite range (a cast past it gives inf or NaN) and casts on
    store, and casts and multiplies by the scale on load.
    """

    storage: Any = None
    needs_scale: bool = False
    description: str = ""

    def store(self, values: torch.Tensor, scale: float, storage: torch.dtype) -> torch.Tensor:
        """K or V values (the model's dtype) -> the tensor the pool keeps, in ``storage`` (the
        pool's dtype: ``self.storage``, or the model's dtype for ``auto``)."""
        if not self.needs_scale:
            return values.to(storage)
        values = values / scale
        if storage.is_floating_point:
            import torch

            fmax = torch.finfo(storage).max
            values = values.clamp(-fmax, fmax)
        return values.to(storage)

    def load(self, stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Stored K or V (gathered from the pool) -> values in ``dtype``."""
        values = stored.to(dtype)
        return values * scale if self.needs_scale else values
