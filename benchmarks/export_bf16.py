"""Write the bundled GGUF model as a bfloat16 Hugging Face checkpoint (the issue 9 bf16 target's input).

transformers dequantizes the GGUF blocks to float32; the weights are then rounded to bfloat16 and saved as
safetensors with the tokenizer, so the directory loads as any bf16 checkpoint does.

    .venv/bin/python benchmarks/export_bf16.py /tmp/smollm2-bf16

transformers needs `accelerate` to read a GGUF file: it comes with the test extra (`pip install -e '.[test]'`).
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loom.model.loader import default_model_path


def main(out: str) -> None:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        sys.exit("export_bf16: transformers needs `accelerate` to read a GGUF file: pip install accelerate "
                 "(or the test extra, pip install -e '.[test]')")
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # transformers will not save a model it loaded from GGUF
        del config.quantization_config
    fresh = type(model)(config)
    fresh.load_state_dict(model.state_dict())
    fresh.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/smollm2-bf16")
