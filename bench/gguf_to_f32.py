"""Writes a copy of a GGUF with every tensor dequantized to F32 (metadata kept), with the `gguf`
package of the peer's source tree (gguf-py). For fidelity checks: llama.cpp and llmq on the same
exact weights (F32 activations on both sides) isolate modelling differences from quantization.

    .venv/bin/python bench/gguf_to_f32.py IN.gguf OUT.gguf
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent /
                       "build-peer/llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py"))
import numpy as np  # noqa: E402
import gguf  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

src, dst = sys.argv[1], sys.argv[2]
r = gguf.GGUFReader(src)
arch = r.fields["general.architecture"].contents()
w = gguf.GGUFWriter(dst, arch)
for f in r.fields.values():
    if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
        continue
    t = f.types[0]
    sub = f.types[-1] if t == gguf.GGUFValueType.ARRAY else None
    if f.name == "general.file_type":
        w.add_key_value(f.name, 0, t)  # ALL_F32
        continue
    w.add_key_value(f.name, f.contents(), t, sub_type=sub)
data = {}
for t in r.tensors:
    a = dequantize(t.data, t.tensor_type).astype(np.float32)
    shape = [int(x) for x in reversed(t.shape)]  # numpy order: outermost first
    data[t.name] = a.reshape(shape)
    w.add_tensor_info(t.name, data[t.name].shape, data[t.name].dtype, data[t.name].nbytes, gguf.GGMLQuantizationType.F32)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_ti_data_to_file()
for t in r.tensors:
    w.write_tensor_data(data[t.name])
w.close()
