"""Sampler behaviour on small hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from loom.sample.penalties import apply_all
from loom.sample.sampler import SamplingInput, compute_token_logprobs, sample, truncated_probs
from loom.sampling_params import SamplingParams

VOCAB = 8
EOS = frozenset({7})


def make_input(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: frozenset[int] = EOS,
    **params: object,
) -> SamplingInput:
    sp = SamplingParams(**params)  # type: ignore[arg-type]
    return SamplingInput(sp, list(prompt or []), list(output or []), eos)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn((rows, vocab), generator=gen(seed)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits(5, vocab=50)
    out = sample(logits, [make_input(temperature=0.0) for _ in range(5)], gen())
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_truncation_to_one_token_equals_greedy(params: dict[str, float]) -> None:
    logits = random_logits(6, vocab=40, seed=1)
    for draw in range(5):
        out = sample(logits, [make_input(temperature=1.5, **params) for _ in range(6)], gen(draw))
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_keeps_exactly_k_tokens() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 3.0, -1.0, -2.0]])
    probs = truncated_probs(logits, [SamplingParams(top_k=3)])
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {1, 3, 5}
    expected = torch.softmax(torch.tensor([5.0, 4.0, 3.0]), dim=0)
    assert torch.allclose(probs[0, [1, 3, 5]], expected)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log().unsqueeze(0)
    # 0.5 < 0.6 so the second token is needed; 0.5 + 0.3 >= 0.6 so the third is not.
    probs = truncated_probs(logits, [SamplingParams(top_p=0.6)])
    assert torch.allclose(probs[0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = truncated_probs(logits, [SamplingParams(top_p=0.8)])  # exactly reached by two tokens
    assert torch.count_nonzero(probs[0]).item() in (2, 3)  # float rounding of 0.5 + 0.3 either side
    probs = truncated_probs(logits, [SamplingParams(top_p=0.81)])
    assert torch.count_nonzero(probs[0]).item() == 3


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    base = torch.tensor([0.4, 0.3, 0.2, 0.1])
    probs = truncated_probs(base.log().unsqueeze(0), [SamplingParams(min_p=0.45)])
    # threshold 0.45 * 0.4 = 0.18: token 3 (0.1) dropped, token 2 (0.2) kept
    assert torch.allclose(probs[0], torch.tensor([4 / 9, 3 / 9, 2 / 9, 0.0]), atol=1e-6)


def test_temperature_scales_distribution() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    for temperature in (0.5, 1.0, 2.0):
        probs = truncated_probs(logits, [SamplingParams(temperature=temperature)])
        assert torch.allclose(probs[0], torch.softmax(logits[0] / temperature, dim=0))


def test_temperature_one_sampling_matches_softmax() -> None:
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7])
    draws = 4000
    batch = logits.unsqueeze(0).expand(draws, VOCAB).contiguous()
    out = sample(batch, [make_input(eos=frozenset()) for _ in range(draws)], gen(123))
    freq = torch.bincount(out.sampled_token_ids, minlength=VOCAB).float() / draws
    expected = torch.softmax(logits, dim=0)
    # 5 standard errors of a binomial proportion: fails by chance with probability ~1e-6 per token
    tolerance = 5 * torch.sqrt(expected * (1 - expected) / draws)
    assert torch.all((freq - expected).abs() <= tolerance), (freq, expected)


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0, 0.0, 0.0]])
    inp = make_input(prompt=[0, 1], output=[2, 2], temperature=0.0, repetition_penalty=2.0, logprobs=0)
    out = sample(logits, [inp], gen())
    processed = torch.tensor([1.0, -4.0, 0.5, -1.0, 0.5, 3.0, 0.0, 0.0])
    assert out.sampled_token_ids.item() == int(processed.argmax())
    # logprobs stay raw
    assert math.isclose(out.logprobs[0].logprobs[0], torch.log_softmax(logits[0], 0)[5].item(), rel_tol=1e-6)
    # check the processed logits exactly via a penalty large enough to flip the argmax
    logits2 = torch.tensor([[3.0, 2.5, 0, 0, 0, 0, 0, 0]])
    flip = sample(logits2, [make_input(prompt=[0], temperature=0.0, repetition_penalty=1.5)], gen())
    assert flip.sampled_token_ids.item() == 1  # 3 / 1.5 = 2 < 2.5


def test_presence_and_frequency_penalties_hand_computed() -> None:
    logits = torch.zeros((1, VOCAB))
    inp = make_input(prompt=[4, 4, 4], output=[1, 1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    processed = logits.clone()
    apply_all(processed, [inp])
    expected = torch.zeros(VOCAB)
    expected[1] = -(3 * 0.25 + 0.5)
    expected[2] = -(1 * 0.25 + 0.5)
    assert torch.equal(processed[0], expected)  # prompt token 4 untouched


def test_logit_bias_adds_to_named_tokens() -> None:
    logits = random_logits(2)
    processed = logits.clone()
    apply_all(processed, [make_input(logit_bias={3: 10.0, 5: -100.0}), make_input()])
    expected = logits.clone()
    expected[0, 3] += 10.0
    expected[0, 5] -= 100.0
    assert torch.equal(processed, expected)
    greedy = sample(logits[:1], [make_input(temperature=0.0, logit_bias={6: 100.0})], gen())
    assert greedy.sampled_token_ids.item() == 6


def test_logit_bias_out_of_vocab_raises() -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        sample(random_logits(1), [make_input(logit_bias={VOCAB: 1.0})], gen())


def test_min_tokens_bans_stops_and_ignore_eos_bans_nothing() -> None:
    logits = torch.zeros((5, VOCAB))
    logits[:, 7] = 50.0  # EOS dominates
    logits[:, 6] = 40.0  # a stop token id next
    inputs = [
        make_input(temperature=0.0, ignore_eos=True),  # EOS may be sampled; it just does not stop
        make_input(temperature=0.0, min_tokens=2, stop_token_ids=[6], output=[0]),
        make_input(temperature=0.0, min_tokens=2, stop_token_ids=[6], output=[0, 0]),
        make_input(temperature=0.0, min_tokens=2, output=[0]),
        make_input(temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[6], output=[0]),
    ]
    out = sample(logits, inputs, gen())
    assert out.sampled_token_ids.tolist() == [7, 0, 7, 6, 7]
    # random rows respect the ban too
    for draw in range(20):
        drawn = sample(logits[:1], [make_input(min_tokens=1, temperature=5.0)], gen(draw))
        assert drawn.sampled_token_ids.item() != 7


def test_seeded_rows_independent_of_batch() -> None:
    logits = random_logits(4, vocab=100, seed=3)
    alone = [
        sample(logits[i : i + 1], [make_input(seed=10 + i, temperature=1.3, top_p=0.9)], gen(0)).sampled_token_ids
        for i in range(4)
    ]
    for default_seed in (1, 2):
        batch_inputs = [make_input(seed=10 + i, temperature=1.3, top_p=0.9) for i in range(4)]
        batch_inputs.insert(2, make_input(temperature=0.7, top_k=5))  # an unseeded neighbour
        batch_logits = torch.cat([logits[:2], random_logits(1, vocab=100, seed=9), logits[2:]])
        out = sample(batch_logits, batch_inputs, gen(default_seed)).sampled_token_ids.tolist()
        assert out[:2] + out[3:] == [int(t) for t in alone]


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    logits = torch.zeros((1, 1000))
    by_position = [sample(logits, [make_input(seed=5, output=[1] * n)], gen(n)).sampled_token_ids.item()
                   for n in range(6)]
    assert len(set(by_position)) > 1  # each output position draws anew
    again = [sample(logits, [make_input(seed=5, output=[2] * n)], gen(99)).sampled_token_ids.item()
             for n in range(6)]
    assert again == by_position  # not the engine generator, not the tokens: the seed and the position
    assert [sample(logits, [make_input(seed=6, output=[1] * n)], gen()).sampled_token_ids.item()
            for n in range(6)] != by_position


def test_position_uniform_is_uniform_and_decorrelated() -> None:
    from loom.sample.sampler import position_uniform

    values = [position_uniform(seed, pos) for seed in range(-50, 50) for pos in range(200)]
    assert all(0.0 <= u < 1.0 for u in values)
    n = len(values)
    mean = sum(values) / n
    assert abs(mean - 0.5) < 5 * math.sqrt(1 / 12 / n)
    deciles = [0] * 10
    for u in values:
        deciles[int(u * 10)] += 1
    assert all(abs(c - n / 10) < 5 * math.sqrt(n * 0.09) for c in deciles), deciles
    # neighbouring positions and neighbouring seeds are not correlated
    pairs = [(position_uniform(7, p), position_uniform(7, p + 1)) for p in range(5000)]
    pairs += [(position_uniform(s, 3), position_uniform(s + 1, 3)) for s in range(5000)]
    cov = sum((a - 0.5) * (b - 0.5) for a, b in pairs) / len(pairs)
    assert abs(cov / (1 / 12)) < 0.05


def test_inverse_transform_never_draws_a_zero_probability_token() -> None:
    from loom.sample.sampler import inverse_transform_sample

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0]])
    for u in (0.0, 1e-300, 0.25, 0.5, 0.999999, 1.0 - 2.0 ** -53):
        got = inverse_transform_sample(probs, torch.tensor([u, u], dtype=torch.float64)).tolist()
        assert got[0] in (1, 3) and got[1] == 2, (u, got)
    assert inverse_transform_sample(probs, torch.tensor([0.49, 0.5], dtype=torch.float64))[0].item() == 1


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    logits = random_logits(3, vocab=30, seed=4)
    inputs = [
        make_input(temperature=0.8, top_k=2, logprobs=5, presence_penalty=2.0, output=[1, 2]),
        make_input(temperature=0.0, logprobs=0),
        make_input(temperature=1.0),
    ]
    out = sample(logits, inputs, gen(7))
    reference = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for row in (0, 1):
        entry = out.logprobs[row]
        assert entry is not None
        assert len(entry.token_ids) == 1 + inputs[row].params.logprobs
        assert entry.token_ids[0] == out.sampled_token_ids[row].item()
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
            assert math.isclose(logprob, reference[row, token_id].item(), rel_tol=1e-5, abs_tol=1e-6)
            assert rank == 1 + int((reference[row] > reference[row, token_id]).sum())
        top = entry.token_ids[1:]
        assert top == reference[row].topk(len(top)).indices.tolist()


def test_compute_token_logprobs_ties_share_rank() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    (entry,) = compute_token_logprobs(logits, torch.tensor([0]), num_top=3)
    assert entry.token_ids[0] == 0 and entry.ranks[0] == 3
    assert entry.ranks[1:] == [1, 1, 3]
    with pytest.raises(ValueError, match="num_top"):
        compute_token_logprobs(logits, torch.tensor([0]), num_top=-1)


def test_no_leak_across_rows() -> None:
    logits = random_logits(1, vocab=20, seed=5).expand(4, 20).contiguous()
    heavy = make_input(
        temperature=0.0, prompt=list(range(20)), output=[int(logits[0].argmax())] * 3,
        repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0,
        logit_bias={0: -100.0}, ignore_eos=True, min_tokens=5, stop_token_ids=[1],
    )
    plain = make_input(temperature=0.0)
    plain_alone = sample(logits[:1], [plain], gen()).sampled_token_ids.item()
    out = sample(logits, [heavy, plain, heavy, plain], gen()).sampled_token_ids.tolist()
    assert out[1] == out[3] == plain_alone == int(logits[0].argmax())
    assert out[0] == out[2] != plain_alone


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match="rows"):
        sample(torch.zeros((2, VOCAB)), [make_input()], gen())
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(VOCAB), [make_input()], gen())


def test_greedy_argmax_follows_torch_argmax_on_ties_nans_and_infinities() -> None:
    """The numpy path on the CPU picks what torch.argmax picks: the first of equal maxima, the first NaN, the
    first of an all -inf row; float32 rows of the vocabulary's size and odd sizes, and a non-contiguous view."""
    from loom.sample.sampler import greedy_argmax

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 49152, generator=g)
    logits[1, [7, 9000, 40000]] = 50.0  # ties: the first wins
    logits[2, [123, 456]] = float("nan")  # the first NaN wins over every number
    logits[3] = float("-inf")
    logits[4, 10] = float("inf")
    logits[5, -1] = 99.0
    for rows in (logits, logits[:, :1001], logits[:, ::2], logits.double(), logits.bfloat16()):
        got = greedy_argmax(rows)
        assert got.dtype == torch.int64
        assert torch.equal(got, rows.argmax(dim=-1)), rows.dtype


@pytest.mark.parametrize("params", [
    {}, {"temperature": 0.0}, {"logit_bias": {2: 5.0}}, {"repetition_penalty": 1.3}, {"presence_penalty": 0.5},
    {"frequency_penalty": -0.5}, {"min_tokens": 3, "stop_token_ids": [1]}, {"min_tokens": 3, "ignore_eos": True},
])
def test_modifies_says_exactly_when_apply_all_changes_a_row(params: dict[str, object]) -> None:
    # sample() copies the logits only when some row is modified: the predicate must never miss a change
    from loom.sample.penalties import modifies

    inp = make_input(prompt=[0, 1, 2], output=[2, 3], **params)
    logits = random_logits(1, seed=5)
    processed = logits.clone()
    apply_all(processed, [inp])
    assert modifies(inp) == (not torch.equal(processed, logits))


@pytest.mark.parametrize("params", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 3},
                                    {"temperature": 0.0, "repetition_penalty": 2.0, "logprobs": 2}])
def test_sample_leaves_its_logits_unchanged(params: dict[str, object]) -> None:
    logits = random_logits(2, seed=7)
    before = logits.clone()
    sample(logits, [make_input(prompt=[0, 1], output=[2], **params) for _ in range(2)], gen())
    assert torch.equal(logits, before)
