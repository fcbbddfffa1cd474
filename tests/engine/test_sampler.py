"""The batched sampler against independent float64 computations: chi-square tests that
temperature / top-k / top-p / min-p draw from the intended distribution, penalties against a direct
loop (and transformers' repetition penalty), seeds, min_tokens and logprobs."""

import math

import pytest
import torch

from llmopt.core.sampler import Sampler, SamplingRow, apply_penalties
from llmopt.core.sampling_params import SamplingParams
from llmopt.errors import UserInputError

LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.3, -0.2, -1.0, -2.5])


def expected(params: SamplingParams) -> list[float]:
    """The intended distribution, computed from scratch in float64: temperature, then top-k, then
    top-p over what top-k kept (renormalized, as vLLM orders them), then min-p."""
    x = [float(v) / params.temperature for v in LOGITS]
    m = max(x)
    p = [math.exp(v - m) for v in x]
    z = sum(p)
    p = [v / z for v in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep = set(order)
    if params.top_k:
        keep &= set(order[:params.top_k])
    if params.top_p < 1:
        z = sum(p[i] for i in keep)
        mass, chosen = 0.0, set()
        for i in [i for i in order if i in keep]:
            chosen.add(i)
            mass += p[i] / z
            if mass >= params.top_p:
                break
        keep &= chosen
    if params.min_p:
        keep &= {i for i in order if p[i] >= params.min_p * p[order[0]]}
    z = sum(p[i] for i in keep)
    return [p[i] / z if i in keep else 0.0 for i in range(len(p))]


def draw(params: SamplingParams, n: int = 20000, seed: int = 0) -> torch.Tensor:
    rows = [SamplingRow(params, [1], [])] * n
    out = Sampler(seed)(LOGITS.repeat(n, 1), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(LOGITS)).double()


def chi_square_pvalue(counts: torch.Tensor, probs: list[float]) -> float:
    p = torch.tensor(probs, dtype=torch.float64)
    assert counts[p == 0].sum() == 0, "sampled a token the filter excludes"
    e = p[p > 0] * counts.sum()
    stat = ((counts[p > 0] - e) ** 2 / e).sum()
    df = int((p > 0).sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.6), SamplingParams(temperature=1.7, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.9, min_p=0.2),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05),
])
def test_sampling_follows_the_intended_distribution(params):
    counts = draw(params)
    assert chi_square_pvalue(counts, expected(params)) > 1e-4


def test_chi_square_rejects_a_wrong_distribution():
    counts = draw(SamplingParams(temperature=1.0))
    assert chi_square_pvalue(counts, expected(SamplingParams(temperature=0.8))) < 1e-6


def test_greedy_is_argmax_and_mixes_with_sampling_rows():
    logits = torch.randn(6, 50)
    rows = [SamplingRow(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0), [1], []) for i in range(6)]
    out = Sampler(0)(logits, rows)
    for i in range(0, 6, 2):
        assert out.token_ids[i] == int(logits[i].argmax())


def test_seeded_rows_repeat_whatever_the_batch():
    logits = torch.randn(1, 100)
    p = SamplingParams(temperature=1.0, seed=1234)

    def run(batch_extra: int, sampler_seed: int) -> list[int]:
        g = torch.Generator().manual_seed(1234)
        toks = []
        for _ in range(10):
            rows = [SamplingRow(SamplingParams(temperature=1.0), [1], [])] * batch_extra + [SamplingRow(p, [1], [], g)]
            toks.append(Sampler(sampler_seed)(logits.repeat(batch_extra + 1, 1), rows).token_ids[-1])
        return toks

    a, b = run(0, 0), run(5, 99)
    assert a == b and len(set(a)) > 1


def test_penalties_match_a_direct_computation():
    torch.manual_seed(0)
    V = 30
    logits = torch.randn(3, V, dtype=torch.float64)
    prompt, output = [1, 2, 2, 5], [5, 7, 7, 7, 9]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(repetition_penalty=1.3), SamplingParams()]
    got = apply_penalties(logits.clone(), [SamplingRow(p, prompt, output) for p in params])
    want = logits.clone()
    for t in set(output):
        want[0, t] -= 0.3 * output.count(t) + 0.5
    from transformers import RepetitionPenaltyLogitsProcessor
    want[1] = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[1:2].clone())[0]
    torch.testing.assert_close(got, want)


def test_min_tokens_blocks_eos_and_logprobs_are_the_model_distribution():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 10.0  # token 3 (say EOS) dominates
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [1], [], None, frozenset({3})),
            SamplingRow(SamplingParams(temperature=0.0, logprobs=0), [1], [])]
    out = Sampler(0)(logits, rows)
    assert out.token_ids[0] != 3 and out.token_ids[1] == 3
    lp = logits.log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(float(lp[0, out.token_ids[0]]))
    assert out.top_ids[0][0] == 3 and out.top_logprobs[0][0] == pytest.approx(float(lp[0, 3]))
    assert out.top_ids[1] == []


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(n=0), dict(min_tokens=5, max_tokens=2)])
def test_bad_params_are_user_errors(bad):
    with pytest.raises(UserInputError):
        SamplingParams(**bad)


def test_one_seed_range_and_the_seeds_of_n_samples():
    """A seed is a torch.long (vLLM's range) everywhere; sample i of n gets seed + i, wrapped into it."""
    import pytest

    from llmopt.core.sampling_params import SamplingParams
    from llmopt.errors import UserInputError
    from llmopt.validate import SEED_MAX, SEED_MIN, sample_seed
    assert (SEED_MIN, SEED_MAX) == (-(2 ** 63), 2 ** 63 - 1)
    assert SamplingParams(seed=SEED_MAX).seed == SEED_MAX and SamplingParams(seed=SEED_MIN).seed == SEED_MIN
    for bad in (SEED_MAX + 1, SEED_MIN - 1, 2 ** 64 - 1):
        with pytest.raises(UserInputError, match="seed must fit in 64 bits"):
            SamplingParams(seed=bad)
    assert [sample_seed(5, i) for i in range(3)] == [5, 6, 7]
    assert sample_seed(SEED_MAX, 1) == SEED_MIN and sample_seed(-1, 1) == 0
    assert all(SEED_MIN <= sample_seed(SEED_MAX - 1, i) <= SEED_MAX for i in range(4))
