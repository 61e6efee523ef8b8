"""What the kernels take, known without importing them: the registration (the package's
__init__) and the backends both read it."""

HALF = ("float16", "bfloat16")  # the model dtypes the kernels take (auto skips float32 models)
TRTLLM_PAGE_SIZES = (16, 32, 64)  # what trtllm-gen's paged kernels take
TRTLLM_MLA_PAGE_SIZES = (32, 64)  # what trtllm-gen's MLA decode takes (SGLang's check)
