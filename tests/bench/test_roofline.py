"""Roofline formulas on hand-computed numbers for SmolLM2-135M (L=30, H=9, H_kv=3, d_h=64, d=576)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loom.bench.analyze import MeasuredFigures, Workload, efficiencies, floor_summary, to_json
from loom.bench.model_arch import ModelArch, load_model_arch
from loom.bench.probe import MachineSpec
from loom.bench.roofline import Roofline

SMOL_PARAMS = 134_515_008  # = sum of n_elements over the 272 tensors of the bundled GGUF


def smol() -> ModelArch:
    return ModelArch(name="smol", num_layers=30, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                     max_position_embeddings=8192)


MACHINE = MachineSpec(bandwidth=10e9, flops=100e9, dtype="float32", threads=2, source="given")


def test_param_count_matches_hand_formula() -> None:
    per_layer = 576 * 576 * 2 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576
    assert smol().num_params == 49152 * 576 + 30 * per_layer + 576 == SMOL_PARAMS


def test_untied_counts_lm_head_but_not_lookup() -> None:
    arch = ModelArch(name="u", num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=1, head_dim=2,
                     intermediate_size=8, vocab_size=10, tie_word_embeddings=False, max_position_embeddings=16)
    # embed 40 + lm_head 40 + layer (q 16 + o 16 + k,v 2*8 + mlp 96 + norms 8) + final norm 4
    assert arch.num_params == 40 + 40 + 152 + 4
    assert arch.num_decode_params == arch.num_params - 40


def test_gguf_metadata_of_bundled_model() -> None:
    arch = load_model_arch(None)
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 576, 9, 3, 64)
    assert (arch.intermediate_size, arch.vocab_size, arch.tie_word_embeddings) == (1536, 49152, True)
    assert arch.num_params == SMOL_PARAMS
    assert arch.stored_weight_bytes is not None and 0 < arch.stored_weight_bytes < 98_362_432


def test_hf_config_dir(tmp_path: Path) -> None:
    cfg = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_arch(tmp_path).num_params == SMOL_PARAMS
    with pytest.raises(ValueError, match="model"):
        load_model_arch(tmp_path / "nothing")


def test_kv_bytes_and_capacity() -> None:
    fp32 = Roofline.build(smol(), MACHINE, "float32", "float32")
    assert fp32.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert Roofline.build(smol(), MACHINE, "bfloat16", "bfloat16").kv_bytes_per_token == 23040
    assert fp32.kv_capacity_tokens(1 << 30) == 23301  # 46080·23301 = 1,073,710,080 <= 2^30 < 46080·23302
    assert fp32.kv_capacity_tokens(1 << 30, block_size=16) == 1456 * 16


def test_decode_floor_memory_bound_then_compute_bound() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    assert roof.weight_bytes == SMOL_PARAMS * 4
    assert roof.decode_step_floor(1, 0) == pytest.approx(SMOL_PARAMS * 4 / 10e9)
    assert roof.decode_bound(1, 0) == "memory"
    # B_sat at C=0 is R·b/2 = (100e9/10e9)·4/2 = 20
    assert roof.saturation_batch(0) == pytest.approx(20.0)
    assert roof.decode_bound(19, 0) == "memory" and roof.decode_bound(21, 0) == "compute"
    # B=4, C=1000: bytes = 4P + 4·1000·46080; FLOP = 2·P·4 + 4·30·576·4·1000
    mem = (SMOL_PARAMS * 4 + 4 * 1000 * 46080) / 10e9
    comp = (2 * SMOL_PARAMS * 4 + 4 * 30 * 576 * 4 * 1000) / 100e9
    assert roof.decode_step_floor(4, 1000) == pytest.approx(max(mem, comp))
    assert roof.single_stream_ceiling(0) == pytest.approx(10e9 / (SMOL_PARAMS * 4))


def test_saturation_never_when_kv_reads_dominate() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    # per context token: attention 4·L·H·d_h = 69120 FLOP vs kv 46080 B · R(=10) = 460800 FLOP-equivalents
    assert math.isinf(roof.saturation_batch(100_000))


def test_prefill_floor() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    flops = 2 * SMOL_PARAMS * 512 + 2 * 30 * 576 * 512**2
    assert roof.prefill_floor(512) == pytest.approx(flops / 100e9)
    with pytest.raises(ValueError, match="num_tokens"):
        roof.prefill_floor(0)


def test_bad_dtype_and_machine() -> None:
    with pytest.raises(ValueError, match="weight_dtype"):
        Roofline.build(smol(), MACHINE, "float64", "float32")
    with pytest.raises(ValueError, match="kv_dtype"):
        Roofline.build(smol(), MACHINE, "float32", "q4")
    with pytest.raises(ValueError, match="bandwidth"):
        MachineSpec(bandwidth=0, flops=1, dtype="float32", threads=1, source="given")


def test_efficiency_report() -> None:
    roof = Roofline.build(smol(), MACHINE, "float32", "float32")
    work = Workload(batch=1, context=0, prompt_len=512, kv_budget_bytes=1 << 30, max_model_len=2048)
    floor = roof.decode_step_floor(1, 0)
    rows = efficiencies(roof, work, MeasuredFigures(tpot_s=2 * floor, output_tok_s=0.25 / floor))
    by_name = {r.name: r for r in rows}
    assert by_name["TPOT B=1 C=0"].fraction == pytest.approx(0.5)
    assert by_name["achieved bandwidth"].fraction == pytest.approx(0.5)
    assert by_name["output tok/s B=1 C=0"].fraction == pytest.approx(0.25)
    summary = floor_summary(roof, work)
    assert summary["kv_capacity_tokens"] == 23301
    assert json.loads(to_json(summary, rows))["floors"]["params"] == SMOL_PARAMS


def test_sliding_window_layers_read_only_their_window(gemma3_gguf, gemma3_reader) -> None:  # noqa: ANN001
    """Gemma-3-270M as loom reads the real file: 15 of 18 layers slide over 512 tokens, four norms a layer. At
    context 4,096 a query attends to (3 x 4,096 + 15 x 512) / 18 keys per layer on average, so a step reads that
    much KV, not 4,096 tokens' worth; below the window nothing changes."""
    arch = load_model_arch(gemma3_gguf)
    assert (arch.num_sliding_layers, arch.sliding_window, arch.sandwich_norm) == (15, 512, True)
    assert arch.attended_context(4096) == (3 * 4096 + 15 * 512) / 18 and arch.attended_context(300) == 300
    assert arch.attended_pairs(100) == 100 * 100 / 2
    assert arch.attended_pairs(1024) == (3 * 1024**2 / 2 + 15 * (512**2 / 2 + 512 * 512)) / 18
    roof = Roofline.build(arch, MACHINE, "float32", "float16")
    plain = Roofline.build(ModelArch(**{**{f: getattr(arch, f) for f in arch.__dataclass_fields__},
                                        "sliding_window": None, "num_sliding_layers": 0}), MACHINE, "float32",
                           "float16")
    assert roof.decode_bytes(1, 4096) - roof.weight_bytes == pytest.approx(
        (plain.decode_bytes(1, 4096) - plain.weight_bytes) * (3 * 4096 + 15 * 512) / (18 * 4096))
    assert roof.decode_bytes(4, 300) == plain.decode_bytes(4, 300)
    # the four norms a layer (and the QK-norms) counted: the parameters are the file's, element for element (the
    # session's parse of the file, a gguf.GGUFReader)
    assert arch.num_params == sum(int(t.n_elements) for t in gemma3_reader.tensors) == 268_098_176
    summary = floor_summary(roof, Workload(batch=1, context=0, prompt_len=512, kv_budget_bytes=1 << 30,
                                           max_model_len=4096))
    assert summary["max_concurrency_at_max_model_len"] == pytest.approx(
        (1 << 30) / (roof.kv_bytes_per_token * arch.attended_context(4096)))
