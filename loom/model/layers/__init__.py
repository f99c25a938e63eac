"""Building blocks of the decoder models: linear, rotary, norm, embedding, attention."""

from loom.model.layers.attention import PagedAttention
from loom.model.layers.embedding import LMHead, VocabEmbedding
from loom.model.layers.linear import Linear, LinearMethod, LinearShard, MergedLinear, UnquantizedLinearMethod
from loom.model.layers.norm import RMSNorm
from loom.model.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq

__all__ = [
    "LMHead",
    "Linear",
    "LinearMethod",
    "LinearShard",
    "MergedLinear",
    "PagedAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "UnquantizedLinearMethod",
    "VocabEmbedding",
    "apply_rotary",
    "rope_inv_freq",
]
