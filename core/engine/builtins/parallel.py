"""Parallel strategies: the torch.distributed backends the tp/pp ranks talk through, gloo on
CPU and nccl on CUDA (engine/ranks). A plugin may register another torch.distributed
backend the same way (a TorchDistributed with its name and device type)."""

from engine.hookspecs import hookimpl
from engine.interfaces import ParallelStrategy


class TorchDistributed(ParallelStrategy):
    def __init__(self, backend: str, device_type: str):
        self.backend, self.device_type = backend, device_type

    def init_rank(self, rank: int, world_size: int, store, timeout_s: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))


def _nccl_check(device) -> str | None:
    import torch.distributed as dist

    if not device.is_cuda:
        return "needs CUDA GPUs (use gloo on a CPU)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    return None


def _gloo_check(device) -> str | None:
    import torch.distributed as dist

    return None if dist.is_gloo_available() else "this torch build has no gloo"


@hookimpl
def register_parallel_strategies(register):
    register("gloo", TorchDistributed("gloo", "cpu"), check=_gloo_check)
    register("nccl", TorchDistributed("nccl", "cuda"), check=_nccl_check)
