"""The n-gram proposer: longest n first, most recent earlier match, at most k tokens, none when nothing repeats."""

import pytest

from localpaged.engine.proposer import NgramProposer
from localpaged.errors import ConfigError


def test_proposes_what_followed_the_last_trigram():
    tokens = [5, 6, 7, 8, 9, 10, 1, 5, 6, 7]
    assert NgramProposer(k=3).propose(tokens) == [8, 9, 10]


def test_longest_n_wins_over_a_more_recent_shorter_match():
    # The bigram (6, 7) recurs at index 6 followed by 2, but the trigram (5, 6, 7) matched at 0 says 8.
    tokens = [5, 6, 7, 8, 0, 0, 6, 7, 2, 5, 6, 7]
    assert NgramProposer(k=1).propose(tokens) == [8]


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 3, 1, 2, 4, 9, 1, 2]
    assert NgramProposer(k=1, max_n=2).propose(tokens) == [4]


def test_proposal_stops_at_the_end_of_the_sequence():
    # The only earlier match of the unigram 3 is right before the tail: one token follows it.
    assert NgramProposer(k=4).propose([3, 3]) == [3]


def test_nothing_repeats_nothing_proposed():
    proposer = NgramProposer(k=4)
    assert proposer.propose([1, 2, 3, 4]) == []
    assert proposer.propose([7]) == []
    assert proposer.propose([]) == []


def test_k_per_call_overrides_and_zero_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    proposer = NgramProposer(k=3)
    assert proposer.propose(tokens, k=1) == [3]
    assert proposer.propose(tokens, k=0) == []


def test_min_n_refuses_shorter_matches():
    assert NgramProposer(k=2, min_n=2).propose([4, 1, 2, 9, 4]) == []


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(0, 1, 3), (2, 0, 3), (2, 3, 2)])
def test_bad_settings_are_one_clear_error(k, min_n, max_n):
    with pytest.raises(ConfigError, match="speculative"):
        NgramProposer(k=k, min_n=min_n, max_n=max_n)
