"""Write a copy of a GGUF file that keeps only its first L transformer blocks, every tensor in its own
quantized type, byte for byte, and every metadata field but the block count.

Why: the device machine receives at most 64 MiB of working tree, and the bundled SmolLM2-135M Q4_1 GGUF is
98 MB. Its first 8 blocks plus the embedding (about 50 MB) are still a real model in the file's own types,
enough for benchmarks/gpu_check.py to compare the packed path with the dequantized one on real weights.

    python benchmarks/gguf_truncate.py OUT.gguf --layers 8 [--model IN.gguf]
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import numpy as np


def truncate(src: Path, dst: Path, layers: int) -> int:
    """Copy `src` to `dst` with blocks >= `layers` left out; returns the number of tensors written.

    Raises:
        ValueError: `layers` is not in [1, the file's block count].
    """
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= layers <= total:
        raise ValueError(f"layers must be in [1, {total}], got {layers}")
    writer = gguf.GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header's own fields; the writer sets the architecture
        value = layers if key == count_key else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    kept = 0
    for tensor in reader.tensors:
        match = re.match(r"blk\.(\d+)\.", tensor.name)
        if match and int(match.group(1)) >= layers:
            continue
        raw = np.asarray(tensor.data)
        # the reader's data is the raw block bytes for a quantized type (shape [rows, bytes per row]) and the
        # values for F32/F16; the writer takes either with raw_dtype naming the type
        writer.add_tensor(tensor.name, raw, raw_shape=raw.shape, raw_dtype=tensor.tensor_type)
        kept += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return kept


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--model", type=Path, default=None, help="source GGUF (default: the bundled SmolLM2)")
    ns = parser.parse_args()
    if ns.model is None:
        from loom.model.loader.default import default_model_path
        ns.model = default_model_path()
    kept = truncate(ns.model, ns.out, ns.layers)
    print(f"{ns.out}: {kept} tensors, {ns.out.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
