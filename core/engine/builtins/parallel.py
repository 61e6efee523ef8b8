"""Parallel strategies: one process ("none"), and tensor parallelism over torch.distributed
with the gloo (CPU) or nccl (CUDA) backend. A plugin may register another torch.distributed
backend the same way (a TorchDistributed with its name)."""

from datetime import timedelta

from engine.hookspecs import hookimpl
from engine.interfaces import ParallelStrategy
from engine.registry import EngineError


class SingleProcess(ParallelStrategy):
    def launch(self, config):
        return None


class TorchDistributed(ParallelStrategy):
    """Tensor parallelism whose ranks talk through torch.distributed's ``backend``. The model
    side is implemented (engine.parallel: ``init_group`` then ``load_model(..., tp=group)``);
    the engine does not start the workers yet, so ``launch`` refuses (config.py already
    refuses ``--tp-size`` above 1 before it is reached)."""

    def __init__(self, backend: str, device_type: str):
        self.backend, self.device_type = backend, device_type

    def launch(self, config):
        raise EngineError(f"the '{self.backend}' tensor-parallel strategy cannot be launched by "
                          f"the engine yet: the scheduler does not drive tp workers; serve "
                          f"with --tp-size 1.")

    def init_group(self, rank: int, size: int, init_method: str,
                   timeout: timedelta = timedelta(seconds=600)):
        """Join the tp group of ``size`` ranks as ``rank``; returns its TPGroup."""
        from engine.parallel.group import init_tp_group

        return init_tp_group(self.backend, rank, size, init_method, timeout)


@hookimpl
def register_parallel_strategies(register):
    register("none", SingleProcess())
    register("gloo", TorchDistributed("gloo", "cpu"))
    register("nccl", TorchDistributed("nccl", "cuda"))
