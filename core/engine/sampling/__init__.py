from engine.sampling.batch import SamplingBatch
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.params import SamplingParams, SamplingParamsError
from engine.sampling.sampler import SampleOutput, Sampler
from engine.sampling.state import SamplingState
from engine.sampling.stop import find_stop, partial_stop_len, token_stop_reason

__all__ = [
    "IncrementalDetokenizer",
    "SampleOutput",
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "SamplingParamsError",
    "SamplingState",
    "find_stop",
    "partial_stop_len",
    "token_stop_reason",
]
