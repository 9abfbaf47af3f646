"""Sampling: `sample` and `sample_rows` draw what torch.multinomial draws, row by row.

The reference samples each token with `torch.multinomial(probs, 1, generator=...)` after its
warpers; Kazeia writes that draw out so that rows share their operations. The expectation here is
torch's own call on each row alone, with its own generator: the same token, and the generator left
in the same state (the next draw of a request depends on it).
"""

import pytest
import torch

from kazeia.sampling import sample, sample_rows


def _alone(scores: torch.Tensor, warpers, generator) -> int:
    """One row (1, V) through the reference's warpers and torch.multinomial."""
    do_sample, temperature, top_k, top_p = warpers
    if not do_sample:
        return int(scores.argmax())
    scores = scores / temperature
    if top_k > 0:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        drop[..., -1:] = False
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return int(torch.multinomial(scores.softmax(dim=-1), 1, generator=generator))


WARPERS = [(True, 0.9, 50, 1.0), (True, 1.0, 0, 1.0), (True, 0.7, 0, 0.8), (True, 1.3, 20, 0.9), (False, 0.9, 50, 1.0)]


@pytest.mark.parametrize("warpers", WARPERS)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_each_row_draws_what_multinomial_draws_alone(warpers, rows):
    for trial in range(40):
        scores = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(trial)) * (1 + trial % 6)
        ours = [torch.Generator().manual_seed(1000 * trial + b) for b in range(rows)]
        theirs = [torch.Generator().manual_seed(1000 * trial + b) for b in range(rows)]
        tokens = sample(scores, warpers, ours)
        assert tokens.tolist() == [_alone(scores[b : b + 1], warpers, theirs[b]) for b in range(rows)]
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.get_state(), b.get_state())  # the next draws match too


def test_rows_with_different_warpers_each_get_their_own():
    warpers = [WARPERS[b % len(WARPERS)] for b in range(7)]
    for trial in range(20):
        scores = torch.randn(7, 3072, generator=torch.Generator().manual_seed(trial)) * 3
        ours = [torch.Generator().manual_seed(trial * 10 + b) for b in range(7)]
        theirs = [torch.Generator().manual_seed(trial * 10 + b) for b in range(7)]
        tokens = sample_rows(scores, warpers, ours)
        assert tokens.tolist() == [_alone(scores[b : b + 1], warpers[b], theirs[b]) for b in range(7)]


def test_no_generator_draws_from_torchs_global_one_as_multinomial_does():
    scores = torch.randn(1, 2048)
    torch.manual_seed(5)
    ours = int(sample(scores, WARPERS[0], [None]))
    torch.manual_seed(5)
    assert ours == _alone(scores, WARPERS[0], None)


def test_scores_that_are_not_numbers_are_refused_as_multinomial_refuses_them():
    scores = torch.randn(2, 2048)
    scores[1, 7] = float("nan")
    with pytest.raises(RuntimeError, match="inf, nan or element < 0"):
        sample(scores, WARPERS[1], [torch.Generator(), torch.Generator()])
