"""A packed embedding table's lookups: the rows of the matrix the layout defines, in the model dtype."""

from __future__ import annotations

import pytest
import torch

from loom.model.layers.embedding import VocabEmbedding
from loom.quant.layout import dequantize
from loom.quant.rtn import quantize_q4g32, quantize_q8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["q8g", "q4g32"])
def test_packed_lookup_is_the_layouts_rows_bit_for_bit(dtype: torch.dtype, layout: str) -> None:
    table = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    packed = quantize_q8(table, 32) if layout == "q8g" else quantize_q4g32(table)
    emb = VocabEmbedding(300, 64, dtype, torch.device("cpu"), packed=True)
    emb.load("weight", packed)
    ids = torch.tensor([0, 299, 7, 7, 150])
    got = emb(ids)
    assert got.dtype == dtype
    assert torch.equal(got, dequantize(packed.rows(ids), dtype))
    assert emb(ids[:0]).shape == (0, 64)
