"""The plain KV-cache dtypes: auto (the model's dtype), bf16, fp16, fp32."""

import torch

from engine.hookspecs import hookimpl
from engine.interfaces import KVDtype


@hookimpl
def register_kv_cache_dtypes(register):
    register("auto", KVDtype(None, description="same dtype as the model"))
    register("bf16", KVDtype(torch.bfloat16, description="bfloat16"))
    register("fp16", KVDtype(torch.float16, description="float16"))
    register("fp32", KVDtype(torch.float32, description="float32"))
