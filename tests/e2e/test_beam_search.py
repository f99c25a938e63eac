"""Beam search: output equal to transformers' beam search in float32, beams sharing KV blocks, every block
returned whatever ends the search."""

from __future__ import annotations

import pytest

from loom import BeamSearchParams, SamplingParams

CASES = [  # beam_width, length_penalty, early_stopping, max_tokens, prompt
    (3, 1.0, False, 20, "The quick brown fox"),
    (2, 0.0, True, 24, "def fibonacci(n):"),
    (4, 2.0, "never", 16, "What is the capital of France? The capital is"),
    (4, -0.5, False, 40, "chat: Say hi."),
]


def _ids(tokenizer, prompt: str) -> list[int]:
    if prompt.startswith("chat: "):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt[6:]}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def hf_beam_search(model, ids: list[int], eos: list[int], width: int, length_penalty: float, early_stopping,
                   max_tokens: int) -> list[list[int]]:
    """transformers' beam search: the width best sequences' generated tokens, best first (padding dropped)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=max_tokens, length_penalty=length_penalty,
                             early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos[0])
    result = []
    for seq in out.tolist():
        tokens = seq[len(ids):]
        end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        result.append(tokens[:end])
    return result


@pytest.fixture(scope="module")
def references(hf_gguf_model, hf_tokenizer, llm) -> list[list[list[int]]]:
    eos = sorted(llm.engine.eos_token_ids)
    return [hf_beam_search(hf_gguf_model, _ids(hf_tokenizer, prompt), eos, w, lp, es, mt)
            for w, lp, es, mt, prompt in CASES]


def _params(case) -> BeamSearchParams:
    width, length_penalty, early_stopping, max_tokens, _ = case
    return BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                            early_stopping=early_stopping)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_beam_search_equals_transformers(llm, hf_tokenizer, references, index: int) -> None:
    case = CASES[index]
    out = llm.beam_search([_ids(hf_tokenizer, case[-1])], _params(case), use_tqdm=False)[0]
    assert out.finished and [o.index for o in out.outputs] == list(range(case[0]))
    assert [o.token_ids for o in out.outputs] == references[index]
    for o in out.outputs:
        assert o.finish_reason == ("stop" if o.token_ids[-1] in llm.engine.eos_token_ids else "length")
        assert o.text == hf_tokenizer.decode(o.token_ids, skip_special_tokens=True)
        assert o.cumulative_logprob < 0
    engine = llm.engine
    engine.scheduler.check_invariants()
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks and not engine.has_unfinished_requests()


def test_beam_searches_batched_with_sampled_requests(llm, hf_tokenizer, references) -> None:
    """Several beam searches and ordinary requests in one engine at once: each beam search still equals its
    reference, and the ordinary greedy request equals its run alone."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    for index, case in enumerate(CASES[:3]):
        engine.add_request(f"beam{index}", _ids(hf_tokenizer, case[-1]), _params(case))
    engine.add_request("greedy", "Once upon a time", greedy)
    engine.add_request("sampled", "Once upon a time", SamplingParams(temperature=0.8, seed=1, max_tokens=24))
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        engine.scheduler.check_invariants()
    for index in range(3):
        assert [o.token_ids for o in results[f"beam{index}"].outputs] == references[index]
    assert results["greedy"].outputs[0].token_ids == alone
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks


def test_beams_share_their_prefix_blocks(llm, hf_tokenizer) -> None:
    engine = llm.engine
    prompt = _ids(hf_tokenizer, "The history of the Roman empire begins with")  # several full blocks
    engine.add_request("share", prompt, BeamSearchParams(beam_width=4, max_tokens=12))
    manager = engine.scheduler.kv_cache_manager
    seen_shared = False
    while engine.has_unfinished_requests():
        engine.step()
        tables = [manager.get_block_ids(r.request_id) for r in engine.scheduler.running]
        if len(tables) == 4:
            held = sum(len(t) for t in tables)
            distinct = len({b for t in tables for b in t})
            seen_shared |= distinct <= held - 3 * (len(prompt) // engine.block_size)  # the prompt's blocks once
    assert seen_shared
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks


def test_aborting_a_beam_search_frees_every_block(llm, hf_tokenizer) -> None:
    engine = llm.engine
    engine.add_request("gone", "Tell me a long story about", BeamSearchParams(beam_width=4, max_tokens=64))
    for _ in range(5):
        engine.step()
    assert len(engine.scheduler.running) == 4
    engine.abort_request(["gone"])
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_invariants()
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks
    engine.abort_request(["gone"])  # unknown now: ignored
    engine.add_request("gone", "Reused id", BeamSearchParams(beam_width=2, max_tokens=2))  # the id is free again
    while engine.has_unfinished_requests():
        engine.step()


TIGHT = (4, 1.0, False, 32, "def fibonacci(n):")  # diverging beams: 32 preemptions in the smallest pool admitted


@pytest.fixture(scope="module")
def tight_reference(hf_gguf_model, hf_tokenizer, llm) -> list[list[int]]:
    width, length_penalty, early_stopping, max_tokens, prompt = TIGHT
    return hf_beam_search(hf_gguf_model, _ids(hf_tokenizer, prompt), sorted(llm.engine.eos_token_ids), width,
                          length_penalty, early_stopping, max_tokens)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_under_preemption_equals_transformers(hf_tokenizer, tight_reference, mode: str) -> None:
    """The smallest KV pool a search is admitted with (one whole sequence plus a block per beam): beams are
    preempted (in swap mode too, with a host tier), recomputed and copied on write, and the output is still
    transformers'."""
    from loom import LLM

    prompt = _ids(hf_tokenizer, TIGHT[-1])
    num_blocks = -(-(len(prompt) + TIGHT[3]) // 4) + TIGHT[0]
    swap = {"preemption_mode": "swap", "kv_offload_memory_gb": 0.01} if mode == "swap" else {}
    small = LLM(dtype="float32", quantization="none", block_size=4, num_kv_blocks=num_blocks, max_num_seqs=8,
                **swap)
    engine = small.engine
    engine.add_request("tight", prompt, _params(TIGHT))
    finals = []
    for _ in range(1000):  # a livelock (held beams filling the pool while their sibling waits) fails, not hangs
        finals += [o for o in engine.step() if o.finished]
        engine.scheduler.check_invariants()
        if not engine.has_unfinished_requests():
            break
    (out,) = finals
    assert engine.scheduler.num_preemptions_total > 0
    assert [o.token_ids for o in out.outputs] == tight_reference
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 33}, "beam_width"), ({"beam_width": 2.0}, "beam_width"),
    ({"beam_width": 2, "n": 3}, "n must"), ({"max_tokens": 0}, "max_tokens"),
    ({"length_penalty": float("nan")}, "length_penalty"), ({"early_stopping": "sometimes"}, "early_stopping"),
    ({"early_stopping": 1}, "early_stopping"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"), ({"stop_token_ids": list(range(17))}, "stop_token_ids"),
])
def test_bad_beam_search_params_name_the_parameter(kwargs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_a_beam_wider_than_the_seats_is_refused(llm) -> None:
    import dataclasses

    scheduler = llm.engine.scheduler
    config = scheduler.scheduler_config
    scheduler.scheduler_config = dataclasses.replace(config, max_num_seqs=2)
    try:
        with pytest.raises(ValueError, match="max_num_seqs"):
            llm.beam_search(["Hi"], BeamSearchParams(beam_width=3), use_tqdm=False)
    finally:
        scheduler.scheduler_config = config
    assert not llm.engine.has_unfinished_requests()


def test_beam_search_with_speculative_decoding_on_is_unchanged(hf_tokenizer, references) -> None:
    """Beams are never drafted for (a draft would let one run ahead of its group); a greedy request beside them
    still speculates, and the beam search still equals transformers'."""
    from loom import LLM

    spec = LLM(dtype="float32", quantization="none", speculative_method="ngram", num_speculative_tokens=3,
               speculative_disable_by_batch_size=None)
    engine = spec.engine
    engine.add_request("beam", _ids(hf_tokenizer, CASES[1][-1]), _params(CASES[1]))
    engine.add_request("plain", "1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3",
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    finals = {}
    for _ in range(500):
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    assert [o.token_ids for o in finals["beam"].outputs] == references[1]
    assert engine.get_stats().spec_num_drafts > 0  # the plain request did speculate
    assert engine.scheduler.num_free_blocks == engine.num_kv_blocks
