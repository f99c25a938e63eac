"""Block-sparse decode attention (Quest top-k blocks, loom/attention/sparse.py): the bound, the selection, exactness
when every block is read, summaries that follow copies, and the engine end to end."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loom.attention import build_attention_metadata
from loom.attention.cpu_paged import CpuPagedBackend
from loom.attention.sparse import (
    BlockSparseSelector,
    SparseAttentionConfig,
    bf16_round_down,
    bf16_round_up,
    block_bounds,
    copied_block_ids,
    select_blocks,
    stale_key_summaries,
)
from loom.kernels.registry import clear_kernel_cache

CPU = torch.device("cpu")
BS, H_KV, H, D = 4, 2, 6, 8  # block size, KV heads, query heads (group 3), head_dim
SCALE = D**-0.5


def _prefill(backend: CpuPagedBackend, cache: torch.Tensor, lens: list[int], tables: list[list[int]],
             seed: int = 0) -> None:
    """Write random K/V for whole contexts of `lens` tokens through the backend (one prefill step)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    meta = build_attention_metadata(lens, lens, tables, BS, CPU)
    backend.forward(torch.randn(n, H, D, generator=g), torch.randn(n, H_KV, D, generator=g),
                    torch.randn(n, H_KV, D, generator=g), cache, meta, SCALE, None)


def _decode(backend: CpuPagedBackend, cache: torch.Tensor, lens: list[int], tables: list[list[int]],
            seed: int = 1) -> torch.Tensor:
    """One decode token per request at position lens[i] (its context lens[i] + 1); returns [num_reqs, H, D]."""
    g = torch.Generator().manual_seed(seed)
    r = len(lens)
    meta = build_attention_metadata([1] * r, [n + 1 for n in lens], tables, BS, CPU)
    return backend.forward(torch.randn(r, H, D, generator=g), torch.randn(r, H_KV, D, generator=g),
                           torch.randn(r, H_KV, D, generator=g), cache, meta, SCALE, None)


def _cache(num_blocks: int = 48) -> torch.Tensor:
    return torch.zeros(2, num_blocks, BS, H_KV, D)


def _true_summaries(cache: torch.Tensor, block: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) [H_KV, D] of the first `rows` keys of a block, from the cache itself."""
    keys = cache[0, block, :rows].float()
    return keys.amin(dim=0), keys.amax(dim=0)


def test_summaries_round_outward_to_the_nearest_bfloat16_on_that_side() -> None:
    """The bfloat16 summaries still bound the keys: the max is rounded up and the min down, each to the nearest
    bfloat16 on its side (a reference from torch's round-to-nearest and nextafter)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * torch.logspace(-20, 38, 20000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), 3.4e38, -3.4e38,
                                    1e-40, -1e-40, 1.4e-45, -1.4e-45, 1.1754942e-38])])  # subnormals
    near = x.bfloat16()
    up = torch.where(near.float() >= x, near, torch.nextafter(near, torch.full_like(near, float("inf"))))
    down = torch.where(near.float() <= x, near, torch.nextafter(near, torch.full_like(near, float("-inf"))))
    assert torch.equal(bf16_round_up(x), up) and torch.equal(bf16_round_down(x), down)
    assert (bf16_round_up(x).float() >= x).all() and (bf16_round_down(x).float() <= x).all()
    with pytest.raises(ValueError, match="float32"):
        bf16_round_up(x.double())


def test_bound_is_above_every_key_of_the_block() -> None:
    g = torch.Generator().manual_seed(0)
    num_reqs, num_blocks = 3, 7
    keys = torch.randn(num_reqs, num_blocks, BS, H_KV, D, generator=g) * torch.rand(D, generator=g) * 3
    query = torch.randn(num_reqs, H, D, generator=g)
    bounds = block_bounds(query, keys.amin(dim=2), keys.amax(dim=2)).double()  # [R, blocks, H]
    group = H // H_KV
    for h in range(H):
        k = keys[:, :, :, h // group].double()  # [R, blocks, BS, D]
        dots = torch.einsum("rbtd,rd->rbt", k, query[:, h].double())
        assert (bounds[:, :, h, None] >= dots - 1e-5).all()
        # and it is sum_c max(q_c min_c, q_c max_c) exactly as Quest writes it
        qc = query[:, None, h].double()
        quest = torch.maximum(qc * k.amin(dim=2), qc * k.amax(dim=2)).sum(-1)
        torch.testing.assert_close(bounds[:, :, h], quest, rtol=1e-5, atol=1e-5)


def _reference_selection(query: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], seq_lens: list[int],
                         cfg: SparseAttentionConfig) -> list[list[int]]:
    """Plain-torch reference: per request, the block ids read (sink, recent, top-k of max-over-heads Quest bound)."""
    out = []
    group = H // H_KV
    for r, (table, n) in enumerate(zip(tables, seq_lens, strict=True)):
        nb = -(-n // BS)
        scores = []
        for j in range(nb):
            rows = min(BS, n - j * BS)
            keys = cache[0, table[j], :rows].float()  # [rows, H_KV, D]
            mn, mx = keys.amin(0), keys.amax(0)
            per_head = [torch.maximum(query[r, h] * mn[h // group], query[r, h] * mx[h // group]).sum()
                        for h in range(H)]
            scores.append(max(float(s) for s in per_head))
        forced = {j for j in range(nb) if j < cfg.sink_blocks or j >= nb - cfg.recent_blocks}
        others = sorted((j for j in range(nb) if j not in forced), key=lambda j: -scores[j])[: cfg.topk]
        out.append([table[j] for j in sorted(forced | set(others))])
    return out


def test_selection_equals_a_plain_torch_reference() -> None:
    cfg = SparseAttentionConfig(topk=3, sink_blocks=1, recent_blocks=2)
    backend = CpuPagedBackend(sparse=cfg)
    cache = _cache()
    lens = [37, 9, 22, 29]  # 10, 3 (all read), 6 and 8 blocks; max_blocks = cfg.max_blocks + 4
    tables = [list(range(0, 10)), [40, 41, 42], [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35, 36, 37]]
    _prefill(backend, cache, lens, tables)
    g = torch.Generator().manual_seed(3)
    query = torch.randn(len(lens), H, D, generator=g)
    block_ids = torch.tensor([t + [0] * (10 - len(t)) for t in tables], dtype=torch.int64)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    selected, sel_lens = backend.sparse.select(query, cache, block_ids, seq_lens)
    expected = _reference_selection(query, cache, tables, lens, cfg)
    for r, want in enumerate(expected):
        assert selected[r, : len(want)].tolist() == want
        assert int(sel_lens[r]) == lens[r] - (-(-lens[r] // BS) - len(want)) * BS
    assert sel_lens.tolist() == [37 - 4 * BS, 9, 22, 29 - 2 * BS]


def test_select_blocks_reads_every_block_in_order_when_k_covers_them() -> None:
    scores = torch.randn(3, 9)
    num_blocks = torch.tensor([9, 4, 7])
    positions, count = select_blocks(scores, num_blocks, SparseAttentionConfig(topk=6, sink_blocks=1,
                                                                               recent_blocks=2))
    assert count.tolist() == [9, 4, 7]
    assert positions[0].tolist() == list(range(9))
    assert positions[1, :4].tolist() == [0, 1, 2, 3] and positions[2, :7].tolist() == list(range(7))


@pytest.fixture(params=["kernel", "sdpa", "no_c_kernels"])
def kernel_mode(request, monkeypatch):
    """Decode through loom's C kernel (float32_kernels), through SDPA, or with LOOM_CPU_KERNELS=0."""
    if request.param == "no_c_kernels":
        monkeypatch.setenv("LOOM_CPU_KERNELS", "0")
        clear_kernel_cache()
        yield False
        monkeypatch.undo()
        clear_kernel_cache()
        return
    yield request.param == "kernel"


def test_k_covering_every_block_is_bit_identical_to_dense(kernel_mode: bool) -> None:
    lens = [37, 9, 22]
    tables = [list(range(0, 10)), [40, 41, 42], list(range(20, 27))]
    dense, sparse = CpuPagedBackend(kernel_mode), CpuPagedBackend(kernel_mode, SparseAttentionConfig(topk=7))
    if kernel_mode:
        assert dense.decode_kernel is not None, "the C paged decode kernel did not build"
    cache_d, cache_s = _cache(), _cache()
    _prefill(dense, cache_d, lens, tables)
    _prefill(sparse, cache_s, lens, tables)
    for step in range(3):  # the last block fills up and a new one starts (37 + 3 = 40 = 10 blocks)
        out_d = _decode(dense, cache_d, [n + step for n in lens], tables, seed=step)
        out_s = _decode(sparse, cache_s, [n + step for n in lens], tables, seed=step)
        assert torch.equal(out_d, out_s)
    # the selection path itself, given k covering every block, builds the dense table
    cfg = SparseAttentionConfig(topk=7, sink_blocks=1, recent_blocks=2)
    positions, count = select_blocks(torch.randn(3, 10), torch.tensor([10, 3, 6]), cfg)
    assert positions[0].tolist() == list(range(10)) and count.tolist() == [10, 3, 6]


def test_sparse_decode_attends_exactly_the_selected_blocks(kernel_mode: bool) -> None:
    """With a small k, a decode row's output is dense attention over the selected blocks' rows (in a mixed step,
    beside a prefill chunk that stays dense)."""
    cfg = SparseAttentionConfig(topk=2, sink_blocks=1, recent_blocks=1)
    backend = CpuPagedBackend(kernel_mode, cfg)
    cache = _cache()
    lens, tables = [37, 21], [list(range(0, 10)), list(range(20, 26))]
    _prefill(backend, cache, lens, tables)
    g = torch.Generator().manual_seed(5)
    # request 0 decodes one token, request 1 prefills its last 3 tokens (recomputed: a chunk)
    meta = build_attention_metadata([1, 3], [38, 21], tables, BS, CPU)
    q, k, v = torch.randn(4, H, D, generator=g), torch.randn(4, H_KV, D, generator=g), torch.randn(4, H_KV, D,
                                                                                                    generator=g)
    out = backend.forward(q, k, v, cache, meta, SCALE, None)
    chosen = _reference_selection(q[:1], cache, tables[:1], [38], cfg)[0]
    assert len(chosen) == 4 and chosen[0] == 0 and chosen[-1] == 9
    rows = torch.cat([cache[:, b, : min(BS, 38 - tables[0].index(b) * BS)] for b in chosen], dim=1)  # [2, n, H_KV, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[0].view(H_KV, H // H_KV, D), rows[0].transpose(0, 1), rows[1].transpose(0, 1), scale=SCALE)
    torch.testing.assert_close(out[0], ref.reshape(H, D), rtol=1e-5, atol=1e-5)
    dense_out = CpuPagedBackend(kernel_mode).forward(q, k, v, cache.clone(), meta, SCALE, None)
    torch.testing.assert_close(out[1:], dense_out[1:], rtol=0, atol=0)  # the prefill rows stay dense


def _summaries_bound(selector: BlockSparseSelector, cache: torch.Tensor, blocks: dict[int, int]) -> bool:
    """Whether every valid summary of `blocks` (block id -> filled rows) bounds the block's keys in the cache."""
    summaries, valid = selector.summaries(cache)
    for block, rows in blocks.items():
        if not valid[block]:
            continue
        mn, mx = _true_summaries(cache, block, rows)
        if not ((summaries[:, block, 1] <= mn).all() and (summaries[:, block, 0] >= mx).all()):
            return False
    return True


def _copy_blocks(kind: str, caches: list[torch.Tensor], src: int, dst: int, block_size: int):
    """Copy block src into block dst with the runner's own copy functions; returns the SchedulerOutput-like
    object whose copies these are."""
    from loom.worker.kv_cache import copy_kv_slots

    empty = dict(blocks_to_restore=[], blocks_to_copy=[], kv_loads=[], scheduled=[])
    if kind == "cow":
        copy_kv_slots(caches, [src * block_size + o for o in range(block_size)],
                      [dst * block_size + o for o in range(block_size)])
        return SimpleNamespace(**{**empty, "blocks_to_copy": [(src, dst)]})
    if kind == "restore":
        from loom.worker.kv_offload import HostKVCache

        host = HostKVCache(caches, 4)
        host.offload(caches, [(src, 2)])
        host.restore(caches, [(2, dst)])
        return SimpleNamespace(**{**empty, "blocks_to_restore": [(2, dst)]})
    if kind == "kv_load":
        from loom.kv_transfer.tensors import read_blocks, write_blocks

        payload = SimpleNamespace(data=read_blocks(caches, [src]), num_blocks=1)
        write_blocks(caches, payload, [0], [dst])
        return SimpleNamespace(**{**empty, "kv_loads": [SimpleNamespace(dst_block_ids=[dst])]})
    assert kind == "branch"  # tree candidates: rows before the root copied into the branch's scratch block
    start = 3 * block_size + 2  # the root is at offset 2 of position-block 3
    copy_kv_slots(caches, [src * block_size + o for o in range(2)], [dst * block_size + o for o in range(2)])
    req = SimpleNamespace(start_position=start, spec_branches=[([1, 2], [0, 0, 0, dst])])
    return SimpleNamespace(**{**empty, "scheduled": [req]})


@pytest.mark.parametrize("kind", ["cow", "restore", "kv_load", "branch"])
def test_blocks_filled_by_copy_get_fresh_summaries(kind: str) -> None:
    cfg = SparseAttentionConfig(topk=1, sink_blocks=1, recent_blocks=1)
    backend = CpuPagedBackend(sparse=cfg)
    cache = _cache()
    # request A owns blocks 0..7 (32 tokens); block 10 was written by an earlier request with other keys
    _prefill(backend, cache, [32], [list(range(8))], seed=0)
    _prefill(backend, cache, [4], [[10]], seed=7)
    cache[0, 3] *= 50  # A's block 3: keys far outside block 10's range, so a stale summary cannot bound them
    backend.sparse.invalidate([3])
    output = _copy_blocks(kind, [cache], 3, 10, BS)
    rows = 2 if kind == "branch" else BS
    assert not _summaries_bound(backend.sparse, cache, {10: rows}), "the copy should leave block 10 stale"
    stale_key_summaries(backend, copied_block_ids(output, BS))  # what ModelRunner.execute_model does
    assert _summaries_bound(backend.sparse, cache, {10: rows})
    # a decode over a table holding block 10 recomputes its summary from the cache, and selects like the reference
    table = [0, 1, 2, 10, 4, 5, 6, 7]
    q = torch.randn(1, H, D, generator=torch.Generator().manual_seed(2))
    meta = build_attention_metadata([1], [32 if kind != "branch" else 14], [table], BS, CPU)
    seq_len = meta.seq_lens_cpu[0]
    backend.forward(q, torch.randn(1, H_KV, D), torch.randn(1, H_KV, D), cache, meta, SCALE, None)
    summaries, valid = backend.sparse.summaries(cache)
    assert valid[10]
    mn, mx = _true_summaries(cache, 10, min(BS, seq_len - 3 * BS))
    assert torch.equal(summaries[:, 10, 1], bf16_round_down(mn))
    assert torch.equal(summaries[:, 10, 0], bf16_round_up(mx))
    block_ids = torch.tensor([table[: -(-seq_len // BS)]], dtype=torch.int64)
    selected, _ = backend.sparse.select(q, cache, block_ids, torch.tensor([seq_len]))
    assert selected[0].tolist() == _reference_selection(q, cache, [table], [seq_len], cfg)[0]


def test_keys_written_from_a_block_start_replace_its_old_summary() -> None:
    backend = CpuPagedBackend(sparse=SparseAttentionConfig(topk=1))
    cache = _cache()
    _prefill(backend, cache, [8], [[5, 6]], seed=0)
    _prefill(backend, cache, [2], [[5]], seed=9)  # block 5 reused by another request: rows 0-1 rewritten
    summaries, valid = backend.sparse.summaries(cache)
    mn, mx = _true_summaries(cache, 5, 2)
    assert valid[5] and torch.equal(summaries[:, 5, 1], bf16_round_down(mn))
    assert torch.equal(summaries[:, 5, 0], bf16_round_up(mx))


def test_engine_greedy_tokens_equal_dense_when_k_covers_everything_and_small_k_keeps_invariants() -> None:
    from loom import LLM, SamplingParams
    from tests.helpers import run_engine_checked

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # one engine (loading is the slow part): built with topk-blocks, then its backend switched to dense and to a
    # small k; chunked prefill, and 24 blocks for ~2 x 6 needed
    llm = LLM(dtype="float32", quantization="none", num_kv_blocks=24, block_size=16, max_num_batched_tokens=48,
              enable_prefix_caching=False, sparse_attention="topk-blocks", sparse_attention_topk=16,
              num_threads=1)  # one thread: the CI machine is shared, spinning OpenMP threads crawl
    backend = llm.engine.runner.attn_backend
    assert isinstance(backend.sparse, BlockSparseSelector) and backend.sparse.config.topk == 16
    assert llm.engine.runner.model.model.decode_step is None  # each layer selects from its own query
    tok = llm.tokenizer
    prompts = [tok.encode("The history of the city " * 14), tok.encode("def fibonacci(n):\n" * 8), tok.encode("Hi")]
    covering = run_engine_checked(llm.engine, prompts, params)
    backend.sparse = None
    assert run_engine_checked(llm.engine, prompts, params) == covering  # dense: the same greedy tokens
    small = BlockSparseSelector(SparseAttentionConfig(topk=1, sink_blocks=1, recent_blocks=1))
    selected = []

    def spy(*args):  # noqa: ANN002, ANN202
        out = BlockSparseSelector.select(small, *args)
        selected.append(out)
        return out

    small.select = spy
    backend.sparse = small
    out = run_engine_checked(llm.engine, prompts, params)
    assert [len(o) for o in out] == [8, 8, 8]
    assert any(s is not None for s in selected)  # the long prompts decoded over 3 of their 5-6 blocks


def test_sliding_window_models_are_refused() -> None:
    from loom.model.loader.model_loader import _check_sparse_attention

    arch = SimpleNamespace(architecture="Gemma3ForCausalLM", num_layers=2, attn_logit_softcapping=None,
                           layer_sliding_window=lambda i: 512 if i == 0 else None)
    with pytest.raises(ValueError, match="sliding-window"):
        _check_sparse_attention(arch)
    with pytest.raises(ValueError, match="cpu_paged"):
        from loom.attention.backend import get_attention_backend

        get_attention_backend("torch_reference", sparse=SparseAttentionConfig())


def test_summaries_follow_the_runners_copy_on_write(monkeypatch) -> None:
    """Beam search through the engine: forks share partial blocks, and the runner copies them on write. After every
    step, each valid summary of every scheduled request's blocks bounds the keys in the cache; without the runner's
    invalidation hook the check fails."""
    from loom import LLM, BeamSearchParams
    from loom.worker import model_runner

    llm = LLM(dtype="float32", quantization="none", num_kv_blocks=28, block_size=16, enable_prefix_caching=False,
              sparse_attention="topk-blocks", sparse_attention_topk=1, sparse_attention_sink_blocks=1,
              sparse_attention_recent_blocks=1, num_threads=1)
    runner = llm.engine.runner
    selector = runner.attn_backend.sparse
    bs = runner.block_size
    violations: list[tuple[int, int]] = []
    copies = 0
    execute = runner.execute_model

    def checked(scheduler_output):  # noqa: ANN001, ANN202
        nonlocal copies
        copies += len(scheduler_output.blocks_to_copy)
        out = execute(scheduler_output)
        for req in scheduler_output.scheduled:
            n = req.start_position + len(req.token_ids)
            for j, block in enumerate(req.block_table[: -(-n // bs)]):
                rows = min(bs, n - j * bs)
                for cache in runner.kv_caches:
                    summaries, valid = selector.summaries(cache)
                    keys = cache[0, block, :rows].float()
                    if valid[block] and not ((summaries[:, block, 1] <= keys.amin(0)).all()
                                             and (summaries[:, block, 0] >= keys.amax(0)).all()):
                        violations.append((block, rows))
        return out

    monkeypatch.setattr(runner, "execute_model", checked)
    prompt = llm.tokenizer.encode("A long story about a small town by the sea. " * 5)
    params = BeamSearchParams(beam_width=3, max_tokens=14)
    llm.beam_search([prompt], params, use_tqdm=False)
    assert copies > 0 and not violations
    monkeypatch.setattr(model_runner, "stale_key_summaries", lambda backend, ids: None)  # the hook removed
    for cache in runner.kv_caches:  # every block holds some earlier owner's valid summary (here: all zeros)
        summaries, valid = selector.summaries(cache)
        with torch.inference_mode():  # the runner made them in inference mode
            summaries.zero_()
            valid.fill_(True)
    other = llm.tokenizer.encode("Numbers: one two three four five six seven eight nine ten. " * 4)
    llm.beam_search([other], params, use_tqdm=False)
    assert violations, "a stale summary should have been caught without the runner's hook"


def test_selection_inside_the_one_call_c_step_equals_the_per_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the bundled GGUF the C decode step widens the summaries and selects the blocks itself: its greedy tokens
    at a small k equal those of the per-layer path (selection in torch), and differ from dense attention."""
    from pathlib import Path

    from loom import LLM, SamplingParams

    text = (Path(__file__).parents[2] / "README.md").read_text()[:1500]  # ~350 tokens: 22 blocks, 7 read
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs, summaries = {}, {}
    for name, env, sparse in (("c_step", "1", True), ("per_layer", "0", True), ("dense", "1", False)):
        monkeypatch.setenv("LOOM_SPARSE_DECODE_STEP", env)
        kwargs = dict(sparse_attention="topk-blocks", sparse_attention_topk=4) if sparse else {}
        llm = LLM(num_kv_blocks=128, **kwargs)
        has_c_step = llm.engine.runner.model.model.decode_step is not None
        if name == "c_step" and not has_c_step:
            pytest.skip("no C decode step on this machine (no compiler, or LOOM_CPU_KERNELS=0)")
        assert has_c_step == (env == "1")
        outputs[name] = llm.generate([text], params)[0].outputs[0].token_ids
        if sparse:  # every layer's summaries, as the C step (or record_keys) left them
            selector = llm.engine.runner.attn_backend.sparse
            summaries[name] = [selector.summaries(cache) for cache in llm.engine.runner.kv_caches]
    assert outputs["c_step"] == outputs["per_layer"]
    # the C step's outward bfloat16 rounding is record_keys', bit for bit (the same blocks in the same order)
    for (c_sum, c_valid), (p_sum, p_valid) in zip(summaries["c_step"], summaries["per_layer"], strict=True):
        assert torch.equal(c_valid, p_valid) and c_valid.any()
        assert torch.equal(c_sum[:, c_valid].view(torch.int16), p_sum[:, p_valid].view(torch.int16))
    assert outputs["c_step"] != outputs["dense"]


def test_a_stale_summary_found_by_the_c_step_is_refreshed_and_the_step_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    """A summary the selector did not know was stale (here: every validity flag cleared behind its back before each
    step) makes the C step refuse the step; the runner then checks every layer, recomputes the summaries from the
    cache and runs the step again: the greedy tokens equal an undisturbed run's (a rerun rewrites the same rows)."""
    from pathlib import Path

    from loom import LLM, SamplingParams

    text = (Path(__file__).parents[2] / "README.md").read_text()[:1500]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    monkeypatch.setenv("LOOM_SPARSE_DECODE_STEP", "1")
    llm = LLM(num_kv_blocks=128, sparse_attention="topk-blocks", sparse_attention_topk=4)
    if llm.engine.runner.model.model.decode_step is None:
        pytest.skip("no C decode step on this machine (no compiler, or LOOM_CPU_KERNELS=0)")
    expected = llm.generate([text], params)[0].outputs[0].token_ids
    selector = llm.engine.runner.attn_backend.sparse
    real, forced = selector.refresh_stale, []

    def forgetful(kv_caches, block_ids, seq_lens, force=False):  # noqa: ANN001, ANN202
        if not force:
            for cache in kv_caches:
                selector.summaries(cache)[1].fill_(False)
        forced.append(force)
        return real(kv_caches, block_ids, seq_lens, force)

    monkeypatch.setattr(selector, "refresh_stale", forgetful)
    assert llm.generate([text], params)[0].outputs[0].token_ids == expected
    assert True in forced  # the C step refused a step, and it ran again after a forced refresh
