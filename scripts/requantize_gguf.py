"""Write a GGUF's weights in another type (F32, F16, Q8_0, Q4_0, Q4_1): the same metadata and
tokenizer, every 2-D tensor dequantized and re-encoded with gguf-py (llama.cpp's reference
quantizers), 1-D tensors (norms) kept. For serving comparisons on the same weights when
llama.cpp's llama-quantize is not built, e.g. the default model's Q4_1 file as F16 or Q8_0:

    python scripts/requantize_gguf.py IN.gguf OUT.gguf F16
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("qtype", choices=["F32", "F16", "Q8_0", "Q4_0", "Q4_1"])
    args = ap.parse_args(argv)
    import gguf

    reader = gguf.GGUFReader(args.src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(args.dst, arch)
    target = gguf.GGMLQuantizationType[args.qtype]
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            kind = {"F32": "ALL_F32", "F16": "MOSTLY_F16"}.get(args.qtype, f"MOSTLY_{args.qtype}")
            writer.add_file_type(int(gguf.LlamaFileType[kind]))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        data = np.asarray(data, dtype=np.float32).reshape(shape)
        if data.ndim != 2 or target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(t.name, data)
        elif target == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(t.name, data.astype(np.float16))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, target), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(args.dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
