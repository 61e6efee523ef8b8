"""The built-in attention backend: plain torch, runs everywhere."""

from engine.hookspecs import hookimpl


def _factory(ctx):
    from engine.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(ctx)


@hookimpl
def register_attention_backends(register):
    # "any": K/V are read through the pool, which dequantizes scaled (fp8) storage on read
    register("torch_native", _factory, kv_dtypes="any", priority=0, mla=True,
             description="plain torch SDPA over the paged pool (and MLA's latent rows); "
                         "any device")
