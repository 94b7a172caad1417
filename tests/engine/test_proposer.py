"""The n-gram proposer and the engine's history: longest n first, most recent earlier match, at most k tokens,
none when nothing repeats; the index grows with the tokens and never answers with a wrong match."""

import pytest

from localpaged.engine.proposer import History, NgramIndex, NgramProposer
from localpaged.errors import ConfigError


def test_proposes_what_followed_the_last_trigram():
    tokens = [5, 6, 7, 8, 9, 10, 1, 5, 6, 7]
    assert NgramProposer(k=3).propose(tokens) == ([8, 9, 10], 3)


def test_longest_n_wins_over_a_more_recent_shorter_match():
    # The bigram (6, 7) recurs at index 6 followed by 2, but the trigram (5, 6, 7) matched at 0 says 8.
    tokens = [5, 6, 7, 8, 0, 0, 6, 7, 2, 5, 6, 7]
    assert NgramProposer(k=1).propose(tokens) == ([8], 3)


def test_most_recent_occurrence_wins():
    tokens = [1, 2, 3, 1, 2, 4, 9, 1, 2]
    assert NgramProposer(k=1, max_n=2).propose(tokens) == ([4], 2)


def test_proposal_stops_at_the_end_of_the_sequence():
    # The only earlier match of the unigram 3 is right before the tail: one token follows it.
    assert NgramProposer(k=4).propose([3, 3]) == ([3], 1)


def test_nothing_repeats_nothing_proposed():
    proposer = NgramProposer(k=4)
    assert proposer.propose([1, 2, 3, 4]) == ([], 0)
    assert proposer.propose([7]) == ([], 0)
    assert proposer.propose([]) == ([], 0)


def test_k_per_call_overrides_and_zero_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    proposer = NgramProposer(k=3)
    assert proposer.propose(tokens, k=1) == ([3], 2)
    assert proposer.propose(tokens, k=0) == ([], 0)


def test_min_n_refuses_shorter_matches():
    assert NgramProposer(k=2, min_n=2).propose([4, 1, 2, 9, 4]) == ([], 0)


def test_a_kept_index_grows_with_the_tokens_and_answers_as_a_fresh_one():
    proposer = NgramProposer(k=3, min_n=1, max_n=3)
    index = proposer.index()
    tokens = [9, 1, 2, 3, 4]
    assert proposer.propose(tokens, index=index) == ([], 0)
    for token in [1, 2, 7, 1, 2]:
        tokens.append(token)
        assert proposer.propose(tokens, index=index) == proposer.propose(tokens)
    assert proposer.propose(tokens, index=index) == ([7, 1, 2], 2)


def test_a_hash_collision_misses_rather_than_proposes_a_wrong_match():
    index = NgramIndex(2, 2)
    tokens = [1, 2, 3, 4]
    index.grow(tokens, len(tokens))
    index.ends[hash((8, 9))] = index.ends[hash((1, 2))]  # as if (8, 9) hashed like (1, 2)
    assert index.find(tokens, [8, 9]) is None
    assert index.find(tokens, [1, 2]) == 1


def test_history_drafts_stop_at_the_end_of_a_remembered_request():
    history = History(2, 4)
    history.add([1, 2, 3, 4])
    history.add([1, 2, 5])
    assert history.propose([0, 1, 2], k=4, at_least=2) == ([5], 2)  # the most recent, cut at its end
    assert history.propose([0, 3, 4], k=4, at_least=2) == ([], 0)  # nothing follows in its request


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(0, 1, 3), (2, 0, 3), (2, 3, 2)])
def test_bad_settings_are_one_clear_error(k, min_n, max_n):
    with pytest.raises(ConfigError, match="speculative"):
        NgramProposer(k=k, min_n=min_n, max_n=max_n)
