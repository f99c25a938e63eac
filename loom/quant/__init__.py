"""Weight quantization: configs and methods (the seam of loom.model.layers.linear), loom's packed layouts,
GGUF repacking and round-to-nearest quantizers. See loom/quant/config.py for the methods."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# the methods of `loom quantize` (loom/quant/quantize.py), here so that the CLI can list and check them without
# importing torch
QUANTIZE_METHODS = ("smoothquant", "w8a8", "rtn", "gptq", "awq", "fp8", "sparse24")

# quantize()'s method-specific options -> the methods that read them (any other method refuses them)
METHOD_OPTIONS = {
    "alpha": ("smoothquant", "w8a8"), "activation_scales": ("w8a8",), "weight_rounding": ("smoothquant", "w8a8", "awq"),
    "bits": ("rtn", "gptq", "awq"), "group_size": ("rtn", "gptq", "awq"), "sym": ("rtn", "gptq"),
    "desc_act": ("gptq", "awq"), "static_groups": ("gptq",), "damp_percent": ("gptq", "awq"), "awq_clip": ("awq",),
    "awq_scaling": ("awq",), "awq_loss": ("awq",),
    "target_bits": ("rtn", "gptq", "awq"), "dynamic": ("rtn", "gptq"), "sensitivity_windows": ("rtn", "gptq", "awq"),
    "prune_score": ("sparse24",), "lm_head_bits": ("rtn", "gptq", "awq"),
}


def check_method_options(method: str, given: dict[str, Any]) -> None:
    """Refuse an unknown method, or an option (METHOD_OPTIONS; None = not given) given to a method that does not
    read it.

    Raises:
        ValueError: naming the method, or the option and the methods it applies to.
    """
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"method must be one of {list(QUANTIZE_METHODS)}, got {method!r}")
    for name, value in given.items():
        methods = METHOD_OPTIONS[name]
        if value is not None and method not in methods:
            names = [repr(m) for m in methods]
            applies = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            raise ValueError(f"{name} applies to method{'s' if len(methods) > 1 else ''} {applies}, not {method!r}")


def check_output_path(output: str) -> Path:
    """`output` as the directory a quantized checkpoint may be written to (not created here).

    Raises:
        ValueError: an empty path, a file, or a directory with files in it.
    """
    if not str(output).strip():
        raise ValueError("output must be a directory path, got an empty one")
    out = Path(output).expanduser()
    if out.exists() and not out.is_dir():
        raise ValueError(f"output {str(out)!r} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()):
        names = sorted(p.name for p in out.iterdir())
        hidden = all(n.startswith(".") for n in names)
        raise ValueError(f"output {str(out)!r} is a directory that is not empty" + (
            f" (it holds only hidden files, {', '.join(names[:3])}: perhaps an interrupted write; remove them "
            "to retry)" if hidden else ""))
    return out
