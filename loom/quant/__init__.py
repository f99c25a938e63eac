"""Weight quantization: configs and methods (the seam of loom.model.layers.linear), loom's packed layouts,
GGUF repacking and round-to-nearest quantizers. See loom/quant/config.py for the methods."""
