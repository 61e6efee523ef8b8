"""The built-in attention backend: plain torch, runs everywhere."""

from engine.hookspecs import hookimpl


def _factory(ctx):
    from engine.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(ctx)


@hookimpl
def register_attention_backends(register):
    register("torch_native", _factory, kv_dtypes=("auto", "bf16", "fp16", "fp32"), priority=0,
             description="plain torch SDPA over the paged pool; any device")
