"""The CUDA-graph stand-in the CPU tests capture with: ``ModelRunner.init_cuda_graphs(sizes,
graph_cls=EagerGraph)`` gets the graph runner's fixed buffers and padding, the forward re-run
at each replay."""

from __future__ import annotations


class EagerGraph:
    """torch.cuda.CUDAGraph's interface without a GPU: "capture" remembers the function and
    "replay" runs it again, writing into the output captured the first time (CPU tests)."""

    def __init__(self):
        self.fn = None
        self.out = None

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())
