"""A labelled question set of graded difficulty, for fitting and measuring routing by difficulty (issue 15).

Every item has a known answer and a checker, so a model's reply is graded without a judge model. Three
families, each in levels 1 (a 135M model usually answers) to 5 (a 1.5B model often fails too):

- arithmetic: one-digit sums ... three-digit products, and two- and three-step word problems;
- factual: capitals and well-known facts, from common to obscure (written for this set);
- code: what a short Python expression evaluates to.

`question_set()` builds the same items every time (a fixed seed); `split()` cuts them into disjoint train
(for fitting a difficulty estimator) and test (for the reported curve) parts, every template in both.
Torch-free and numpy-free, like the rest of loom.router.
"""

from __future__ import annotations

import random
import re
from dataclasses import asdict, dataclass
from typing import Any

ANSWER_KINDS = ("number", "text", "exact_text")  # how `check_answer` compares a reply with the answer
SPLITS = ("train", "test")
DEFAULT_SEED = 15  # the issue number; any fixed value gives a reproducible set


@dataclass(frozen=True, slots=True)
class Question:
    """One labelled item."""

    id: str  # unique, "<template>-<n>", e.g. "mul3x3-4"
    prompt: str  # the user message, with its answer-format instruction
    answer: str  # the canonical answer ("12", "Canberra", "ABC")
    accept: tuple[str, ...]  # every accepted form of the answer (the canonical one first)
    kind: str  # one of ANSWER_KINDS
    family: str  # "arithmetic" | "factual" | "code"
    template: str  # which generator made it (stratifies the split)
    level: int  # graded difficulty by construction, 1 (easy) .. 5 (hard)
    split: str  # one of SPLITS

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (accept as a list)."""
        d = asdict(self)
        d["accept"] = list(self.accept)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Question":
        """The inverse of to_dict. Raises ValueError (naming the field) for a missing or bad field."""
        for name in ("id", "prompt", "answer", "kind", "family", "template", "level", "split"):
            if name not in d:
                raise ValueError(f"question is missing field {name!r}: {d}")
        if d["kind"] not in ANSWER_KINDS:
            raise ValueError(f"kind must be one of {ANSWER_KINDS}, got {d['kind']!r}")
        if d["split"] not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {d['split']!r}")
        accept = tuple(d.get("accept") or (d["answer"],))
        return Question(str(d["id"]), str(d["prompt"]), str(d["answer"]), accept, d["kind"], d["family"],
                        d["template"], int(d["level"]), d["split"])


# ---------------------------------------------------------------- the answer checker

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def numbers_in(text: str) -> list[str]:
    """The numbers written in `text`, in order, normalized: thousands commas dropped, "12.0" -> "12"."""
    out = []
    for match in _NUMBER_RE.finditer(text):
        raw = match.group().replace(",", "").rstrip(".")
        if raw in ("", "-"):
            continue
        if "." in raw:
            raw = raw.rstrip("0").rstrip(".")
        out.append(raw)
    return out


def reply_number(prompt: str, reply: str) -> str | None:
    """The number a reply gives as its answer: the first number in it that is not one of the prompt's numbers
    (so "7 + 5 = 12" answers 12), else its first number ("2" answers "[4, 9, 2][2]"); None without numbers."""
    found = numbers_in(reply)
    if not found:
        return None
    echoed = set(numbers_in(prompt))
    fresh = [n for n in found if n not in echoed]
    return fresh[0] if fresh else found[0]


def check_answer(question: Question, reply: str) -> bool:
    """Whether `reply` answers `question` correctly.

    - number: the reply's answer number (see `reply_number`) equals one accepted form;
    - text: an accepted form occurs in the reply as whole words, ignoring case ("canberra." counts);
    - exact_text: as text but case-sensitive (code answers such as "ABC" against the prompt's "abc").
    """
    if question.kind == "number":
        got = reply_number(question.prompt, reply)
        return got is not None and got in {numbers_in(a)[0] if numbers_in(a) else a for a in question.accept}
    flags = re.IGNORECASE if question.kind == "text" else 0
    for form in question.accept:
        if re.search(r"(?<!\w)" + re.escape(form) + r"(?!\w)", reply, flags):
            return True
    return False


# ---------------------------------------------------------------- generators

_NUM = " Answer with just the number."
_WORD = " Answer in one or two words."
_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Farah", "Gus", "Hana", "Ivo", "Jade", "Kofi", "Lena")
_THINGS = ("apples", "marbles", "stickers", "pencils", "cards", "coins", "shells", "stamps")


def _arith(rng: random.Random, template: str) -> tuple[str, int]:
    """(prompt, answer) of one arithmetic item; operands are drawn so the answer is not one of them."""
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    if template == "add1":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"What is {a} + {b}?{_NUM}", a + b
    if template == "add2":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {a} + {b}?{_NUM}", a + b
    if template == "sub2":
        a = rng.randint(40, 99)
        b = rng.randint(11, a - 11)
        if a - b == b:
            b += 1
        return f"What is {a} - {b}?{_NUM}", a - b
    if template == "mul1":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} times {b}?{_NUM}", a * b
    if template == "add3":
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        return f"What is {a} + {b}?{_NUM}", a + b
    if template == "mul2x1":
        a, b = rng.randint(12, 99), rng.randint(3, 9)
        return f"What is {a} * {b}?{_NUM}", a * b
    if template == "mul2x2":
        a, b = rng.randint(12, 99), rng.randint(12, 99)
        return f"What is {a} * {b}?{_NUM}", a * b
    if template == "mul3x3":
        a, b = rng.randint(101, 999), rng.randint(101, 999)
        return f"What is {a} * {b}?{_NUM}", a * b
    if template == "word2":
        a, b, c = rng.randint(5, 30), rng.randint(2, 6), rng.randint(3, 9)
        return (f"{name} has {a} {thing}. {name} buys {b} bags with {c} {thing} in each bag. "
                f"How many {thing} does {name} have now?{_NUM}"), a + b * c
    if template == "word3":
        k = rng.randint(2, 5)
        b, c = rng.randint(2, 6), rng.randint(3, 9)
        total = rng.randint(3, 9) * k + b * c + rng.randint(1, 9)
        a = total - b * c
        d = total - (total // k) * k
        d = d if d > 0 else k
        share = (total - d) // k
        return (f"{name} has {a} {thing} and buys {b} packs of {c} {thing}. {name} then loses {d} of them and "
                f"shares the rest equally among {k} friends. How many {thing} does each friend get?{_NUM}"), share
    raise AssertionError(template)


# (country, capital, accepted alternative spellings): tiers by how often the pair appears in general text
_CAPITALS = {
    1: [("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"),
        ("Russia", "Moscow"), ("England", "London"), ("Egypt", "Cairo"), ("China", "Beijing"),
        ("Greece", "Athens"), ("Ireland", "Dublin"), ("Portugal", "Lisbon")],
    3: [("Australia", "Canberra"), ("Canada", "Ottawa"), ("Turkey", "Ankara"), ("Kenya", "Nairobi"),
        ("Peru", "Lima"), ("Norway", "Oslo"), ("Poland", "Warsaw"), ("Hungary", "Budapest"),
        ("Chile", "Santiago"), ("Vietnam", "Hanoi"), ("Finland", "Helsinki"), ("Colombia", "Bogota")],
    5: [("Burkina Faso", "Ouagadougou"), ("Kyrgyzstan", "Bishkek"), ("Bhutan", "Thimphu"),
        ("Eritrea", "Asmara"), ("Suriname", "Paramaribo"), ("Moldova", "Chisinau"), ("Laos", "Vientiane"),
        ("Malawi", "Lilongwe"), ("Mongolia", "Ulaanbaatar"), ("Tajikistan", "Dushanbe"),
        ("Gabon", "Libreville"), ("Lesotho", "Maseru")],
}
_ALIASES = {"Bogota": ("Bogotá",), "Chisinau": ("Chișinău", "Kishinev"), "Ulaanbaatar": ("Ulan Bator",),
            "Beijing": ("Peking",)}

# (question, answer, aliases) in tiers of obscurity
_FACTS = {
    1: [("What planet is known as the Red Planet?", "Mars", ()),
        ("What is the largest ocean on Earth?", "Pacific", ()),
        ("What color is the sky on a clear day?", "blue", ()),
        ("What animal is known as the king of the jungle?", "lion", ()),
        ("What gas do plants take in from the air to make food?", "carbon dioxide", ("CO2",)),
        ("What is frozen water called?", "ice", ()),
        ("Which planet do we live on?", "Earth", ()),
        ("What do bees make?", "honey", ()),
        ("What is the opposite of hot?", "cold", ()),
        ("Which star is at the center of our solar system?", "Sun", ())],
    3: [("Who wrote the play Romeo and Juliet?", "Shakespeare", ()),
        ("What is the chemical symbol for gold?", "Au", ()),
        ("Which planet is the largest in our solar system?", "Jupiter", ()),
        ("Who painted the Mona Lisa?", "Leonardo", ("da Vinci",)),
        ("What is the hardest natural substance?", "diamond", ()),
        ("Which element has the atomic number 1?", "hydrogen", ()),
        ("What is the longest river in South America?", "Amazon", ()),
        ("Which organ pumps blood through the human body?", "heart", ()),
        ("What language has the most native speakers in Brazil?", "Portuguese", ()),
        ("Who developed the theory of relativity?", "Einstein", ())],
    5: [("Who wrote the novel Middlemarch?", "George Eliot", ("Eliot",)),
        ("Which element has the chemical symbol Sb?", "antimony", ()),
        ("What is the capital city of the Canadian province of Manitoba?", "Winnipeg", ()),
        ("Which composer wrote the opera The Magic Flute?", "Mozart", ()),
        ("What is the largest moon of Saturn?", "Titan", ()),
        ("Which scientist first isolated radium, together with her husband?", "Marie Curie", ("Curie",)),
        ("What is the smallest bone in the human body?", "stapes", ("stirrup",)),
        ("Which mountain range separates Europe from Asia in Russia?", "Ural", ("Urals",)),
        ("What is the name of the longest river entirely within Germany?", "Weser", ()),
        ("Which philosopher wrote the Critique of Pure Reason?", "Kant", ())],
}


def _code(rng: random.Random, template: str) -> tuple[str, str, str]:
    """(prompt, answer, kind) of one code item."""
    words = ("hello", "router", "python", "cache", "token", "kernel", "stream", "replica", "model", "batch")
    if template == "code_len":
        w = rng.choice(words)
        return f"In Python, what does len('{w}') return?{_NUM}", str(len(w)), "number"
    if template == "code_div":
        a, b = rng.randint(20, 99), rng.randint(3, 9)
        op = rng.choice(("//", "%"))
        value = a // b if op == "//" else a % b
        return f"In Python, what does the expression {a} {op} {b} evaluate to?{_NUM}", str(value), "number"
    if template == "code_upper":
        w = rng.choice(words)
        return f"In Python, what string does '{w}'.upper() return? Answer with just the string.", w.upper(), \
            "exact_text"
    if template == "code_sumrange":
        n = rng.randint(4, 30)
        return f"In Python, what does sum(range({n})) return?{_NUM}", str(n * (n - 1) // 2), "number"
    if template == "code_slice":
        w = rng.choice(words)
        i = rng.randint(1, 3)
        return (f"In Python, what string does '{w}'[{i}:] return? Answer with just the string.", w[i:],
                "exact_text")
    raise AssertionError(template)


# (template, family, level, count); counts chosen for a few hundred items in all
ARITH_TEMPLATES = [("add1", 1, 24), ("add2", 2, 20), ("sub2", 2, 20), ("mul1", 2, 20), ("add3", 3, 20),
                   ("mul2x1", 3, 20), ("mul2x2", 4, 20), ("word2", 4, 20), ("word3", 5, 20), ("mul3x3", 5, 16)]
CODE_TEMPLATES = [("code_len", 2, 12), ("code_upper", 2, 12), ("code_div", 3, 12), ("code_slice", 4, 12),
                  ("code_sumrange", 5, 12)]


def question_set(seed: int = DEFAULT_SEED, test_fraction: float = 0.4) -> list[Question]:
    """Every item of the set, deterministic for a given `seed`; `split()` below assigns train/test.

    Raises:
        ValueError: test_fraction is not in (0, 1).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    rng = random.Random(seed)
    raw: list[dict[str, Any]] = []
    for template, level, count in ARITH_TEMPLATES:
        seen: set[str] = set()
        while len([r for r in raw if r["template"] == template]) < count:
            prompt, value = _arith(rng, template)
            if prompt in seen:
                continue
            seen.add(prompt)
            raw.append({"prompt": prompt, "answer": str(value), "accept": (str(value),), "kind": "number",
                        "family": "arithmetic", "template": template, "level": level})
    for level, pairs in _CAPITALS.items():
        for country, capital in pairs:
            raw.append({"prompt": f"What is the capital of {country}?{_WORD}", "answer": capital,
                        "accept": (capital, *_ALIASES.get(capital, ())), "kind": "text", "family": "factual",
                        "template": f"capital{level}", "level": level})
    for level, facts in _FACTS.items():
        for question, answer, aliases in facts:
            raw.append({"prompt": question + _WORD, "answer": answer, "accept": (answer, *aliases), "kind": "text",
                        "family": "factual", "template": f"fact{level}", "level": level})
    for template, level, count in CODE_TEMPLATES:
        seen = set()
        tries = 0
        while len([r for r in raw if r["template"] == template]) < count and tries < 1000:
            tries += 1
            prompt, answer, kind = _code(rng, template)
            if prompt in seen:
                continue
            seen.add(prompt)
            raw.append({"prompt": prompt, "answer": answer, "accept": (answer,), "kind": kind, "family": "code",
                        "template": template, "level": level})
    return split(raw, rng, test_fraction)


def split(raw: list[dict[str, Any]], rng: random.Random, test_fraction: float) -> list[Question]:
    """Numbers the items per template and marks round(test_fraction x count) of each template, drawn by
    `rng`, as test, the rest as train: disjoint parts with every template in both."""
    by_template: dict[str, list[dict[str, Any]]] = {}
    for item in raw:
        by_template.setdefault(item["template"], []).append(item)
    out = []
    for template, items in by_template.items():
        test_idx = set(rng.sample(range(len(items)), max(1, round(test_fraction * len(items)))))
        for i, item in enumerate(items):
            out.append(Question(id=f"{template}-{i}", prompt=item["prompt"], answer=item["answer"],
                                accept=tuple(item["accept"]), kind=item["kind"], family=item["family"],
                                template=template, level=item["level"],
                                split="test" if i in test_idx else "train"))
    return out


__all__ = ["ANSWER_KINDS", "DEFAULT_SEED", "Question", "SPLITS", "check_answer", "numbers_in", "question_set",
           "reply_number", "split"]
