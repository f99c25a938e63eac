"""Routing by difficulty and length across models (issue 15): model selectors for a routing alias such as "auto".

RouteLLM (Ong et al. 2024, "RouteLLM: Learning to Route LLMs with Preference Data") frames the choice as a
router that scores each query and a threshold that trades quality for cost: a query goes to the strong (large,
costly) model when its score says the weak (small) model would likely fail. Here the score is cheap and
torch-free, computed from the prompt text in the router process:

- `length`: long prompts go to the large model (or to an instance configured for long contexts);
- `difficulty`: a logistic regression on cheap text features (length, numbers and their magnitudes,
  operators, question words, code tokens) estimating P(the small model suffices), fitted on a labelled
  question set (loom/router/difficulty_set.py; benchmarks/difficulty_routing.py fits and measures it) and
  shipped as loom/router/data/difficulty_weights.json; `threshold` is the cost/quality knob. "Suffices" is
  RouteLLM's binary label: the small model is right, or the large one is wrong too. A label of "the small model
  is right" alone sends the hardest requests to the large model, which fails most of them as well; on the
  measured set that router did worse than random at half the cost (benchmarks/NOTES.md);
- `random`: a fixed fraction to the large model, the baseline any estimator must beat.

The small model's own confidence on a short draft (mean logprob of its first tokens) is evaluated offline in
benchmarks/difficulty_routing.py only: it needs a request to the small replica before the choice, which the
router's synchronous `select` does not make.

Options come in the factory's dict: `small` / `large` (model ids; when absent, the smallest and largest by the
parameter count written in the ids, e.g. "135M" < "1.5B"), `threshold`, and for every selector `long` (model
id of an instance for long contexts) with `long_threshold` (prompt characters above which it is used).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Sequence

from loom.router.policy import RouteRequest, register_model_selector

WEIGHTS_RESOURCE = ("loom.router", "data/difficulty_weights.json")

# ---------------------------------------------------------------- features

_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?")
_WORD_RE = re.compile(r"[A-Za-z_]+")
_MUL_RE = re.compile(r"\*|\btimes\b|\bmultipl|\bproduct\b|\beach\b|\bper\b|\bpacks? of\b", re.IGNORECASE)
_ADD_RE = re.compile(r"\+|\bplus\b|\bsum\b|\btotal\b|\bbuys?\b|\bmore\b", re.IGNORECASE)
_SUB_RE = re.compile(r"(?<![\w])-(?=\s*\d)|\bminus\b|\bloses?\b|\bgives? away\b|\bleft\b", re.IGNORECASE)
_DIV_RE = re.compile(r"//|%|/|\bdivided\b|\bequally\b|\bshares?\b|\bsplit\b", re.IGNORECASE)
_CODE_RE = re.compile(r"\b(?:python|def|return|len|range|lambda|print|import|class)\b|\w+\(|\.\w+\(|\[\d*:\d*\]",
                      re.IGNORECASE)
_WH_RE = re.compile(r"\b(?:what|who|which|where|when|why)\b", re.IGNORECASE)

FEATURE_NAMES = (
    "log_chars",  # log(1 + characters of the prompt)
    "log_words",  # log(1 + words)
    "sentences",  # sentence ends ('.', '?', '!') followed by space or end
    "num_numbers",  # how many numbers are written
    "num_digits",  # digits in all numbers
    "max_digits",  # digits of the longest number
    "mul_digits",  # with a multiplication: digits of its two longest numbers together, else 0
    "has_mul",  # a multiplication (symbol or word)
    "has_add",
    "has_sub",
    "has_div",
    "num_ops",  # how many of the four kinds of operation
    "code_tokens",  # code-like tokens: keywords, calls, slices
    "quotes",  # quote characters (string literals)
    "wh_words",  # what / who / which / where / when / why
    "proper_nouns",  # capitalized words not at a sentence start
    "proper_noun_len",  # mean letters of those words (long, rare names are harder to recall)
)


def text_features(text: str) -> list[float]:
    """The difficulty features of a prompt text, in FEATURE_NAMES order (floats, unscaled). Pure Python, O(len)."""
    numbers = _NUMBER_RE.findall(text)
    lengths = sorted((len(n.replace(".", "")) for n in numbers), reverse=True)
    words = _WORD_RE.findall(text)
    ops = [bool(r.search(text)) for r in (_MUL_RE, _ADD_RE, _SUB_RE, _DIV_RE)]
    proper = [m.group(1) for m in re.finditer(r"(?<![.?!]\s)(?<!^)\b([A-Z][a-z]+)", text)]
    return [
        math.log1p(len(text)),
        math.log1p(len(words)),
        float(len(re.findall(r"[.?!](?:\s|$)", text))),
        float(len(numbers)),
        float(sum(lengths)),
        float(lengths[0] if lengths else 0),
        float(sum(lengths[:2]) if ops[0] else 0),
        *(float(o) for o in ops),
        float(sum(ops)),
        float(len(_CODE_RE.findall(text))),
        float(text.count("'") + text.count('"')),
        float(len(_WH_RE.findall(text))),
        float(len(proper)),
        (sum(len(w) for w in proper) / len(proper)) if proper else 0.0,
    ]


# ---------------------------------------------------------------- logistic regression

@dataclass(frozen=True, slots=True)
class LogisticModel:
    """P(label = 1 | features) = sigmoid(bias + sum(weights * (x - mean) / scale)); the shipped label is "the small
    model suffices" (meta["label"] says which)."""

    feature_names: tuple[str, ...]  # must equal FEATURE_NAMES when used on text_features
    mean: tuple[float, ...]  # per-feature mean on the train split
    scale: tuple[float, ...]  # per-feature standard deviation on the train split (1 where constant)
    weights: tuple[float, ...]  # per standardized feature
    bias: float  # log-odds at the mean
    meta: dict[str, Any]  # how it was fitted (data, l2, iterations, train accuracy)

    def probability(self, features: Sequence[float]) -> float:
        """P(label = 1) for one feature vector (unscaled, FEATURE_NAMES order), in [0, 1]."""
        z = self.bias + sum(w * (x - m) / s for w, x, m, s in zip(self.weights, features, self.mean, self.scale))
        return 1.0 / (1.0 + math.exp(-z)) if z > -60 else 0.0

    def to_json(self) -> str:
        """The shipped weights file's text."""
        return json.dumps({"feature_names": list(self.feature_names), "mean": list(self.mean),
                           "scale": list(self.scale), "weights": list(self.weights), "bias": self.bias,
                           "meta": self.meta}, indent=1)

    @staticmethod
    def from_json(text: str) -> "LogisticModel":
        """Parse a weights file. Raises ValueError (naming `weights`) if it does not fit FEATURE_NAMES."""
        d = json.loads(text)
        names = tuple(d.get("feature_names", ()))
        if names != FEATURE_NAMES:
            raise ValueError(f"weights: features {names} do not match this loom's {FEATURE_NAMES}")
        for key in ("mean", "scale", "weights"):
            if len(d.get(key, ())) != len(names):
                raise ValueError(f"weights: {key!r} needs {len(names)} values")
        return LogisticModel(names, tuple(d["mean"]), tuple(d["scale"]), tuple(d["weights"]), float(d["bias"]),
                             dict(d.get("meta", {})))


def fit_logistic(rows: Sequence[Sequence[float]], labels: Sequence[int], l2: float = 0.1,
                 iterations: int = 3000, learning_rate: float = 0.5) -> LogisticModel:
    """Fit P(label = 1 | x) by full-batch gradient descent on the mean log loss plus l2/2 * |w|^2 (bias not
    penalized), on standardized features. Pure Python: sized for a few hundred rows.

    Raises:
        ValueError: rows and labels differ in length, are empty, or labels are not 0/1 (naming them).
    """
    if len(rows) != len(labels) or not rows:
        raise ValueError(f"rows and labels must be non-empty and equal in length, got {len(rows)}, {len(labels)}")
    if any(y not in (0, 1) for y in labels):
        raise ValueError("labels must be 0 or 1")
    n, d = len(rows), len(rows[0])
    mean = [sum(r[j] for r in rows) / n for j in range(d)]
    scale = [math.sqrt(sum((r[j] - mean[j]) ** 2 for r in rows) / n) or 1.0 for j in range(d)]
    xs = [[(r[j] - mean[j]) / scale[j] for j in range(d)] for r in rows]
    w, b = [0.0] * d, 0.0
    for _ in range(iterations):
        grad_w, grad_b = [l2 * wj for wj in w], 0.0
        for x, y in zip(xs, labels):
            z = b + sum(wj * xj for wj, xj in zip(w, x))
            p = 1.0 / (1.0 + math.exp(-max(min(z, 60.0), -60.0)))
            err = (p - y) / n
            grad_b += err
            for j in range(d):
                grad_w[j] += err * x[j]
        w = [wj - learning_rate * g for wj, g in zip(w, grad_w)]
        b -= learning_rate * grad_b
    model = LogisticModel(FEATURE_NAMES if d == len(FEATURE_NAMES) else tuple(f"x{j}" for j in range(d)),
                          tuple(mean), tuple(scale), tuple(w), b, {"l2": l2, "iterations": iterations, "rows": n})
    return model


def load_shipped_weights() -> LogisticModel:
    """The classifier fitted by benchmarks/difficulty_routing.py fit (loom/router/data/difficulty_weights.json)."""
    package, name = WEIGHTS_RESOURCE
    return LogisticModel.from_json(resources.files(package).joinpath(name).read_text())


# ---------------------------------------------------------------- choosing the model ids

_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([MmBb])(?![a-zA-Z])")


def parameter_count(model_id: str) -> float | None:
    """The parameter count written in a model id ("SmolLM2-135M" -> 1.35e8, "Qwen2.5-1.5B" -> 1.5e9), or None."""
    found = _SIZE_RE.findall(model_id)
    if not found:
        return None
    value, unit = found[-1]
    return float(value) * (1e6 if unit in "Mm" else 1e9)


@dataclass(frozen=True, slots=True)
class ModelPair:
    """The small and large model ids of a selector (None: inferred from the served ids at select time)."""

    small: str | None  # model id for easy requests
    large: str | None  # model id for hard requests
    long: str | None  # model id of an instance configured for long contexts (None: the large model)
    long_threshold: int | None  # prompt characters above which `long` is used (None: never)

    def resolve(self, models: Sequence[str]) -> tuple[str, str]:
        """(small, large) among `models`: the configured ids when served, else the smallest and largest by the
        parameter count in their ids (ids without one sort after those with, in the given order)."""
        ranked = sorted(models, key=lambda m: (parameter_count(m) is None, parameter_count(m) or 0.0))
        small = self.small if self.small in models else ranked[0]
        large = self.large if self.large in models else ranked[-1]
        return small, large

    def long_choice(self, request: RouteRequest, models: Sequence[str]) -> str | None:
        """The long-context model when the prompt is past long_threshold (and some such instance is served)."""
        if self.long_threshold is None or len(request.text) <= self.long_threshold:
            return None
        if self.long is not None and self.long in models:
            return self.long
        return self.resolve(models)[1]


_COMMON_OPTIONS = ("small", "large", "long", "long_threshold")


def _options(options: dict[str, Any], allowed: tuple[str, ...]) -> ModelPair:
    """The ModelPair of `options`; raises ValueError naming an unknown option or a bad value."""
    for key in options:
        if key not in allowed + _COMMON_OPTIONS:
            raise ValueError(f"model selector option {key!r} is unknown; known: {sorted(allowed + _COMMON_OPTIONS)}")
    for key in ("small", "large", "long"):
        if options.get(key) is not None and not isinstance(options[key], str):
            raise ValueError(f"{key} must be a model id (string), got {options[key]!r}")
    long_threshold = options.get("long_threshold")
    if long_threshold is not None:
        long_threshold = _number(long_threshold, "long_threshold", 0, None, integer=True)
    return ModelPair(options.get("small"), options.get("large"), options.get("long"), long_threshold)


def _number(value: Any, name: str, low: float | None, high: float | None, integer: bool = False) -> Any:
    """`value` as a number in [low, high]; raises ValueError naming `name` otherwise."""
    try:
        number = float(value)  # options may arrive as strings (--model-selector-option KEY=VALUE)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if isinstance(value, bool) or math.isnan(number):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if integer:
        if not number.is_integer():
            raise ValueError(f"{name} must be an integer, got {value!r}")
        number = int(number)
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name} must be in [{low}, {high if high is not None else 'inf'}], got {value!r}")
    return number


# ---------------------------------------------------------------- selectors

class LengthSelector:
    """Prompts longer than `threshold` characters go to the large model, shorter ones to the small one."""

    name = "length"

    def __init__(self, options: dict[str, Any]) -> None:
        self.models = _options(options, ("threshold",))
        self.threshold = _number(options.get("threshold", 2000), "threshold", 0, None, integer=True)

    def score(self, text: str) -> float:
        """The difficulty score: prompt characters (higher = send to the large model)."""
        return float(len(text))

    def select(self, request: RouteRequest, models: Sequence[str]) -> str:
        """The model for `request` among `models` (non-empty)."""
        long = self.models.long_choice(request, models)
        if long is not None:
            return long
        small, large = self.models.resolve(models)
        return large if self.score(request.text) > self.threshold else small


class DifficultySelector:
    """Feature-based classifier: the large model when P(small model suffices) < `threshold` (the cost/quality
    knob: 0 sends nothing to the large model, 1 everything; its default is the weights' meta "default_threshold",
    chosen when they were fitted); prompts over `max_small_chars` go large too."""

    name = "difficulty"

    def __init__(self, options: dict[str, Any]) -> None:
        self.models = _options(options, ("threshold", "weights", "max_small_chars"))
        max_chars = options.get("max_small_chars")
        self.max_small_chars = None if max_chars is None else _number(max_chars, "max_small_chars", 0, None, True)
        weights = options.get("weights")
        if weights is None:
            self.classifier = load_shipped_weights()
        elif isinstance(weights, LogisticModel):
            self.classifier = weights
        elif isinstance(weights, str):
            try:
                with open(weights) as f:
                    self.classifier = LogisticModel.from_json(f.read())
            except OSError as e:
                raise ValueError(f"weights: cannot read {weights!r}: {e}") from None
        else:
            raise ValueError(f"weights must be a path or a LogisticModel, got {type(weights).__name__}")
        # the default knob is the one fitted with the weights (the cheapest train point at 90% of all-large accuracy)
        default = self.classifier.meta.get("default_threshold", 0.5)
        self.threshold = _number(options.get("threshold", default), "threshold", 0.0, 1.0)

    def p_small_suffices(self, text: str) -> float:
        """The classifier's P(the small model's answer to `text` is as good as the large model's)."""
        return self.classifier.probability(text_features(text))

    def score(self, text: str) -> float:
        """The difficulty score, 1 - P(small suffices): the request goes large when score > 1 - threshold."""
        return 1.0 - self.p_small_suffices(text)

    def select(self, request: RouteRequest, models: Sequence[str]) -> str:
        """The model for `request` among `models` (non-empty)."""
        long = self.models.long_choice(request, models)
        if long is not None:
            return long
        small, large = self.models.resolve(models)
        if self.max_small_chars is not None and len(request.text) > self.max_small_chars:
            return large
        return large if self.p_small_suffices(request.text) < self.threshold else small


class RandomSelector:
    """A `fraction` of requests to the large model, chosen by a hash of (seed, text): the baseline."""

    name = "random"

    def __init__(self, options: dict[str, Any]) -> None:
        self.models = _options(options, ("fraction", "seed"))
        self.fraction = _number(options.get("fraction", 0.5), "fraction", 0.0, 1.0)
        self.seed = str(options.get("seed", 0))

    def score(self, text: str) -> float:
        """A uniform pseudo-random number in [0, 1) fixed by the text (the same prompt goes the same way)."""
        digest = hashlib.blake2b(f"{self.seed}\0{text}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") / 2.0**64

    def select(self, request: RouteRequest, models: Sequence[str]) -> str:
        """The model for `request` among `models` (non-empty)."""
        long = self.models.long_choice(request, models)
        if long is not None:
            return long
        small, large = self.models.resolve(models)
        return large if self.score(request.text) < self.fraction else small


register_model_selector("length", LengthSelector)
register_model_selector("difficulty", DifficultySelector)
register_model_selector("random", RandomSelector)

__all__ = ["FEATURE_NAMES", "DifficultySelector", "LengthSelector", "LogisticModel", "ModelPair", "RandomSelector",
           "fit_logistic", "load_shipped_weights", "parameter_count", "text_features"]
