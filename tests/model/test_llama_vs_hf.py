"""loom's Llama-family model on tiny random checkpoints against transformers, fp32, through the paged cache."""

from __future__ import annotations

import pytest
import torch
from loom.model.loader import load_model
from tests.model.model_harness import VOCAB, PagedHarness, TinyModel, hf_logits

ATOL = 1e-4
CPU = torch.device("cpu")


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def test_batched_prefill_then_decode_matches_hf(tiny: TinyModel) -> None:
    loaded = load_model(str(tiny.path), torch.float32, CPU)
    harness = PagedHarness(loaded.model, loaded.arch, block_size=4)
    prompts = _prompts(0, [5, 11, 3, 8])
    out = harness.step(dict(enumerate(prompts)))
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(out[i], hf_logits(tiny.hf, prompt), atol=ATOL, rtol=0)

    # Two decode steps: K/V of earlier positions now come back through the block tables.
    for _ in range(2):
        nxt = {i: [int(out[i][-1].argmax())] for i in out}
        out = harness.step(nxt)
        for i, prompt in enumerate(prompts):
            prompt += nxt[i]
            torch.testing.assert_close(out[i][-1], hf_logits(tiny.hf, prompt)[-1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama_gqa", "qwen2_gqa", "qwen3_qknorm", "olmo2_postnorm", "phi3_fused",
                                  "mixtral_moe", "qwen2moe_shared", "qwen3moe_qknorm", "olmoe"])
def test_chunked_prefill_mixed_with_decode(name: str, tiny_models: dict[str, TinyModel]) -> None:
    """A 13-token prompt split 6 + 7 over two forwards, while another request decodes alongside."""
    tiny = tiny_models[name]
    loaded = load_model(str(tiny.path), torch.float32, CPU)
    harness = PagedHarness(loaded.model, loaded.arch, block_size=4, seed=1)
    long_prompt, other = _prompts(1, [13, 6])
    first = harness.step({0: long_prompt[:6], 1: other})
    torch.testing.assert_close(first[0], hf_logits(tiny.hf, long_prompt[:6]), atol=ATOL, rtol=0)
    other.append(7)
    second = harness.step({1: [7], 0: long_prompt[6:]})
    torch.testing.assert_close(second[0], hf_logits(tiny.hf, long_prompt)[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(second[1][-1], hf_logits(tiny.hf, other)[-1], atol=ATOL, rtol=0)


def test_long_context_beyond_original_rope_length(tiny_models: dict[str, TinyModel]) -> None:
    """Positions past the llama3 original_max_position_embeddings (16) exercise the scaled frequencies."""
    tiny = tiny_models["llama_mqa_llama3"]
    loaded = load_model(str(tiny.path), torch.float32, CPU)
    harness = PagedHarness(loaded.model, loaded.arch, block_size=8, seed=2)
    (prompt,) = _prompts(2, [60])
    out = harness.step({0: prompt})
    torch.testing.assert_close(out[0], hf_logits(tiny.hf, prompt), atol=ATOL, rtol=0)


def test_bfloat16_load_runs_close_to_fp32(tiny_models: dict[str, TinyModel]) -> None:
    tiny = tiny_models["llama_gqa"]
    loaded = load_model(str(tiny.path), torch.bfloat16, CPU)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    (prompt,) = _prompts(3, [9])
    meta_model = PagedHarness(loaded.model, loaded.arch, block_size=4)
    meta_model.caches = [c.to(torch.bfloat16) for c in meta_model.caches]
    logits = meta_model.step({0: prompt})[0]
    assert logits.dtype == torch.float32
    ref = hf_logits(tiny.hf, prompt)
    assert (logits - ref).abs().max() < 0.1 * ref.abs().max()


def test_qwen3_shapes_and_quantized_checkpoint(tiny_models: dict[str, TinyModel], tmp_path) -> None:
    """Qwen3 beyond the forward pass: `loom analyze` counts its q/k norm weights, and `loom quantize` writes a
    GPTQ-format checkpoint of it that loads back (QK-norm weights carried through) close to the dense model."""
    from loom.bench.model_arch import load_model_arch
    from loom.quant.quantize import quantize

    tiny = tiny_models["qwen3_qknorm"]
    arch = load_model_arch(str(tiny.path))
    assert arch.qk_norm == "per_head" and arch.num_params == sum(p.numel() for p in tiny.hf.parameters())
    quantize(str(tiny.path), str(tmp_path / "q8"), "rtn", bits=8, group_size=32)
    loaded = load_model(str(tmp_path / "q8"), torch.float32, CPU)
    assert loaded.arch.architecture == "Qwen3ForCausalLM" and loaded.arch.qk_norm == "per_head"
    harness = PagedHarness(loaded.model, loaded.arch, block_size=4)
    prompt = [5, 17, 33, 2, 8, 60, 41]
    got, ref = harness.step({0: prompt})[0], hf_logits(tiny.hf, prompt)
    assert float((got - ref).norm() / ref.norm()) < 0.05  # 8-bit weights; a lost q/k norm gives ~100%


def test_olmo2_layers_and_shapes(tiny_models: dict[str, TinyModel]) -> None:
    """OLMo 2's named variations: post-norm layers (no input norm) and QK-norm over the whole projections; loom
    analyze counts its parameters as transformers does."""
    from loom.bench.model_arch import load_model_arch
    from loom.model.llama import Olmo2DecoderLayer

    tiny = tiny_models["olmo2_postnorm"]
    loaded = load_model(str(tiny.path), torch.float32, CPU)
    assert loaded.arch.post_norm and loaded.arch.qk_norm == "projection"
    layer = loaded.model.model.layers[0]
    assert isinstance(layer, Olmo2DecoderLayer) and not hasattr(layer, "input_layernorm")
    assert layer.self_attn.q_norm.weight.shape == (loaded.arch.q_size,)
    assert load_model_arch(str(tiny.path)).num_params == sum(p.numel() for p in tiny.hf.parameters())


def test_phi3_fused_checkpoint_and_what_is_refused(tiny_models: dict[str, TinyModel]) -> None:
    """Phi-3 stores q/k/v and gate/up fused: they load into the stacked layers (a wrong split is named);
    malformed LongRoPE and partial rotary are refused by name rather than run wrongly."""
    import json

    from safetensors.torch import load_file

    from loom.model.loader.hf_config import hf_arch_config

    tiny = tiny_models["phi3_fused"]
    names = set().union(*(load_file(f).keys() for f in tiny.path.glob("*.safetensors")))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    loaded = load_model(str(tiny.path), torch.float32, CPU)
    assert loaded.arch.architecture == "Phi3ForCausalLM" and loaded.arch.sliding_window == 6
    config = json.loads((tiny.path / "config.json").read_text())
    longrope = {**config, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 7,
                                           "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}}
    longrope.pop("rope_parameters", None)
    with pytest.raises(ValueError, match="short_factor needs 8 values"):
        load_model_from_config(longrope)
    no_original = {**longrope, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}
    no_original.pop("original_max_position_embeddings", None)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        load_model_from_config(no_original)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        hf_arch_config({**config, "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}})
    bad = loaded.model
    with pytest.raises(ValueError, match="does not split"):
        bad.load_weights([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(7, 64))])


def load_model_from_config(config: dict) -> None:
    """Build loom's model for a config.json dict (no weights): where rope scaling is checked."""
    from loom.attention.cpu_paged import CpuPagedBackend
    from loom.model.loader.hf_config import hf_arch_config
    from loom.model.registry import get_model_class

    arch = hf_arch_config(config)
    get_model_class(arch.architecture)(arch, CpuPagedBackend(), torch.float32, CPU)


def test_mixture_of_experts_groups_tokens_by_expert(tiny_models: dict[str, TinyModel]) -> None:
    """Mixtral's FFN: the grouped computation equals the definition token by token (softmax over the router's
    logits, top 2, renormalized, weighted sum of the chosen experts); the router stays dense under a packed
    method while the experts are packed; and the one-call C step declines MoE layers."""
    from loom.model.llama import SparseMoeBlock
    from loom.quant.methods import PackedLinearMethod

    tiny = tiny_models["mixtral_moe"]
    loaded = load_model(str(tiny.path), torch.float32, CPU)
    assert loaded.arch.num_experts == 4 and loaded.arch.num_experts_per_tok == 2
    moe = loaded.model.model.layers[0].mlp
    assert isinstance(moe, SparseMoeBlock)
    x = torch.randn(11, loaded.arch.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = moe(x)
        logits = x @ moe.gate.weight.T
        want = torch.zeros_like(x)
        for t in range(x.shape[0]):
            p = torch.softmax(logits[t], -1)
            top = torch.topk(p, 2)
            for w, e in zip(top.values / top.values.sum(), top.indices.tolist()):
                want[t] += w * moe.experts[e](x[t : t + 1])[0]
        counts = moe.expert_token_counts(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert int(counts.sum()) == 2 * x.shape[0] and int((counts > 0).sum()) > 1  # tokens spread over experts
    packed = load_model(str(tiny.path), torch.float32, CPU, quantization="w8a16")
    pmoe = packed.model.model.layers[0].mlp
    assert not isinstance(pmoe.gate.quant_method, PackedLinearMethod)
    assert all(isinstance(e.gate_up_proj.quant_method, PackedLinearMethod) for e in pmoe.experts)
    assert packed.model.model.decode_step is None


@pytest.mark.parametrize("name", ["mixtral_moe", "qwen2moe_shared", "qwen3moe_qknorm", "olmoe"])
def test_analyze_counts_total_and_active_expert_parameters(tiny_models: dict[str, TinyModel], name: str) -> None:
    """loom analyze's parameter count equals transformers' (experts, router, shared expert, dense layers, q/k
    norms), and a decoded token runs k of the E experts of each sparse layer."""
    from loom.bench.model_arch import load_model_arch

    tiny = tiny_models[name]
    arch = load_model_arch(str(tiny.path))
    assert arch.num_experts == 4 and arch.experts_per_tok == 2
    # (ModelArch counts no biases: Qwen2-MoE's q/k/v biases are left out of both sides)
    assert arch.num_params == sum(p.numel() for n, p in tiny.hf.named_parameters() if not n.endswith(".bias"))
    expert = 3 * arch.hidden_size * (arch.moe_intermediate_size or arch.intermediate_size)
    untied_embedding = arch.vocab_size * arch.hidden_size
    sparse_layers = arch.num_layers - arch.num_dense_mlp_layers
    assert arch.num_decode_params == arch.num_params - untied_embedding - sparse_layers * 2 * expert


def test_quantized_checkpoints_of_moe_and_fused_families_are_refused_by_name(tiny_models, tmp_path) -> None:
    """GPTQ / AWQ / compressed-tensors files of Mixtral-style or Phi-3 checkpoints name projections the
    per-shard lookup does not know: refused with the architecture named, not half-loaded."""
    import json
    import shutil

    for name in ("mixtral_moe", "phi3_fused"):
        src, dst = tiny_models[name].path, tmp_path / name
        shutil.copytree(src, dst)
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                         "sym": True}
        (dst / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="not supported yet"):
            load_model(str(dst), torch.float32, CPU)


def test_longrope_tables_move_with_the_model() -> None:
    """Both LongRoPE tables are buffers, so `model.to(device)` moves the long one too: on a GPU it stayed on the
    CPU and Phi-3's long-context lookup failed (benchmarks/gpu_check.py's CUDA test run on an H200)."""
    from loom.model.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
               "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(16, 256, 10000.0, scaling).to(torch.float64)  # .to(dtype) moves buffers as .to(device)
    assert rotary.cos_sin_cache.dtype == torch.float64 and rotary.cos_sin_cache_long.dtype == torch.float64
    assert RotaryEmbedding(16, 256, 10000.0, None).cos_sin_cache_long is None


def test_rotary_cos_sin_rows_and_bounds() -> None:
    """cos_sin gathers rows of the precomputed [cos, cos] / [-sin, sin] tables: equal bit for bit to building them
    from the cos/sin cache per call (the formula before the tables), made again after the module moves, and a
    position outside [0, max_position) is a ValueError naming the bound, not an index error from deep inside."""
    from loom.model.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(16, 256, 10000.0, None)
    positions = torch.tensor([0, 5, 255, 5, 128])
    cos, sin = rotary.cos_sin(positions)
    half_cos, half_sin = rotary.cos_sin_cache[positions].chunk(2, dim=-1)
    assert cos.shape == sin.shape == (5, 1, 16)
    assert torch.equal(cos, torch.cat([half_cos, half_cos], dim=-1)[:, None, :])
    assert torch.equal(sin, torch.cat([-half_sin, half_sin], dim=-1)[:, None, :])
    assert rotary.cos_sin(torch.tensor([], dtype=torch.int64))[0].shape == (0, 1, 16)
    for bad in ([256], [3, 1000], [-1]):
        with pytest.raises(ValueError, match=r"positions must be in \[0, 256\)"):
            rotary.cos_sin(torch.tensor(bad))
    moved = rotary.to(torch.float64)  # a new cache tensor: the gathered tables follow it
    assert moved.cos_sin(positions)[0].dtype == torch.float64
    assert torch.equal(moved.cos_sin(positions)[1], sin.double())


def test_longrope_cos_sin_takes_each_tokens_table() -> None:
    """With LongRoPE the tokens marked use_long read the long table's rows and the others the short one's: bit for
    bit the formula built per call from the two caches (a torch.where of the gathered rows, then [cos, cos] and
    [-sin, sin]); no token marked long reads the short table only; bounds are checked on both paths."""
    from loom.model.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
               "original_max_position_embeddings": 64}
    rotary = RotaryEmbedding(16, 256, 10000.0, scaling)
    positions = torch.tensor([0, 70, 255, 5, 128])
    use_long = torch.tensor([False, True, True, False, True])
    table = torch.where(use_long[:, None], rotary.cos_sin_cache_long[positions], rotary.cos_sin_cache[positions])
    half_cos, half_sin = table.chunk(2, dim=-1)
    cos, sin = rotary.cos_sin(positions, use_long)
    assert torch.equal(cos, torch.cat([half_cos, half_cos], dim=-1)[:, None, :])
    assert torch.equal(sin, torch.cat([-half_sin, half_sin], dim=-1)[:, None, :])
    assert not torch.equal(cos[1], rotary.cos_sin(positions)[0][1])  # the long table's row differs
    short = rotary.cos_sin(positions, torch.zeros(5, dtype=torch.bool))
    assert torch.equal(short[0], rotary.cos_sin(positions)[0]) and torch.equal(short[1], rotary.cos_sin(positions)[1])
    with pytest.raises(ValueError, match=r"positions must be in \[0, 256\)"):
        rotary.cos_sin(torch.tensor([3, 300]), torch.tensor([True, True]))
