"""The rejection sampler on its own: with a target p and a draft q that deliberately differ, the
emitted tokens follow p at every position (chi-square, 2 * 10^5 draws, cells merged to expected
counts >= 5), for a drawn q and for deterministic (one-hot) drafts; and it really rejects."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from llmopt.core.sampler import rejection_sample

N = 200_000
V = 12


def _merged_chisquare(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs, cells merged (smallest first) until each expects >= 5."""
    n = counts.sum()
    order = np.argsort(probs)
    obs, exp = [], []
    acc_o = acc_e = 0.0
    for i in order:
        acc_o += counts[i]
        acc_e += probs[i] * n
        if acc_e >= 5:
            obs.append(acc_o)
            exp.append(acc_e)
            acc_o = acc_e = 0.0
    if acc_e > 0:
        obs[-1] += acc_o
        exp[-1] += acc_e
    exp = np.array(exp) * (np.sum(obs) / np.sum(exp))
    return chisquare(np.array(obs), exp).pvalue


def _dists(gen: torch.Generator, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.rand(k + 1, V, generator=gen) ** 3     # peaked, with small cells
    p[:, 0] = 1e-4                                   # a token the target almost never picks
    p = p / p.sum(-1, keepdim=True)
    q = torch.rand(k, V, generator=gen) ** 3
    q[:, 0] = 0.5                                    # ... which the draft proposes often
    q = q / q.sum(-1, keepdim=True)
    return p, q


@pytest.mark.parametrize("one_hot", [False, True], ids=["drawn-q", "one-hot-q"])
def test_rejection_sampler_reproduces_the_target(one_hot):
    k = 2 if one_hot else 3
    gen = torch.Generator().manual_seed(1234)
    p, q = _dists(gen, k)
    if one_hot:
        mix = 0.8 * p[:k] + 0.2 * q    # proposals from a q that is not passed: one-hot, as for n-gram
        drafts = torch.multinomial(mix, N, replacement=True, generator=gen).T
        got = rejection_sample(p.expand(N, -1, -1), drafts, None, gen)
    else:
        drafts = torch.multinomial(q, N, replacement=True, generator=gen).T   # [N, k], row j ~ q_j
        got = rejection_sample(p.expand(N, -1, -1), drafts, q.expand(N, -1, -1), gen)
    accepted = got[:, :k] == drafts
    reached = torch.ones(N, dtype=torch.bool)            # the output has a token at this position
    rejected_any = False
    for j in range(k + 1):
        tokens = got[reached, j].numpy()
        assert len(tokens) >= 500, f"position {j}: too few samples ({len(tokens)}) to test"
        counts = np.bincount(tokens, minlength=V)
        pval = _merged_chisquare(counts, p[j].double().numpy())
        assert pval > 1e-3, f"position {j}: emitted tokens do not follow p (p-value {pval:.2e})"
        if j < k:
            rejected_any |= bool((~accepted[reached, j]).any())
            reached = reached & accepted[:, j]
    assert rejected_any
    # the draft was built to differ: its own distribution fails the same test at position 0
    if not one_hot:
        counts = np.bincount(drafts[:, 0].numpy(), minlength=V)
        assert _merged_chisquare(counts, p[0].double().numpy()) < 1e-6


def test_acceptance_rate_is_the_overlap():
    """P(accept draft j) = sum_x min(p_j(x), q_j(x)), the known acceptance rate."""
    k = 2
    gen = torch.Generator().manual_seed(7)
    p, q = _dists(gen, k)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen).T
    got = rejection_sample(p.expand(N, -1, -1), drafts, q.expand(N, -1, -1), gen)
    rate = (got[:, 0] == drafts[:, 0]).float().mean().item()
    expect = torch.minimum(p[0], q[0]).sum().item()
    assert abs(rate - expect) < 4 * (expect * (1 - expect) / N) ** 0.5 + 1e-3
