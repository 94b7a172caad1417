"""Shared-prefix ("cascade") groups of a step: the sequences whose block tables begin with the same blocks.

A sequence that hit the prefix cache holds the very blocks of its cached prefix that every other sequence
with that prefix holds (the pool shares them by reference count), so sequences sharing a system prompt,
the forks of one chat and the n samples of one prompt all begin their tables with the same block ids. The
attention kernels then read those blocks once a step for the whole group instead of once per sequence
(kernels/cpu_cascade.h), and merge with each sequence's own keys by their log-sum-exp.

``find_groups`` runs once a step in ``ModelRunner.prepare``, torch-free: the candidates are bucketed by
their first block id, each bucket's tables packed as bytes and sorted, and each neighbour's common run of
blocks found by bisection on slice equality (memcmp). A bucket splits where a sub-group shares enough more to pay for it (two system
prompts whose first block happens to agree, forks deep into one chat): see ``_best``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

# Where a group pays on the CPU kernels, as (shared blocks, members) tiers: its shared pass computes the same
# products as its members' own decode would, in tiles of 16 query rows, so it gains only where reading the shared
# blocks once saves more than the tiles' padding and the merge. Timing one layer's decode attention with and without
# the group (a float16 cache in distinct caches a layer, so read cold as in a step) over 256-1,024 shared keys, 2-32
# members and 1-6 query heads a KV head: 8 members paid from 256 keys (16 blocks) and 4 from 1,024 at every head
# count; 2 never paid, nor 4 over 256. benchmarks/shared_prompt.py measures the whole engine on and off.
TIERS = ((16, 8), (64, 4))


@dataclass(frozen=True)
class Group:
    shared_blocks: int  # leading blocks every member's table holds, the same ids, all before its first new token
    members: tuple[int, ...]  # batch indices, ascending


def common_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading entries ``a`` and ``b`` share."""
    return _common(_packed(a), _packed(b))


def _packed(table: Sequence[int]) -> bytes:
    """A table as bytes, 8 to an entry: slices compare by memcmp, and sorting them groups common prefixes as
    sorting the lists would. (Comparing the lists themselves cost ~120 us a pair at 500 blocks.)"""
    return array("q", table).tobytes()


def _common(a: bytes, b: bytes) -> int:
    """Leading entries two packed tables share (bisection: prefix equality only ever stops holding)."""
    lo, hi = 0, min(len(a), len(b)) // 8
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 8 * mid] == b[: 8 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def find_groups(
    tables: Sequence[Sequence[int]], limits: Sequence[int], tiers: Sequence[tuple[int, int]] = TIERS
) -> list[Group]:
    """Disjoint groups of sequences whose ``tables`` begin with the same ``shared_blocks`` block ids, each at least
    one of ``tiers``' ``(blocks, members)``: that many members sharing at least that many blocks. ``limits[i]`` caps
    sequence i's shared blocks: the whole blocks of its tokens computed before this step (``num_computed_tokens //
    block_size``), so that no query of the step is masked from any shared key."""
    least_blocks, least_members = max(min(b for b, _ in tiers), 1), min(m for _, m in tiers)
    buckets: dict[int, list[int]] = {}
    for i, (table, limit) in enumerate(zip(tables, limits)):
        if min(limit, len(table)) >= least_blocks:
            buckets.setdefault(table[0], []).append(i)
    groups: list[Group] = []
    for bucket in buckets.values():
        if len(bucket) < least_members:
            continue
        prefix = {i: _packed(tables[i][: min(limits[i], len(tables[i]))]) for i in bucket}
        order = sorted(bucket, key=prefix.__getitem__)
        runs = [_common(prefix[a], prefix[b]) for a, b in pairwise(order)]
        for positions, shared in _best(runs, 0, len(order) - 1, tiers)[1]:
            groups.append(Group(shared, tuple(sorted(order[p] for p in positions))))
    return groups


def _best(
    runs: list[int], lo: int, hi: int, tiers: Sequence[tuple[int, int]]
) -> tuple[int, list[tuple[list[int], int]]]:
    """The grouping of the sorted members lo .. hi (``runs[j]``: the blocks members j and j + 1 share) that saves the
    most block reads (a group of n sharing s blocks saves (n - 1) x s), and its saving; each group as its members'
    positions and shared blocks. The least run L among them cuts them into parts that each share more; each part
    either joins one group at L (its members then save L each) or keeps its own best grouping, whichever saves more
    (so a deep fork of two stays in its prompt's group unless its extra blocks outweigh its users' share of L)."""
    if hi - lo + 1 < max(min(m for _, m in tiers), 2):
        return 0, []
    level = min(runs[lo:hi])
    cuts = [j for j in range(lo, hi) if runs[j] == level]
    parts = list(zip([lo] + [j + 1 for j in cuts], cuts + [hi]))
    bests = [_best(runs, a, b, tiers) for a, b in parts]
    apart = (sum(v for v, _ in bests), [g for _, groups in bests for g in groups])
    min_members = min((m for b, m in tiers if level >= b), default=None)  # a group at this level needs as many
    if min_members is None or hi - lo + 1 < min_members:
        return apart
    size = [b - a + 1 for a, b in parts]
    joined = {i for i in range(len(parts)) if size[i] * level >= bests[i][0]}
    for i in sorted(range(len(parts)), key=lambda i: bests[i][0] - size[i] * level):  # least loss first
        if sum(size[j] for j in joined) >= min_members:
            break
        joined.add(i)
    kept = [i for i in range(len(parts)) if i not in joined]
    saving = (sum(size[i] for i in joined) - 1) * level + sum(bests[i][0] for i in kept)
    if saving <= apart[0]:
        return apart
    members = [m for i in sorted(joined) for m in range(parts[i][0], parts[i][1] + 1)]
    return saving, [(members, level)] + [g for i in kept for g in bests[i][1]]
