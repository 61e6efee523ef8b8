"""Single-process execution, the only parallel strategy so far."""

from engine.hookspecs import hookimpl
from engine.interfaces import ParallelStrategy


class SingleProcess(ParallelStrategy):
    def launch(self, config):
        return None


@hookimpl
def register_parallel_strategies(register):
    register("none", SingleProcess())
