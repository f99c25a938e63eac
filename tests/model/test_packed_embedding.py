"""A packed embedding table's lookups: the rows of the matrix the layout defines, in the model dtype."""

from __future__ import annotations

import pytest
import torch

from loom.model.layers.embedding import VocabEmbedding
from loom.quant.layout import dequantize
from loom.quant.rtn import quantize_q4g32, quantize_q8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["q8g", "q4g"])
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


@pytest.mark.parametrize("layout", ["q8g", "q4g"])
def test_lookup_from_an_interleaved_table_is_the_same(layout: str) -> None:
    """A table interleaved 16 rows at a time (a tied LM head's, on avx512_vnni) gives the same rows."""
    from loom.quant.layout import interleave_rows16

    table = torch.randn(320, 64, generator=torch.Generator().manual_seed(1))
    packed = quantize_q8(table, 32) if layout == "q8g" else quantize_q4g32(table)
    emb = VocabEmbedding(320, 64, torch.float32, torch.device("cpu"), packed=True)
    emb.load("weight", interleave_rows16(packed))
    ids = torch.tensor([0, 319, 17, 17, 150])
    assert torch.equal(emb(ids), dequantize(packed.rows(ids)))
    # ids of any shape, as F.embedding takes them (int32 too), give rows of that shape
    grid = torch.tensor([[3, 300], [319, 3]], dtype=torch.int32)
    got = emb(grid)
    assert got.shape == (2, 2, 64) and torch.equal(got.view(4, 64), dequantize(packed.rows(grid.flatten().long())))
    with pytest.raises(ValueError, match="ids must lie in"):
        emb(torch.tensor([320]))


def test_the_bundled_models_tied_head_and_embedding_hold_one_matrix() -> None:
    """SmolLM2's Q8_0 table serves the embedding and the tied LM head; where the head is interleaved at load the
    embedding reads the head's copy instead of keeping its own (one 28 MB matrix, not two)."""
    from loom.model.loader import default_model_path, load_model
    from loom.quant.layout import INTERLEAVED

    loaded = load_model(default_model_path(), torch.float32, torch.device("cpu"))
    head, embed = loaded.model.lm_head, loaded.model.model.embed_tokens
    if head.packed[0].layout in INTERLEAVED:
        assert embed.packed is head.packed[0]
    else:
        assert embed.packed.layout == head.packed[0].layout == "q8g"
    ids = torch.tensor([1, 2, 49151, 500])
    assert torch.equal(embed(ids), dequantize(head.packed[0].rows(ids)))
