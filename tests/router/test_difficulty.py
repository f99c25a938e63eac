"""Routing by difficulty (issue 15): features, selectors and their registry, the question set, the checker and
the quality/cost curve. No model runs here; benchmarks/difficulty_routing.py measures the real curve."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loom.router.difficulty import (FEATURE_NAMES, DifficultySelector, LogisticModel, fit_logistic,
                                    load_shipped_weights, parameter_count, text_features)
from loom.router.difficulty_curve import (Outcome, best_within, cheapest_reaching, oracle_point, random_curve,
                                          route_point, sweep)
from loom.router.difficulty_set import Question, check_answer, numbers_in, question_set, reply_number
from loom.router.policy import RouteRequest, make_model_selector

SMALL, LARGE = "SmolLM2-135M-Instruct", "Qwen2.5-Coder-1.5B-Instruct"
MODELS = [LARGE, SMALL]


def req(text: str) -> RouteRequest:
    return RouteRequest(path="/v1/chat/completions", model="auto", text=text, body={})


def feature(text: str, name: str) -> float:
    return text_features(text)[FEATURE_NAMES.index(name)]


# ---------------------------------------------------------------- features and the classifier

def test_features_see_numbers_operators_and_code() -> None:
    assert len(text_features("hi")) == len(FEATURE_NAMES)
    assert feature("What is 347 * 286?", "mul_digits") == 6
    assert feature("What is 3 + 4?", "mul_digits") == 0
    assert feature("What is 3 + 4?", "has_add") == 1 and feature("What is 3 + 4?", "has_mul") == 0
    assert feature("What is 12345 + 6?", "max_digits") == 5
    assert feature("In Python, what does len('abc') return?", "code_tokens") >= 2
    assert feature("What is the capital of Burkina Faso?", "proper_nouns") == 2
    assert feature("x" * 100, "log_chars") > feature("x" * 10, "log_chars")


def test_fit_logistic_separates_and_round_trips() -> None:
    rows = [[float(x), 1.0] for x in range(20)]
    labels = [int(x < 10) for x in range(20)]
    model = fit_logistic(rows, labels, l2=0.01, iterations=500)
    assert model.probability([2.0, 1.0]) > 0.8 > 0.2 > model.probability([17.0, 1.0])
    with pytest.raises(ValueError, match="labels"):
        fit_logistic(rows, [2] * 20)
    with pytest.raises(ValueError, match="rows"):
        fit_logistic(rows, labels[:3])


def test_shipped_weights_load_and_rank_hard_above_easy() -> None:
    model = load_shipped_weights()
    assert model.feature_names == FEATURE_NAMES
    again = LogisticModel.from_json(model.to_json())
    assert again.weights == model.weights
    selector = DifficultySelector({})
    assert selector.threshold == model.meta["default_threshold"]
    # label "small suffices": the small model knows France's capital; the large one helps on two-digit
    # subtraction (the small one fails it) but not on three-digit products (both fail), so those stay small
    easy = selector.p_small_suffices("What is the capital of France? Answer in one or two words.")
    helped = selector.p_small_suffices("What is 84 - 37? Answer with just the number.")
    hopeless = selector.p_small_suffices("What is 734 * 918? Answer with just the number.")
    assert easy > helped < hopeless
    with pytest.raises(ValueError, match="weights"):
        LogisticModel.from_json('{"feature_names": ["a"], "mean": [0], "scale": [1], "weights": [0], "bias": 0}')


# ---------------------------------------------------------------- selectors

def test_registry_makes_every_selector_and_refuses_unknown_names() -> None:
    for name in ("length", "difficulty", "random"):
        selector = make_model_selector(name, {"small": SMALL, "large": LARGE})
        assert selector.name == name
        assert selector.select(req("What is 2 + 2?"), MODELS) in MODELS
    with pytest.raises(ValueError, match="model_selector"):
        make_model_selector("no-such-selector")


@pytest.mark.parametrize("options, name", [({"threshold": 2.0}, "threshold"), ({"threshold": "x"}, "threshold"),
                                           ({"small": 3}, "small"), ({"thresold": 0.5}, "thresold"),
                                           ({"weights": "/no/such/file.json"}, "weights"),
                                           ({"long_threshold": -1}, "long_threshold"),
                                           ({"max_small_chars": "12.5"}, "max_small_chars"),
                                           ({"threshold": True}, "threshold")])
def test_bad_options_raise_value_error_naming_them(options: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make_model_selector("difficulty", options)


def test_options_may_be_strings_as_the_cli_passes_them() -> None:
    options = {"threshold": "1", "max_small_chars": "4000", "long_threshold": "9000"}
    selector = make_model_selector("difficulty", options)
    assert selector.threshold == 1.0 and selector.max_small_chars == 4000 and selector.models.long_threshold == 9000
    assert selector.select(req("What is 2 + 2?"), MODELS) == LARGE


def test_length_selector_threshold() -> None:
    selector = make_model_selector("length", {"small": SMALL, "large": LARGE, "threshold": 50})
    assert selector.select(req("short"), MODELS) == SMALL
    assert selector.select(req("x" * 51), MODELS) == LARGE


def test_long_contexts_go_to_the_long_instance() -> None:
    models = [SMALL, LARGE, "Qwen2.5-Coder-1.5B-Instruct-32k"]
    knobs = {"length": {"threshold": 10**6}, "difficulty": {"threshold": 0.0}, "random": {"fraction": 0.0}}
    for name, knob in knobs.items():
        selector = make_model_selector(name, {"small": SMALL, "large": LARGE, "long": models[2],
                                              "long_threshold": 100, **knob})
        assert selector.select(req("y" * 101), models) == models[2]
        assert selector.select(req("What is 2 + 2?"), models) == SMALL


def test_models_are_inferred_from_parameter_counts_and_fall_back_when_absent() -> None:
    assert parameter_count("SmolLM2-135M-Instruct") == 135e6
    assert parameter_count("Qwen2.5-Coder-1.5B-Instruct") == 1.5e9
    assert parameter_count("mystery") is None
    selector = make_model_selector("length", {"threshold": 10})
    assert selector.select(req("tiny"), MODELS) == SMALL
    assert selector.select(req("a long enough prompt"), MODELS) == LARGE
    configured = make_model_selector("length", {"small": "gone-135M", "large": LARGE, "threshold": 10})
    assert configured.select(req("tiny"), [LARGE]) == LARGE  # the only model served


def test_thresholds_are_monotonic() -> None:
    texts = [q.prompt for q in question_set() if q.split == "test"]
    previous = -1
    for threshold in (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0):
        selector = make_model_selector("difficulty", {"small": SMALL, "large": LARGE, "threshold": threshold})
        large = sum(selector.select(req(t), MODELS) == LARGE for t in texts)
        assert large >= previous
        previous = large
    assert previous == len(texts)
    counts = [sum(make_model_selector("random", {"fraction": f}).select(req(t), MODELS) == LARGE for t in texts)
              for f in (0.0, 0.25, 0.5, 1.0)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == len(texts)
    assert 0.35 < counts[2] / len(texts) < 0.65


def test_router_module_does_not_import_torch() -> None:
    script = ("import sys, loom.router.difficulty, loom.router.difficulty_set, loom.router.difficulty_curve\n"
              "heavy = ('torch.', 'loom.model', 'loom.worker')\n"
              "bad = [m for m in sys.modules if m == 'torch' or m.startswith(heavy)]\n"
              "sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the question set and its checker

def test_question_set_is_deterministic_and_splits_are_disjoint() -> None:
    first, second = question_set(), question_set()
    assert first == second
    ids = [q.id for q in first]
    assert len(ids) == len(set(ids))
    train = {q.prompt for q in first if q.split == "train"}
    test = {q.prompt for q in first if q.split == "test"}
    assert train and test and not train & test
    assert {q.template for q in first if q.split == "train"} == {q.template for q in first if q.split == "test"}
    assert {q.level for q in first} == {1, 2, 3, 4, 5}
    assert 200 <= len(first) <= 500
    assert all(Question.from_dict(q.to_dict()) == q for q in first)
    with pytest.raises(ValueError, match="test_fraction"):
        question_set(test_fraction=1.0)


def test_every_answer_passes_its_own_checker() -> None:
    for q in question_set():
        assert check_answer(q, q.answer), q
        assert check_answer(q, f"The answer is {q.answer}."), q


def make_q(kind: str, prompt: str, answer: str, *accept: str) -> Question:
    return Question("t-0", prompt, answer, (answer, *accept), kind, "x", "t", 1, "test")


def test_number_checker_reads_the_answer_not_the_echo() -> None:
    q = make_q("number", "What is 7 + 5?", "12")
    assert check_answer(q, "7 + 5 = 12")
    assert check_answer(q, "**12**")
    assert not check_answer(q, "7 + 5 = 13. Then 12 more.")
    assert not check_answer(q, "I cannot say.")
    big = make_q("number", "What is 347 * 286?", "99242")
    assert check_answer(big, "347 * 286 = 99,242")
    assert not check_answer(big, "94,022")
    assert numbers_in("1,234 and 5.0 and 2.50") == ["1234", "5", "2.5"]
    assert reply_number("[4, 9, 2][2]", "2") == "2"


def test_text_checker_is_whole_word_and_case_rules() -> None:
    q = make_q("text", "What is the capital of Australia?", "Canberra")
    assert check_answer(q, "The capital of Australia is canberra.")
    assert not check_answer(q, "Sydney")
    au = make_q("text", "What is the chemical symbol for gold?", "Au")
    assert check_answer(au, "Au")
    assert not check_answer(au, "Because it is gold")  # "au" inside a word does not count
    code = make_q("exact_text", "What does 'abc'.upper() return?", "ABC")
    assert check_answer(code, "'ABC'")
    assert not check_answer(code, "abc")


# ---------------------------------------------------------------- the curve

def synthetic() -> tuple[list[float], list[Outcome]]:
    # four questions: easy ones the small model gets, hard ones only the large one gets
    outcomes = [Outcome(True, True, 1.0, 10.0), Outcome(True, True, 1.0, 10.0),
                Outcome(False, True, 2.0, 12.0), Outcome(False, False, 2.0, 12.0)]
    return [0.1, 0.2, 0.9, 0.8], outcomes


def test_sweep_goes_from_all_small_to_all_large() -> None:
    scores, outcomes = synthetic()
    points = sweep(scores, outcomes)
    assert points[0].frac_large == 0.0 and points[0].accuracy == 0.5 and points[0].seconds == 6.0
    assert points[-1].frac_large == 1.0 and points[-1].accuracy == 0.75 and points[-1].seconds == 44.0
    assert [p.frac_large for p in points] == sorted(p.frac_large for p in points)
    one = route_point(scores, outcomes, 0.9)  # only the third question goes large
    assert (one.frac_large, one.accuracy, one.seconds) == (0.25, 0.75, 1.0 + 1.0 + 12.0 + 2.0)
    assert best_within(points, 16.0) == one
    assert cheapest_reaching(points, 0.75) == one
    assert cheapest_reaching(points, 0.9) is None
    best = oracle_point(outcomes)
    assert (best.frac_large, best.accuracy, best.seconds) == (one.frac_large, one.accuracy, one.seconds)
    with pytest.raises(ValueError, match="scores"):
        route_point(scores[:2], outcomes, 0.5)


def test_overhead_and_random_curve() -> None:
    scores, outcomes = synthetic()
    with_draft = [Outcome(o.small_correct, o.large_correct, o.small_seconds, o.large_seconds, 0.5) for o in outcomes]
    assert route_point(scores, with_draft, 0.0).seconds == 44.0 + 4 * 0.5
    line = random_curve(outcomes, steps=2)
    assert [p.accuracy for p in line] == [0.5, 0.625, 0.75]
    assert [p.seconds for p in line] == [6.0, 25.0, 44.0]
