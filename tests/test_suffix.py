"""The suffix proposer (clover/suffix.py) against brute-force searches on random token sequences."""

from __future__ import annotations

import random
import tracemalloc

import numpy as np
import pytest

from clover.config import ConfigError
from clover import suffix
from clover.suffix import SharedSuffixIndex, SuffixIndex, SuffixProposal

SEEDS = range(6)


# ---- brute force -------------------------------------------------------------------------------------------

def brute_longest(text: list[int]) -> tuple[int, list[int]]:
    """(length of the longest suffix of text that also ends earlier, all its earlier end positions)."""
    n = len(text)
    for length in range(n - 1, 0, -1):
        ends = [p for p in range(length - 1, n - 1) if text[p - length + 1: p + 1] == text[n - length:]]
        if ends:
            return length, ends
    return 0, []


def brute_continuation(text: list[int], end: int, depth: int, periodic: bool) -> list[int]:
    """What followed ``end``; periodic: the text is assumed to go on as it did after ``end``, so the token
    after the text's end repeats the one ``end + 1 + j`` (an overlapping copy, simulated token by token)."""
    if not periodic:
        return text[end + 1: end + 1 + depth]
    grown = list(text)
    for j in range(depth):
        grown.append(grown[end + 1 + j])
    return grown[len(text):]


def brute_trie(continuations: list[list[int]], max_nodes: int) -> list[tuple[tuple[int, ...], int]]:
    """(path, count) of the max_nodes best trie nodes: count desc, then shallower, then the earliest (most
    recent) continuation through it; continuations are given most recent first."""
    count: dict[tuple[int, ...], int] = {}
    first: dict[tuple[int, ...], int] = {}
    for rank, cont in enumerate(continuations):
        for d in range(1, len(cont) + 1):
            path = tuple(cont[:d])
            count[path] = count.get(path, 0) + 1
            first.setdefault(path, rank)
    best = sorted(count, key=lambda path: (-count[path], len(path), first[path]))[:max_nodes]
    return sorted((path, count[path]) for path in best)


def check_shape(proposal: SuffixProposal, max_depth: int, max_nodes: int) -> None:
    """Level order, closed under ancestors, siblings by decreasing count, within the limits."""
    n = len(proposal.tokens)
    assert n <= max_nodes
    for array in (proposal.tokens, proposal.parents, proposal.depths, proposal.counts):
        assert array.dtype == np.int64 and array.shape == (n,)
    assert list(proposal.depths) == sorted(proposal.depths), "not in level order"
    for d in set(proposal.depths.tolist()):  # breadth-first: a level's nodes grouped by their parents, in order
        level_parents = proposal.parents[proposal.depths == d].tolist()
        assert level_parents == sorted(level_parents), "a level's nodes not in their parents' order"
    for i in range(n):
        parent = int(proposal.parents[i])
        assert parent < i, "a parent must precede its child"
        assert proposal.depths[i] == (1 if parent < 0 else proposal.depths[parent] + 1)
        assert 1 <= proposal.depths[i] <= max_depth
        if parent >= 0:
            assert proposal.counts[i] <= proposal.counts[parent]
        assert 1 <= proposal.counts[i] <= proposal.total
    siblings: dict[int, list[int]] = {}
    for i, parent in enumerate(proposal.parents.tolist()):
        siblings.setdefault(parent, []).append(i)
    for group in siblings.values():
        counts = [int(proposal.counts[i]) for i in group]
        assert counts == sorted(counts, reverse=True), "siblings not by decreasing count"
        assert len({int(proposal.tokens[i]) for i in group}) == len(group), "two siblings with one token"
    paths = proposal.paths()
    assert len(set(paths)) == n


def random_text(rng: random.Random, length: int, alphabet: int) -> list[int]:
    return [rng.randrange(alphabet) for _ in range(length)]


def expected_proposal(text, ends, max_depth, max_nodes, periodic):
    return brute_trie([brute_continuation(text, p, max_depth, periodic) for p in ends], max_nodes)


def proposed(proposal: SuffixProposal) -> list[tuple[tuple[int, ...], int]]:
    return sorted(zip(proposal.paths(), proposal.counts.tolist()))


@pytest.mark.parametrize("python_cells", [0, 10_000])  # the numpy and the Python trie builders
def test_trie_builders_agree_with_brute_force(python_cells, monkeypatch):
    monkeypatch.setattr(suffix, "PYTHON_TRIE_CELLS", python_cells)
    rng = random.Random(11)
    for _ in range(200):
        k, depth = rng.randint(1, 20), rng.randint(1, 12)
        rows = [random_text(rng, depth, rng.randint(1, 3)) for _ in range(k)]
        for row in rows:  # some continuations end early (the end of an output)
            cut = rng.randint(1, depth + 3)
            row[cut:] = [suffix.SEPARATOR] * len(row[cut:])
        max_nodes = rng.randint(1, 30)
        proposal = suffix.build_proposal(np.array(rows, dtype=np.int64), max_nodes, 3)
        check_shape(proposal, depth, max_nodes)
        assert proposal.total == k and proposal.match_length == 3
        cut_rows = [row[:row.index(-1)] if -1 in row else row for row in rows]
        assert proposed(proposal) == brute_trie(cut_rows, max_nodes)


@pytest.mark.parametrize("python_cells", [0, 10_000])
def test_count_ties_go_to_the_more_recent_occurrence(python_cells, monkeypatch):
    monkeypatch.setattr(suffix, "PYTHON_TRIE_CELLS", python_cells)
    # most recent first: 5 is followed by the most recent occurrence (and the oldest), 3 by the two in between
    rows = np.array([[5, 9], [3, 1], [3, 2], [5, 8]], dtype=np.int64)
    assert suffix.build_proposal(rows, 1, 1).paths() == [(5,)]
    assert suffix.build_proposal(rows, 3, 1).paths() == [(5,), (3,), (5, 9)]
    assert suffix.build_proposal(rows[[1, 0, 2, 3]], 3, 1).paths() == [(3,), (5,), (3, 1)]


# ---- per-request index -------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("periodic", [True, False])
def test_matches_and_counts_equal_brute_force(seed, periodic):
    rng = random.Random(seed)
    for _ in range(12):
        alphabet, length = rng.randint(2, 5), rng.randint(1, 300)
        text = random_text(rng, length, alphabet)
        max_depth, max_nodes = rng.randint(1, 12), rng.randint(1, 40)
        index = SuffixIndex(text, max_occurrences=32, periodic=periodic)
        proposal = index.propose(max_depth, max_nodes)
        match_length, all_ends = brute_longest(text)
        assert proposal.match_length == match_length
        check_shape(proposal, max_depth, max_nodes)
        if match_length == 0:
            assert len(proposal.tokens) == 0 and proposal.total == 0
            continue
        _, ends = index.match()
        assert set(ends.tolist()) <= set(all_ends)
        if len(all_ends) <= 32:
            assert sorted(ends.tolist()) == all_ends, "with fewer occurrences than the cap, all are counted"
        assert proposal.total == len(ends) == min(len(all_ends), 32)
        assert proposed(proposal) == expected_proposal(text, ends.tolist(), max_depth, max_nodes, periodic)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_cap_keeps_the_most_recent_occurrences(seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(40):  # "0 1" blocks with random tokens around them, ending in "99 0 1": 2-16 occurrences
        text = [t for _ in range(rng.randint(2, 16)) for t in [0, 1] + random_text(rng, rng.randint(1, 3), 4)]
        text += [99, 0, 1]
        length, all_ends = brute_longest(text)
        index = SuffixIndex(text, max_occurrences=3)
        _, ends = index.match()
        assert len(ends) == min(3, len(all_ends))
        if len(all_ends) <= 6:  # exactly the most recent when at most twice the cap
            assert ends.tolist() == sorted(all_ends, reverse=True)[:3]
            checked += len(all_ends) > 3
        proposal = index.propose(6, 10)
        assert proposal.total == len(ends) and proposal.match_length == length
        assert proposed(proposal) == expected_proposal(text, ends.tolist(), 6, 10, True)
    assert checked, "no text had more occurrences than the cap: the test checked nothing"


def test_many_occurrences_are_bounded_and_valid():
    # "x 0 x 1 x 2 ... x": the suffix "x" ends at 500 earlier positions
    text = [t for i in range(500) for t in (9999, i)] + [9999]
    index = SuffixIndex(text, max_occurrences=8)
    length, ends = index.match()
    assert length == 1 and len(ends) == 8
    assert all(text[p] == 9999 for p in ends)
    proposal = index.propose(2, 50)
    assert proposal.total == 8 and sorted(proposal.counts.tolist()) == [1] * 16
    check_shape(proposal, 2, 50)


@pytest.mark.parametrize("seed", SEEDS)
def test_incremental_extension_equals_building_from_scratch(seed):
    rng = random.Random(100 + seed)
    text = random_text(rng, 250, rng.randint(2, 4))
    one_by_one, chunked = SuffixIndex(text[:7]), SuffixIndex()
    done = 0
    while done < len(text):
        chunk = text[done: done + rng.randint(1, 9)]
        chunked.extend(chunk)
        for token in chunk:
            one_by_one.extend([token]) if done >= 7 else None
            done += 1
        scratch = SuffixIndex(text[:done])
        assert len(chunked) == len(scratch) == done
        assert np.array_equal(chunked.text, text[:done])
        depth, nodes = rng.randint(1, 10), rng.randint(1, 20)
        want = scratch.propose(depth, nodes)
        for other in ((one_by_one,) if done >= 7 else ()) + (chunked,):
            got = other.propose(depth, nodes)
            assert got.match_length == want.match_length and got.total == want.total
            for field in ("tokens", "parents", "depths", "counts"):
                assert np.array_equal(getattr(got, field), getattr(want, field)), field


def test_loops_propose_the_loop():
    loop = SuffixIndex([1, 2, 3] * 700)
    proposal = loop.propose(16, 32)
    assert proposal.tokens.tolist() == [1, 2, 3] * 5 + [1] and proposal.match_length == 2097
    same = SuffixIndex([7] * 2000).propose(8, 8)
    assert same.tokens.tolist() == [7] * 8 and same.parents.tolist() == list(range(-1, 7))
    short = SuffixIndex([7] * 2000, periodic=False).propose(8, 8)
    assert short.tokens.tolist() == [7], "without the periodic copy the overlapping match has one token left"


def test_min_match_and_empty():
    empty = SuffixIndex().propose(4, 4)
    assert len(empty.tokens) == 0 and empty.total == 0 and empty.match_length == 0
    assert len(SuffixProposal.empty().tokens) == 0
    index = SuffixIndex([1, 2, 3, 4, 1, 2])
    assert index.propose(4, 4).match_length == 2
    assert len(index.propose(4, 4, min_match=3).tokens) == 0
    assert len(SuffixIndex([1, 2, 3]).propose(4, 4).tokens) == 0


@pytest.mark.parametrize("call, message", [
    (lambda: SuffixIndex([1, 2, 1]).propose(0, 4), "max_depth"),
    (lambda: SuffixIndex([1, 2, 1]).propose(4, 0), "max_nodes"),
    (lambda: SuffixIndex([1, 2, 1]).propose(4, 4, min_match=-1), "min_match"),
    (lambda: SuffixIndex(max_occurrences=0), "max_occurrences"),
    (lambda: SuffixIndex([1, -3]), "token ids"),
    (lambda: SharedSuffixIndex(max_tokens=0), "max_tokens"),
    (lambda: SharedSuffixIndex(max_occurrences=0), "max_occurrences"),
    (lambda: SharedSuffixIndex().propose([1], 0, 4), "max_depth"),
    (lambda: SharedSuffixIndex().propose([1], 4, 0), "max_nodes"),
])
def test_bad_parameters_are_refused(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


# ---- shared index ------------------------------------------------------------------------------------------

def brute_shared(outputs: list[list[int]], context: list[int]) -> tuple[int, list[list[int]]]:
    """(longest suffix of context's last 64 tokens occurring in an output with a token after it, the
    continuations of all its occurrences most recent first)."""
    context = context[-64:]
    for length in range(len(context), 0, -1):
        pattern = context[len(context) - length:]
        found = [output[p + 1:] for output in outputs for p in range(length - 1, len(output) - 1)
                 if output[p - length + 1: p + 1] == pattern]
        if found:
            return length, found[::-1]
    return 0, []


@pytest.mark.parametrize("seed", SEEDS)
def test_shared_proposals_equal_brute_force_over_kept_outputs(seed):
    rng = random.Random(200 + seed)
    index = SharedSuffixIndex(max_tokens=300, max_occurrences=10_000)
    for _ in range(60):
        index.add(random_text(rng, rng.randint(0, 60), rng.randint(2, 5)))
        outputs = index.outputs()
        assert index.num_tokens == sum(map(len, outputs)) <= 300
        context = random_text(rng, rng.randint(1, 80), 5)
        max_depth, max_nodes = rng.randint(1, 8), rng.randint(1, 30)
        proposal = index.propose(context, max_depth, max_nodes)
        length, continuations = brute_shared(outputs, context)
        assert proposal.match_length == length and proposal.total == len(continuations)
        check_shape(proposal, max_depth, max_nodes)
        assert proposed(proposal) == brute_trie([c[:max_depth] for c in continuations], max_nodes)


def test_shared_index_evicts_the_oldest_outputs_and_stays_under_its_cap():
    rng = random.Random(7)
    index = SharedSuffixIndex(max_tokens=2000)
    added = []
    for i in range(400):  # 20x max_tokens
        size = rng.randint(16, 180)  # small alphabets and loops make the most automaton states per token
        body = [7] * size if i % 5 == 0 else random_text(rng, size, rng.choice([2, 50, 50_000]))
        output = [100_000 + i] + body
        index.add(output)
        added.append(output)
        assert index.num_tokens <= 2000
        assert index.memory_bytes() < SharedSuffixIndex.MEMORY_BYTES_PER_TOKEN * 2000
    kept = index.outputs()
    assert kept == added[len(added) - len(kept):], "not the newest outputs, in order"
    assert index.num_tokens + len(added[-len(kept) - 1]) > 2000, "evicted more than needed"
    assert index.propose([100_000 + 3], 4, 4).match_length == 0, "an evicted output is still proposed"
    assert index.propose([100_000 + 399], 4, 4).tokens[0] == added[-1][1]
    assert SharedSuffixIndex(max_tokens=5).add([1, 2, 3, 4, 5, 6, 7]) is None


def test_memory_bytes_is_honest():
    """The estimate is within a factor of what tracemalloc sees the index allocate."""
    rng = random.Random(3)
    outputs = [random_text(rng, 120, 3000) for _ in range(40)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = SharedSuffixIndex(max_tokens=100_000)
    for output in outputs:
        index.add(output)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert 0.7 * held <= index.memory_bytes() <= 1.5 * held, (index.memory_bytes(), held)
