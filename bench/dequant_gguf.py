#!/usr/bin/env python3
"""Writes a copy of a GGUF model with every tensor dequantised to F32 (gguf-py's decoders,
ggml's arithmetic): the same weights, so that llama.cpp evaluates them without quantising its
activations (its quantised dot products round the activations to 8 bits first). Metadata is
copied as it is, general.file_type set to ALL_F32. bench/llama_oracle.py uses it for the
record's f32 reference.

usage: python3 bench/dequant_gguf.py IN.gguf OUT.gguf"""
import sys

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    src, dst = sys.argv[1:]
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(dst, arch, use_temp_file=True)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name == "general.file_type":
            w.add_key_value(name, 0, GGUFValueType.UINT32)  # LLAMA_FTYPE_ALL_F32
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = t.data if t.tensor_type == GGMLQuantizationType.F32 else \
            dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # gguf lists the fastest dimension first
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
