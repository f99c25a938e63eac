"""Offline latency/throughput benches with a fake LLM, the hf peer on a tiny random Llama, and the CLI wiring."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from loom.bench.cli import register
from loom.bench.datasets import SampleRequest, synthetic_requests
from loom.bench.hf_backend import HFRunner, hf_throughput
from loom.bench.latency import LatencyConfig, latency_prompts, run_hf_latency, run_loom_latency
from loom.bench.throughput import WARMUP_PROMPT, run_loom_throughput
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import SamplingParams


class FakeLLM:
    """Emits one token per stream step; generate returns max_tokens tokens per prompt."""

    def __init__(self) -> None:
        self.prompts: list[list[int] | str] = []
        self.generate_calls: list[list[list[int] | str]] = []

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        self.prompts.append(prompt)
        assert params.ignore_eos and params.temperature == 0.0
        tokens: list[int] = []
        for i in range(params.max_tokens or 0):
            tokens.append(i)
            done = len(tokens) == params.max_tokens
            yield RequestOutput("r", None, list(prompt), None,
                                [CompletionOutput(0, "", list(tokens), delta_token_ids=[i],
                                                  finish_reason="length" if done else None)], done)

    def generate(self, prompts: Sequence[list[int] | str], params: Sequence[SamplingParams],
                 use_tqdm: bool = True) -> list[RequestOutput]:
        self.generate_calls.append(list(prompts))
        return [RequestOutput(str(i), None, [0] * (len(p) if isinstance(p, list) else 2), None,
                              [CompletionOutput(0, "", list(range(sp.max_tokens or 0)), finish_reason="length")], True)
                for i, (p, sp) in enumerate(zip(prompts, params))]


def test_loom_latency_with_fake_llm() -> None:
    llm = FakeLLM()
    cfg = LatencyConfig(input_len=8, output_len=4, num_warmup=1, num_runs=3)
    res = run_loom_latency(llm, cfg, vocab_size=1000)
    assert len(res.ttft_s) == len(res.e2e_s) == len(res.tpot_s) == 3
    assert len({tuple(p) for p in llm.prompts}) == 4  # a distinct prompt per run: no prefix-cache hits
    s = res.summary()
    assert s["e2e_ms"] >= s["ttft_ms"] and s["decode_tok_s"] > 0
    with pytest.raises(ValueError, match="num_runs"):
        LatencyConfig(num_runs=0)


def test_loom_throughput_counts_tokens() -> None:
    reqs = synthetic_requests(6, input_len=10, output_len=5, vocab_size=1000, range_ratio=0.5)
    llm = FakeLLM()
    res = run_loom_throughput(llm, reqs, use_tqdm=False)
    # one untimed warm-up request first, whose tokens start no timed prompt (no prefix-cache help), then all of them
    assert len(llm.generate_calls) == 2 and llm.generate_calls[0] == [WARMUP_PROMPT]
    assert all(r.prompt[:4] != WARMUP_PROMPT[:4] for r in reqs) and len(llm.generate_calls[1]) == 6
    assert res.num_requests == 6
    assert res.input_tokens == sum(r.prompt_len for r in reqs)
    assert res.output_tokens == sum(r.expected_output_len for r in reqs)
    assert res.output_tok_s == pytest.approx(res.output_tokens / res.elapsed_s)


@pytest.fixture(scope="module")
def tiny_hf() -> HFRunner:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return HFRunner(LlamaForCausalLM(cfg), tokenizer=None, pad_token_id=0)


def test_hf_peer_generates_exact_lengths(tiny_hf: HFRunner) -> None:
    outs = tiny_hf.generate_batch([[5, 6, 7], [9]], output_len=6)
    assert [len(o) for o in outs] == [6, 6]
    # left padding must not change a row's greedy tokens
    assert outs[1] == tiny_hf.generate_batch([[9]], output_len=6)[0]
    ttft, e2e = tiny_hf.generate_timed([5, 6, 7], output_len=4)
    assert 0 < ttft <= e2e
    res = run_hf_latency(tiny_hf, LatencyConfig(input_len=4, output_len=3, num_warmup=0, num_runs=2), vocab_size=128)
    assert len(res.tpot_s) == 2
    reqs = [SampleRequest([1, 2, 3], 3, 4), SampleRequest([4, 5], 2, 2), SampleRequest([6], 1, 3)]
    elapsed, n_in, n_out = hf_throughput(tiny_hf, reqs, batch_size=2)
    assert (n_in, n_out) == (6, 9) and elapsed > 0
    with pytest.raises(ValueError, match="hf_batch_size"):
        hf_throughput(tiny_hf, reqs, batch_size=0)
    with pytest.raises(ValueError, match="token ids"):
        tiny_hf.prompt_ids("text")


def test_latency_prompts_are_seeded() -> None:
    cfg = LatencyConfig(input_len=5, output_len=2, num_warmup=1, num_runs=2, seed=7)
    assert latency_prompts(cfg, 500) == latency_prompts(cfg, 500)
    assert all(len(p) == 5 for p in latency_prompts(cfg, 500))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loom")
    register(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_parses_every_subcommand() -> None:
    p = _parser()
    ns = p.parse_args(["bench", "latency", "--input-len", "32", "--backend", "loom", "hf", "--dtype", "float32"])
    assert ns.input_len == 32 and ns.backend == ["loom", "hf"] and callable(ns.func)
    ns = p.parse_args(["bench", "throughput", "--dataset", "sharegpt", "--num-prompts", "10", "--hf-batch-size", "4"])
    assert ns.dataset == "sharegpt" and ns.hf_batch_size == 4 and ns.max_num_seqs == 64
    ns = p.parse_args(["bench", "serve", "--request-rate", "2.5", "--goodput", "ttft:500", "tpot:50"])
    assert ns.request_rate == 2.5 and ns.goodput == ["ttft:500", "tpot:50"]


def test_cli_analyze_with_given_machine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30,
           "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "floors.json"
    ns = _parser().parse_args(["analyze", "--model", str(tmp_path), "--bandwidth-gbs", "10", "--gflops", "100", "--dtype", "float32",
                               "--measured-tpot-ms", "107.6", "--json", str(out)])
    assert ns.func(ns) == 0
    floors = json.loads(out.read_text())
    assert floors["floors"]["kv_bytes_per_token"] == 46080
    assert floors["floors"]["decode_step_floor_ms_B1_C0"] == pytest.approx(53.806, rel=1e-4)
    assert floors["efficiency"][0]["fraction"] == pytest.approx(0.5, rel=1e-3)
    assert "of roofline" in capsys.readouterr().out
    # the bundled GGUF, as the engine runs it: packed weights over a float16 KV cache (2 bytes per element)
    packed = _parser().parse_args(["analyze", "--bandwidth-gbs", "10", "--gflops", "100", "--json", str(out)])
    assert packed.func(packed) == 0
    floors = json.loads(out.read_text())
    assert floors["floors"]["weight_dtype"] == "packed" and floors["floors"]["kv_bytes_per_token"] == 23040
    # quantized KV rows carry their scales, as the engine stores them (int8: 72 bytes per row of 64; fp8: 68)
    for kv, per_token in (("int8", 12960), ("fp8_e4m3", 12240), ("fp8", 12240)):
        q = _parser().parse_args(["analyze", "--bandwidth-gbs", "10", "--gflops", "100", "--kv-dtype", kv,
                                  "--json", str(out)])
        assert q.func(q) == 0
        assert json.loads(out.read_text())["floors"]["kv_bytes_per_token"] == per_token
    bad = _parser().parse_args(["analyze", "--bandwidth-gbs", "10", "--gflops", "100", "--dtype", "float64"])
    with pytest.raises(ValueError, match="--dtype"):
        bad.func(bad)
