"""Weight quantization: configs and methods (the seam of loom.model.layers.linear), loom's packed layouts,
GGUF repacking and round-to-nearest quantizers. See loom/quant/config.py for the methods."""

# the methods of `loom quantize` (loom/quant/quantize.py), here so that the CLI can list them without importing torch
QUANTIZE_METHODS = ("smoothquant", "w8a8", "rtn", "gptq", "awq", "fp8", "sparse24")
