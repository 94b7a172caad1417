"""engine/cascade.py's group finder: the groups it finds are real (every member's shared blocks identical in its
table and before its first new token), disjoint and large enough, and it finds the groups a batch plainly has."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from localpaged.engine.cascade import common_blocks, find_groups


@st.composite
def batches(draw):
    """Block tables drawn from a few shared prefixes (system prompts, forks of them) each followed by private
    blocks, and each sequence's limit (the whole blocks it computed before the step)."""
    next_id = iter(range(10_000))
    roots = [[next(next_id) for _ in range(draw(st.integers(1, 12)))] for _ in range(draw(st.integers(1, 3)))]
    prefixes = list(roots)
    for _ in range(draw(st.integers(0, 3))):  # forks: a root's first blocks, then blocks of their own
        root = draw(st.sampled_from(roots))
        prefixes.append(
            root[: draw(st.integers(1, len(root)))] + [next(next_id) for _ in range(draw(st.integers(0, 6)))]
        )
    tables, limits = [], []
    for _ in range(draw(st.integers(0, 12))):
        prefix = draw(st.sampled_from(prefixes))
        table = prefix[: draw(st.integers(1, len(prefix)))] + [next(next_id) for _ in range(draw(st.integers(0, 4)))]
        tables.append(table)
        limits.append(draw(st.integers(0, len(table))))
    return tables, limits


@settings(max_examples=300, deadline=None)
@given(batch=batches(), tiers=st.lists(st.tuples(st.integers(1, 4), st.integers(2, 4)), min_size=1, max_size=2))
def test_groups_are_real_disjoint_and_large_enough(batch, tiers):
    tables, limits = batch
    groups = find_groups(tables, limits, tiers)
    seen: set[int] = set()
    for group in groups:
        assert any(len(group.members) >= members and group.shared_blocks >= blocks for blocks, members in tiers)
        assert list(group.members) == sorted(set(group.members))
        assert not seen & set(group.members), "a sequence in two groups"
        seen |= set(group.members)
        lead = tables[group.members[0]][: group.shared_blocks]
        for i in group.members:
            assert group.shared_blocks <= limits[i], "a shared block holds a token of this step"
            assert tables[i][: group.shared_blocks] == lead


@settings(max_examples=200, deadline=None)
@given(batch=batches())
def test_two_sequences_that_could_share_are_grouped(batch):
    """Where only two sequences could share at all, they are one group at their whole common run."""
    tables, limits = batch
    if len(tables) < 2:
        return
    a, b = tables[0][: limits[0]], tables[1][: limits[1]]
    groups = find_groups([a, b], [len(a), len(b)], ((1, 2),))
    run = common_blocks(a, b)
    assert groups == ([] if run == 0 else [type(groups[0])(run, (0, 1))])


def test_two_system_prompts_whose_first_block_agrees_are_two_groups():
    """The template's first block is the same for both prompts; each prompt's users share far more among
    themselves, so the bucket splits into the two prompts' groups, and the lone sequence joins none."""
    header = [7]
    coding, writing = header + list(range(100, 140)), header + list(range(200, 260))
    tables = [coding + [1000 + i] for i in range(3)] + [writing + [2000 + i] for i in range(2)] + [header + [3000]]
    limits = [len(t) - 1 for t in tables]
    groups = find_groups(tables, limits, ((4, 2),))
    assert sorted((g.shared_blocks, g.members) for g in groups) == [(41, (0, 1, 2)), (61, (3, 4))]


def test_forks_deep_in_one_chat_share_more_than_the_rest():
    """Six users of one prompt, two of them forks of one chat: one group of all six at the prompt saves 5 x 20
    block reads; forks 2 blocks deeper stay in it (the four others and the forks apart save 3 x 20 + 22); forks
    900 blocks deeper go apart (3 x 20 + 920)."""
    prompt = list(range(20))
    chat = prompt + list(range(100, 102))
    tables = [prompt + [1000 + i] for i in range(4)] + [chat + [2000], chat + [2001]]
    limits = [len(t) - 1 for t in tables]
    assert [(g.shared_blocks, g.members) for g in find_groups(tables, limits, ((4, 2),))] == [(20, (0, 1, 2, 3, 4, 5))]
    chat = prompt + list(range(100, 1000))
    tables[4:] = [chat + [2000], chat + [2001]]
    limits = [len(t) - 1 for t in tables]
    assert sorted((g.shared_blocks, g.members) for g in find_groups(tables, limits, ((4, 2),))) == [
        (20, (0, 1, 2, 3)),
        (920, (4, 5)),
    ]


def test_a_sequence_shares_only_what_it_computed_before_the_step():
    tables = [list(range(10)), list(range(10))]
    assert [(g.shared_blocks, g.members) for g in find_groups(tables, [9, 5], ((4, 2),))] == [(5, (0, 1))]
    assert find_groups(tables, [9, 3], ((4, 2),)) == []  # a new prompt's first chunk computed nothing yet


def test_admission_prefers_a_request_that_joins_a_running_group_but_starves_none():
    """One slot a step: behind a request with a prompt of its own wait requests sharing the running sequence's
    prompt. They go first, up to MAX_PASSES times; then the other goes first."""
    from localpaged.engine.block_pool import BlockPool
    from localpaged.engine.kv_cache_manager import KVCacheManager
    from localpaged.engine.scheduler import MAX_PASSES, Scheduler
    from localpaged.engine.sequence import Sequence

    prompt = list(range(40))
    scheduler = Scheduler(KVCacheManager(BlockPool(200, 16)), max_num_seqs=64, max_num_batched_tokens=1000)

    def add(name, tokens):
        scheduler.add(Sequence(name, tokens, params=None))

    add("first", prompt + [100])
    scheduler.on_step_done(scheduler.schedule())
    scheduler.max_num_seqs = 1
    add("other", list(range(500, 540)))
    for i in range(MAX_PASSES + 2):
        add(f"user{i}", prompt + [200 + i])
    admitted = []
    for _ in range(MAX_PASSES + 1):
        scheduler.max_num_seqs = len(scheduler.running) + 1  # one more slot
        before = {s.request_id for s in scheduler.running}
        scheduler.on_step_done(scheduler.schedule())
        admitted += [s.request_id for s in scheduler.running if s.request_id not in before]
    assert admitted == [f"user{i}" for i in range(MAX_PASSES)] + ["other"]


def test_the_default_tiers_group_eight_members_from_16_blocks_and_four_from_64():
    """engine/cascade.py's TIERS: where a group paid in the decode attention's timing at every head count."""

    def group_of(members: int, shared: int) -> list[tuple[int, int]]:
        tables = [list(range(shared)) + [1000 + 10 * i, 1001 + 10 * i] for i in range(members)]
        return [(g.shared_blocks, len(g.members)) for g in find_groups(tables, [len(t) for t in tables])]

    assert group_of(8, 16) == [(16, 8)]
    assert group_of(7, 16) == [] and group_of(8, 15) == []
    assert group_of(4, 64) == [(64, 4)]
    assert group_of(4, 63) == [] and group_of(3, 64) == []
