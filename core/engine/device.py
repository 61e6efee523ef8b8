"""What the engine runs on: kind, name, compute capability, memory."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" or "cuda"
    name: str
    capability: tuple[int, int] | None = None  # CUDA compute capability
    total_memory: int = 0  # bytes
    available_memory: int = 0  # bytes free at start
    native_bf16: bool = False  # bf16 matmuls run at full speed

    @property
    def is_cuda(self) -> bool:
        return self.type == "cuda"

    def describe(self) -> str:
        if self.capability:
            return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"
        return self.name

    @property
    def torch_device(self) -> str:
        return "cuda" if self.is_cuda else "cpu"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _meminfo(key: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_now(device: DeviceInfo) -> int:
    """Bytes free on ``device`` now: the GPU's (CUDA's own count), or the RAM the OS says is
    available."""
    if device.is_cuda:
        import torch

        return torch.cuda.mem_get_info(0)[0]
    return _meminfo("MemAvailable")


def cpu_device() -> DeviceInfo:
    flags = _cpu_flags()
    bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})
    name = f"CPU ({os.cpu_count()} cores, {'native bf16' if bf16 else 'no native bf16'})"
    return DeviceInfo("cpu", name, None, _meminfo("MemTotal"), _meminfo("MemAvailable"), bf16)


def detect_device(kind: str = "auto") -> DeviceInfo:
    """``kind``: auto (CUDA when present), cuda, or cpu."""
    if kind == "cpu":
        return cpu_device()
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        return DeviceInfo("cuda", props.name, (props.major, props.minor), total, free,
                          props.major >= 8)
    if kind == "cuda":
        from engine.errors import EngineError

        raise EngineError("--device cuda was asked for, but torch sees no CUDA GPU here.")
    return cpu_device()
