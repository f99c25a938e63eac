"""Long-context retrieval datasets for `loom bench longctx`: passkey retrieval and multi-document QA.

Two synthetic tasks over real prose (Jane Austen's six novels, loom/bench/heldout.py):

- passkey: a sentence holding a random 5-digit key is hidden at a chosen depth inside prose and the model is
  asked for the key at the end (passkey retrieval, Mohtashami & Jaggi 2023, arXiv:2305.16300).
- multidoc: N labelled documents, excerpts of different novels, with K key-value facts ("The special magic
  number for <name> is <number>.") spread over them; the question asks for one key's value (RULER's multi-key
  needle-in-a-haystack, Hsieh et al. 2024, arXiv:2404.06654).

Prompts are built directly as token ids in the model's tokenizer: template header + instruction + haystack (with
the needles spliced in at sentence ends) + question + template tail (+ the start of the answer). Every piece is
tokenized on its own and concatenated, so a prompt has exactly the number of tokens asked for. Everything is
seeded: the same (tokenizer, seed, length, sample) gives the same token ids. Scoring is exact match of the key's
number as the first number of the generated text (greedy decoding).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TASKS = ("passkey", "multidoc")
PROMPT_FORMATS = ("chat-prefill", "chat", "raw")
SENTENCE_ENDS = (".", "!", "?", '."', '!"', '?"', ".'")  # not a newline: the novels' lines are hard-wrapped
SNAP_TOKENS = 96  # how far (tokens) a needle may move from its nominal depth to reach a sentence end
CHARS_PER_TOKEN_BOUND = 8  # prose cut for tokenizing: more characters than any English tokenizer needs per token
_MARK = "\ue000"  # a private-use character standing for the user message when splitting the chat template

PASSKEY_INSTRUCTION = ("A pass key is hidden somewhere in the long text below. Find it and keep it in mind: "
                       "you will be asked for it at the end.")
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."
PASSKEY_ANSWER_PREFIX = "The pass key is"
MULTIDOC_INSTRUCTION = ("Below are several documents. Some of them mention special magic numbers for "
                        "different names. Read them carefully: you will be asked for one of the numbers.")
NAME_WORDS = ("amber", "birch", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
              "kestrel", "lantern", "meadow", "nickel", "orchid", "pebble", "quartz", "raven", "saffron", "thistle",
              "umber", "violet", "willow", "yarrow", "zephyr", "falcon", "marble", "copper", "heron", "maple")


@dataclass(slots=True)
class LongCtxSample:
    task: str  # "passkey" | "multidoc"
    index: int  # sample number within (task, length)
    prompt_token_ids: list[int]  # [num_tokens] the whole prompt, template included
    answer: str  # the digits the model must produce
    depth: float  # nominal depth of the queried needle in the haystack, 0..1
    needle_positions: list[int]  # prompt token index of the first token of each needle (queried one first)
    books: list[str]  # novels the prose came from (in prompt order)
    query_key: str = ""  # multidoc: the name asked about
    keys: dict[str, str] = field(default_factory=dict)  # multidoc: name -> number of every needle

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids)


class AustenProse:
    """Seeded excerpts of the novels as token ids of one tokenizer.

    Args:
        tokenizer: a transformers tokenizer (encode/decode, apply_chat_template).
        texts: book -> text; None = the six novels of loom.bench.heldout, each read when first used (raises
            RuntimeError if they cannot be had).
    """

    def __init__(self, tokenizer: Any, texts: Mapping[str, str] | None = None) -> None:
        from loom.bench.heldout import BOOKS, janeausten_data_dir

        self.tokenizer = tokenizer
        if texts is None:
            janeausten_data_dir()  # fail early (RuntimeError) when the package cannot be had
        self.books: tuple[str, ...] = tuple(sorted(BOOKS if texts is None else texts))
        self._texts: dict[str, str] = dict(texts or {})
        self._decoded: dict[int, str] = {}

    def text(self, book: str) -> str:
        """The whole text of `book` (read once)."""
        if book not in self._texts:
            from loom.bench.heldout import janeausten_text

            self._texts[book] = janeausten_text(book)
        return self._texts[book]

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def excerpt(self, book: str, num_tokens: int, rng: random.Random) -> list[int]:
        """`num_tokens` token ids of `book` from a random line start (whole tokens of a whole-line cut).

        Raises:
            ValueError: the book is too short for `num_tokens`.
        """
        text = self.text(book)
        span = num_tokens * CHARS_PER_TOKEN_BOUND + 64
        if len(text) < span:
            raise ValueError(f"book {book!r} has {len(text)} characters, too few for a {num_tokens}-token excerpt")
        start = rng.randrange(0, len(text) - span + 1)
        line = text.find("\n", start, start + 400)
        start = line + 1 if line >= 0 else start
        ids = self.encode(text[start:start + span].lstrip())
        if len(ids) < num_tokens:
            raise ValueError(f"excerpt of {book!r} has {len(ids)} tokens, fewer than {num_tokens}")
        return ids[:num_tokens]

    def sentence_end_after(self, ids: list[int], target: int) -> int:
        """The insertion index nearest `target` (within SNAP_TOKENS) that follows a sentence end; `target` if none.

        An index i means "insert before ids[i]"; 0 and len(ids) (the ends) are always allowed."""
        best = target
        for dist in range(SNAP_TOKENS + 1):
            for i in (target - dist, target + dist):
                if i <= 0 or i >= len(ids):
                    if i in (0, len(ids)):
                        return i
                    continue
                if self._text(ids[i - 1]).rstrip(" ").endswith(SENTENCE_ENDS) and self._text(ids[i])[:1].isspace():
                    return i
        return best

    def _text(self, token_id: int) -> str:
        if token_id not in self._decoded:
            self._decoded[token_id] = self.tokenizer.decode([token_id])
        return self._decoded[token_id]


@dataclass(frozen=True, slots=True)
class PromptFrame:
    prefix: list[int]  # template header + instruction, token ids
    suffix: list[int]  # question + template tail (+ answer prefix), token ids


def prompt_frame(prose: AustenProse, instruction: str, question: str, answer_prefix: str, prompt_format: str
                 ) -> PromptFrame:
    """The fixed token ids before and after the haystack in one of PROMPT_FORMATS.

    chat: the whole text is the user turn, the reply starts at the assistant header; chat-prefill: the same with
    the reply's first words (`answer_prefix`) already written; raw: no template (the tokenizer's own BOS, if any),
    text ending in "Answer: <answer_prefix>".

    Raises:
        ValueError: unknown format, or a chat format for a tokenizer without a chat template.
    """
    tok = prose.tokenizer
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
    if prompt_format == "raw":
        bos = [i for i in tok.encode("", add_special_tokens=True)]
        return PromptFrame(bos + prose.encode(instruction + "\n\n"),
                           prose.encode(f"\n\n{question}\nAnswer: {answer_prefix}"))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"prompt_format {prompt_format!r} needs a chat template; the tokenizer has none (use raw)")
    text = tok.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_MARK)
    if prompt_format == "chat-prefill":
        tail += answer_prefix
    return PromptFrame(prose.encode(head) + prose.encode(instruction + "\n\n"),
                       prose.encode(f"\n\n{question}") + prose.encode(tail))


def passkey_sample(prose: AustenProse, num_tokens: int, index: int, num_samples: int, seed: int = 0,
                   prompt_format: str = "chat-prefill") -> LongCtxSample:
    """Sample `index` of `num_samples` of the passkey task: exactly `num_tokens` prompt tokens.

    The key sentence ("The pass key is 48213. Remember it. 48213 is the pass key.") sits at depth
    0.1 + 0.8 * index / (num_samples - 1) of the haystack (0.5 for a single sample), moved to the nearest
    sentence end. The book, its excerpt and the key come from Random((seed, index)).

    Raises:
        ValueError: num_tokens too small for the frame and needle, or index out of range.
    """
    if not 0 <= index < num_samples:
        raise ValueError(f"index must be in [0, {num_samples}), got {index}")
    rng = random.Random(f"passkey/{seed}/{num_tokens}/{index}")
    key = str(rng.randrange(10000, 100000))
    needle = prose.encode(f" The pass key is {key}. Remember it. {key} is the pass key.")
    frame = prompt_frame(prose, PASSKEY_INSTRUCTION, PASSKEY_QUESTION, PASSKEY_ANSWER_PREFIX, prompt_format)
    hay_len = num_tokens - len(frame.prefix) - len(frame.suffix) - len(needle)
    if hay_len < 16:
        raise ValueError(f"num_tokens={num_tokens} leaves {hay_len} haystack tokens (need >= 16)")
    depth = 0.5 if num_samples == 1 else 0.1 + 0.8 * index / (num_samples - 1)
    book = rng.choice(prose.books)
    hay = prose.excerpt(book, hay_len, rng)
    at = prose.sentence_end_after(hay, round(depth * hay_len))
    ids = frame.prefix + hay[:at] + needle + hay[at:] + frame.suffix
    return LongCtxSample("passkey", index, ids, key, depth, [len(frame.prefix) + at], [book])


def multidoc_sample(prose: AustenProse, num_tokens: int, index: int, num_docs: int = 4, num_keys: int = 4,
                    seed: int = 0, prompt_format: str = "chat-prefill") -> LongCtxSample:
    """Sample `index` of the multi-document QA task: exactly `num_tokens` prompt tokens.

    `num_docs` documents ("Document i:" + an excerpt of a distinct novel, equal shares of the haystack) hold
    `num_keys` facts "The special magic number for <name> is <7-digit number>." with distinct names and numbers,
    one per document while keys <= documents, each at a random sentence end; the question asks for one key,
    chosen at random (RULER's MK-NIAH, arXiv:2404.06654). `depth` is the queried needle's position in the
    whole prompt, 0..1.

    Raises:
        ValueError: more documents than novels, num_keys < 1, or num_tokens too small.
    """
    if not 1 <= num_docs <= len(prose.books):
        raise ValueError(f"num_docs must be in [1, {len(prose.books)}] (one novel per document), got {num_docs}")
    if num_keys < 1:
        raise ValueError(f"num_keys must be >= 1, got {num_keys}")
    rng = random.Random(f"multidoc/{seed}/{num_tokens}/{index}")
    words = rng.sample(NAME_WORDS, 2 * num_keys)
    names = [f"{words[2 * k]}-{words[2 * k + 1]}" for k in range(num_keys)]
    numbers = [str(n) for n in rng.sample(range(1_000_000, 10_000_000), num_keys)]
    query = rng.randrange(num_keys)
    question = f"What is the special magic number for {names[query]} mentioned in the documents?"
    frame = prompt_frame(prose, MULTIDOC_INSTRUCTION, question,
                         f"The special magic number for {names[query]} is", prompt_format)
    needles = [prose.encode(f" The special magic number for {n} is {v}.") for n, v in zip(names, numbers)]
    labels = [prose.encode(f"{'' if d == 0 else chr(10) + chr(10)}Document {d + 1}:\n") for d in range(num_docs)]
    doc_of_key = [k % num_docs for k in range(num_keys)]
    rng.shuffle(doc_of_key)
    fixed = len(frame.prefix) + len(frame.suffix) + sum(map(len, labels)) + sum(map(len, needles))
    hay_total = num_tokens - fixed
    if hay_total < 16 * num_docs:
        raise ValueError(f"num_tokens={num_tokens} leaves {hay_total} haystack tokens for {num_docs} documents")
    books = rng.sample(prose.books, num_docs)
    ids = list(frame.prefix)
    positions: dict[int, int] = {}
    for d in range(num_docs):
        share = hay_total // num_docs + (hay_total % num_docs if d == num_docs - 1 else 0)
        hay = prose.excerpt(books[d], share, rng)
        ids += labels[d]
        inserts = sorted((prose.sentence_end_after(hay, rng.randrange(share + 1)), k)
                         for k in range(num_keys) if doc_of_key[k] == d)
        last = 0
        for at, k in inserts:
            ids += hay[last:at]
            positions[k] = len(ids)
            ids += needles[k]
            last = at
        ids += hay[last:]
    ids += frame.suffix
    order = [query] + [k for k in range(num_keys) if k != query]
    return LongCtxSample("multidoc", index, ids, numbers[query], positions[query] / len(ids),
                         [positions[k] for k in order], books, names[query], dict(zip(names, numbers)))


def build_samples(prose: AustenProse, task: str, num_tokens: int, num_samples: int, seed: int = 0,
                  prompt_format: str = "chat-prefill", num_docs: int = 4, num_keys: int = 4) -> list[LongCtxSample]:
    """`num_samples` samples of `task` (one of TASKS), each exactly `num_tokens` tokens.

    Raises:
        ValueError: unknown task, or as passkey_sample / multidoc_sample.
    """
    if task == "passkey":
        return [passkey_sample(prose, num_tokens, i, num_samples, seed, prompt_format) for i in range(num_samples)]
    if task == "multidoc":
        return [multidoc_sample(prose, num_tokens, i, num_docs, num_keys, seed, prompt_format)
                for i in range(num_samples)]
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")


_NUMBER = re.compile(r"\d+")


def extract_answer(text: str) -> str | None:
    """The first run of digits in a generated text (None if it has none)."""
    m = _NUMBER.search(text)
    return None if m is None else m.group(0)


def score(text: str, answer: str) -> bool:
    """Exact match: the first number of the generated text is `answer` (a longer or shorter run is wrong)."""
    return extract_answer(text) == answer


__all__ = ["PROMPT_FORMATS", "TASKS", "AustenProse", "LongCtxSample", "PromptFrame", "build_samples",
           "extract_answer", "multidoc_sample", "passkey_sample", "prompt_frame", "score"]
