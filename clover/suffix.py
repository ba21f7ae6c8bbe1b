"""Model-free tree candidates: a suffix index over the text, proposing what followed earlier occurrences of the
text's longest repeated suffix (docs/trees.md#model-free-candidates).

* :class:`SuffixIndex`: one per request, over the prompt and the tokens emitted so far, extended as tokens are
  accepted. :meth:`SuffixIndex.propose` finds the longest suffix of the text that also ends earlier in it and
  returns the continuations of (up to ``max_occurrences``, most recent preferred) earlier occurrences as a small
  trie of candidate tokens with their counts (a :class:`SuffixProposal`).
* :class:`SharedSuffixIndex`: optional, over earlier requests' outputs (SuffixDecoding's "global tree"),
  bounded by ``max_tokens`` (oldest outputs evicted first).

Prior art, each a decoding method of its own: prompt lookup (transformers ``prompt_lookup_num_tokens``: the
last n-gram searched in the prompt), TensorRT-LLM's ``NGram`` and ``SA`` (suffix automaton) speculative modes,
SuffixDecoding (arXiv 2411.04975: per-request and global suffix trees, candidates scored by frequency). Clover
merges these candidates into the heads' tree instead (clover/tree.py ``TreeMerge``).

Structure: a **suffix automaton** (Blumer et al. 1985, online construction), as TensorRT-LLM's SA mode uses.
Why not a suffix tree (SuffixDecoding) or an n-gram table (prompt lookup)? The automaton is built online in
amortised O(1) per token (Ukkonen's suffix tree is too, but it needs an end-of-text marker or implicit leaves,
which a growing text makes awkward), it answers "longest suffix that also ends earlier" for free (the state
``link(last)`` after each extension, of length ``len(link(last))``), and the end positions of that suffix are
the positions of the non-clone states in its subtree of the suffix-link tree, which a bounded walk enumerates
without scanning the text. An n-gram table needs one table per n and a fixed maximum n.

Continuations: an occurrence ending at position ``p`` proposes ``text[p+1 : p+1+max_depth]``; when that runs
into the end of the text (the occurrence overlaps the current suffix, as in loops "a b c a b c" or "a a a"),
:class:`SuffixIndex` by default continues the copy periodically, as LZ77 copies overlap: the text is assumed to
go on as it went on after ``p``, so position ``n + j`` repeats ``p + 1 + j`` (``periodic=False``: stop at the
end of the text). Without that a loop of period ``k`` would only ever propose ``k`` tokens.

Host time (benchmarks/suffix_proposer.py, docs/results/suffix-proposer): tens of microseconds per decode step
(extend by a few tokens + propose) on 2k-token texts, loops included.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from typing import Iterable, Sequence

import numpy as np

from clover.config import ConfigError

SEPARATOR = -1  # between outputs in the shared index, and padding past the end of a continuation
SHARED_CONTEXT = 64  # the shared index matches at most this many trailing context tokens
PYTHON_TRIE_CELLS = 64  # continuations with at most this many tokens in all: build their trie in Python
OCCURRENCE_SEARCH = 2  # collect up to this many times max_occurrences end positions, keep the most recent


@dataclasses.dataclass(frozen=True)
class SuffixProposal:
    """Candidate tokens as a trie over the continuations of the matched suffix's earlier occurrences.

    Nodes in level order (a parent precedes its children; siblings by decreasing count). All arrays int64 [n].
    ``counts[i] / total``: the share of the occurrences considered whose continuation starts with node i's path.
    """

    tokens: np.ndarray  # [n] candidate token ids
    parents: np.ndarray  # [n] index into tokens of the parent; -1: a child of the root (follows the last token)
    depths: np.ndarray  # [n] 1 for the root's children
    counts: np.ndarray  # [n] occurrences whose continuation starts with this node's path
    total: int  # occurrences considered
    match_length: int  # length of the matched suffix (0: no match, empty proposal)

    @classmethod
    def empty(cls) -> "SuffixProposal":
        none = np.zeros(0, dtype=np.int64)
        return cls(none, none, none, none, 0, 0)

    def paths(self) -> list[tuple[int, ...]]:
        """Each node's token path from the root (for tests and debugging)."""
        found: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens.tolist(), self.parents.tolist()):
            found.append((found[parent] if parent >= 0 else ()) + (token,))
        return found


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ConfigError(f"suffix proposer: {name} must be an integer >= 1, got {value!r}")


def _check_propose(max_depth: int, max_nodes: int, min_match: int) -> None:
    _check_positive(max_depth=max_depth, max_nodes=max_nodes)
    if not isinstance(min_match, (int, np.integer)) or min_match < 0:
        raise ConfigError(f"suffix proposer: min_match must be an integer >= 0, got {min_match!r}")


class _Automaton:
    """Suffix automaton with its suffix-link tree. State 0 is the root; ``pos[s]``: the end position of the
    prefix that created state s, -1 for clones; ``children[s]``: link-tree children in insertion order (a dict
    used as an ordered set; None when it has none)."""

    __slots__ = ("length", "link", "trans", "pos", "children", "last", "size")

    def __init__(self) -> None:
        self.length, self.link, self.trans, self.pos = [0], [-1], [{}], [-1]
        self.children: list[dict | None] = [None]
        self.last, self.size = 0, 0  # size: tokens appended

    def _new_state(self, length: int, link: int, trans: dict, pos: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.trans.append(trans)
        self.pos.append(pos)
        self.children.append(None)
        return len(self.length) - 1

    def _adopt(self, parent: int, child: int) -> None:
        kids = self.children[parent]
        if kids is None:
            self.children[parent] = kids = {}
        kids[child] = None

    def append(self, token: int) -> None:
        """Blumer et al.'s online extension by one token, keeping the link tree's children."""
        length, link, trans = self.length, self.link, self.trans
        cur = self._new_state(length[self.last] + 1, 0, {}, self.size)
        self.size += 1
        p = self.last
        while p != -1 and token not in trans[p]:
            trans[p][token] = cur
            p = link[p]
        if p != -1:
            q = trans[p][token]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                link[cur] = self._clone(p, q, token)
        self._adopt(link[cur], cur)
        self.last = cur

    def _clone(self, p: int, q: int, token: int) -> int:
        length, link, trans = self.length, self.link, self.trans
        clone = self._new_state(length[p] + 1, link[q], dict(trans[q]), -1)
        del self.children[link[q]][q]  # q moves under its clone in the link tree
        self._adopt(link[q], clone)
        self._adopt(clone, q)
        link[q] = clone
        while p != -1 and trans[p].get(token) == q:
            trans[p][token] = clone
            p = link[p]
        return clone

    def end_positions(self, state: int, limit: int, visits: int) -> tuple[list[int], bool]:
        """(up to ``limit`` end positions of ``state``'s strings: its link subtree's non-clone states, whether
        that is all of them), visiting at most ``visits`` states; children newest first, so recent positions
        tend to come first. A subtree with k positions has at most 2k - 1 states (clones have >= 2 children)."""
        found, stack, pos, children = [], [state], self.pos, self.children
        while stack and len(found) < limit and visits > 0:
            s = stack.pop()
            visits -= 1
            if pos[s] >= 0:
                found.append(pos[s])
            kids = children[s]
            if kids:
                stack.extend(kids)  # popped last-inserted first
        return found, not stack

    def memory_bytes(self) -> int:
        """Bytes held: the lists, every dict, and the int objects outside CPython's small-int cache."""
        total = sum(sys.getsizeof(x) for x in (self.length, self.link, self.trans, self.pos, self.children))
        total += sum(map(sys.getsizeof, self.trans))
        total += sum(sys.getsizeof(kids) for kids in self.children if kids is not None)
        big = sum(1 for v in self.length if v > 256) + sum(1 for v in self.link if v > 256)
        big += sum(1 for v in self.pos if v > 256)
        big += sum(sum(1 for v in t.values() if v > 256) + sum(1 for k in t if k > 256) for t in self.trans)
        return total + 28 * big  # a non-cached int is 28 bytes (up to 2**30)


class _TokenBuffer:
    """A growing int64 array (capacity doubling) holding the text, for vectorised continuation gathers."""

    def __init__(self) -> None:
        self.data = np.empty(256, dtype=np.int64)
        self.size = 0

    def extend(self, tokens: list[int]) -> None:
        end = self.size + len(tokens)
        if end > len(self.data):
            grown = np.empty(max(end, 2 * len(self.data)), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size:end] = tokens
        self.size = end

    @property
    def view(self) -> np.ndarray:
        return self.data[: self.size]


def _checked_tokens(tokens: Iterable[int]) -> list[int]:
    tokens = [int(t) for t in tokens]
    if tokens and min(tokens) < 0:
        raise ConfigError(f"suffix index: token ids must be >= 0, got {min(tokens)}")
    return tokens


def _recent(positions: list[int], keep: int) -> np.ndarray:
    """The ``keep`` largest positions, most recent first: int64 [<= keep]."""
    return np.array(sorted(positions, reverse=True)[:keep], dtype=np.int64)


def _continuations(text: np.ndarray, ends: np.ndarray, depth: int, periodic: bool) -> np.ndarray:
    """int64 [k, depth]: the tokens after each end position, SEPARATOR past the end of the text or after a
    separator; ``periodic``: an occurrence overlapping the text's end repeats itself (module docstring)."""
    n, steps = len(text), np.arange(depth)
    if periodic:
        index = ends[:, None] + 1 + steps[None, :] % (n - 1 - ends)[:, None]
        return text[index]
    index = ends[:, None] + 1 + steps[None, :]
    rows = text[np.minimum(index, n - 1)]
    cut = np.logical_or.accumulate((index >= n) | (rows == SEPARATOR), axis=1)
    rows[cut] = SEPARATOR
    return rows


def build_proposal(rows: np.ndarray, max_nodes: int, match_length: int) -> SuffixProposal:
    """The trie of ``rows`` (int64 [k, depth], one continuation per occurrence, most recent first, SEPARATOR:
    none), cut to its ``max_nodes`` best nodes: highest count, ties to the shallower node, then to the node with
    the more recent occurrence. A child never has more occurrences than its parent and is deeper, so the kept
    nodes are closed under ancestors. Small tries are built in Python, large ones with numpy (each is faster
    there: benchmarks/suffix_proposer.py)."""
    k, depth = rows.shape
    if k == 1:  # one occurrence (long matches, loops): a chain
        return _chain(rows[0], max_nodes, match_length)
    build = _trie_python if k * depth <= PYTHON_TRIE_CELLS else _trie_numpy
    nodes, place = _level_order(build(rows, max_nodes))
    columns = np.array([(token, place.get(parent, -1), node_depth + 1, count)
                        for _, token, parent, node_depth, count in nodes], dtype=np.int64).reshape(-1, 4).T.copy()  # [4, n]
    return SuffixProposal(tokens=columns[0], parents=columns[1], depths=columns[2], counts=columns[3],
                          total=int(k), match_length=int(match_length))


def _trie_python(rows: np.ndarray, max_nodes: int) -> list[tuple[int, int, int, int, int]]:
    """The ``max_nodes`` best nodes of the trie of ``rows``, best first, as (node id, token, parent id or -1,
    depth from 0, count): rows sorted, each shares its longest common prefix with the previous one and adds
    new nodes after it."""
    rows_list = rows.tolist()
    tokens, parents, depths, counts, recency = [], [], [], [], []
    path, previous = [], None
    for i in sorted(range(len(rows_list)), key=rows_list.__getitem__):  # stable: recent first among equals
        row, shared = rows_list[i], 0
        if previous is not None:
            for mine, theirs in zip(row, previous):
                if mine != theirs or mine == SEPARATOR:
                    break
                shared += 1
            for node in path[:shared]:
                counts[node] += 1
                recency[node] = min(recency[node], i)
        del path[shared:]
        for token in row[shared:]:
            if token == SEPARATOR:
                break
            parents.append(path[-1] if path else -1)
            path.append(len(tokens))
            tokens.append(token)
            depths.append(len(path) - 1)
            counts.append(1)
            recency.append(i)
        previous = row
    best = sorted(range(len(tokens)), key=lambda n: (-counts[n], depths[n], recency[n]))[:max_nodes]
    return [(n, tokens[n], parents[n], depths[n], counts[n]) for n in best]


def _trie_numpy(rows: np.ndarray, max_nodes: int) -> list[tuple[int, int, int, int, int]]:
    """As :func:`_trie_python`, vectorised: rows sorted; a node starts wherever a row first differs from the
    previous one; its count is its run of rows, its parent the node one level up in its first row."""
    k, depth = rows.shape
    order = np.lexsort(rows.T[::-1])  # stable, so recent first among equal rows
    ranked_t = rows[order].T  # [depth, k]
    starts = np.empty((depth, k), dtype=bool)  # a trie node begins at this depth and row
    starts[:, 0] = True
    np.logical_or.accumulate(ranked_t[:, 1:] != ranked_t[:, :-1], axis=0, out=starts[:, 1:])
    flat = starts.ravel()  # depth-major: a column's last run ends where the next column starts
    first = np.flatnonzero(flat)  # [N] each node's first cell
    counts = np.empty_like(first)
    counts[:-1] = first[1:] - first[:-1]
    counts[-1] = flat.size - first[-1]
    node_of_cell = np.cumsum(flat)  # 1-based node of each cell
    parents = node_of_cell[first - k] - 1  # the same row one level up (depth 0: fixed below)
    roots = int(np.count_nonzero(first < k))
    parents[:roots] = -1
    recency = np.minimum.reduceat(np.broadcast_to(order, (depth, k)).ravel(), first)
    tokens, depths = ranked_t.ravel()[first], first // k
    valid = np.flatnonzero(tokens != SEPARATOR)  # padding nodes (their descendants are padding too) are left out
    best = valid[np.lexsort((recency[valid], depths[valid], -counts[valid]))[:max_nodes]]
    return list(zip(best.tolist(), tokens[best].tolist(), parents[best].tolist(), depths[best].tolist(),
                    counts[best].tolist()))


def _chain(row: np.ndarray, max_nodes: int, match_length: int) -> SuffixProposal:
    size = min(max_nodes, len(row))
    if row[size - 1] == SEPARATOR:
        size = int(np.argmax(row == SEPARATOR))
    steps = np.arange(size, dtype=np.int64)
    return SuffixProposal(tokens=row[:size].copy(), parents=steps - 1, depths=steps + 1,
                          counts=np.ones(size, dtype=np.int64), total=1, match_length=int(match_length))


def _level_order(best: list[tuple[int, int, int, int, int]]) -> tuple[list[tuple], dict[int, int]]:
    """``best`` nodes (node id, token, parent id, depth, count; best first) in level order: by depth, then by
    the parent's place, then best first among siblings (count, then recency); and each node id's place."""
    by_depth = sorted(best, key=lambda node: node[3])  # stable: best first within a level
    place: dict[int, int] = {}
    out: list[tuple] = []
    start = 0
    while start < len(by_depth):
        end, depth = start, by_depth[start][3]
        while end < len(by_depth) and by_depth[end][3] == depth:
            end += 1
        level = by_depth[start:end]
        if depth:
            level.sort(key=lambda node: place[node[2]])
        for node in level:
            place[node[0]] = len(out)
            out.append(node)
        start = end
    return out, place


class SuffixIndex:
    """Per-request index over the prompt and the tokens generated so far, updated as tokens are accepted.

    ``max_occurrences``: the most earlier occurrences of the matched suffix whose continuations are counted: the
    most recent ones exactly when there are at most ``2 * max_occurrences`` of them, else ``max_occurrences``
    found by a bounded walk that favours recent ones. ``periodic``: see the module docstring.
    Memory: about 0.5-1 KB per token (two automaton states per token at most, each a few Python objects).
    """

    def __init__(self, tokens: Iterable[int] = (), max_occurrences: int = 32, periodic: bool = True) -> None:
        _check_positive(max_occurrences=max_occurrences)
        self.max_occurrences = int(max_occurrences)
        self.periodic = periodic
        self._automaton = _Automaton()
        self._text = _TokenBuffer()
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (amortised O(1) each)."""
        tokens = _checked_tokens(tokens)
        append = self._automaton.append
        for token in tokens:
            append(token)
        self._text.extend(tokens)

    def __len__(self) -> int:
        return self._text.size

    @property
    def text(self) -> np.ndarray:
        """int64 [len(self)] the indexed tokens (a view: do not modify)."""
        return self._text.view

    def match(self, min_match: int = 1) -> tuple[int, np.ndarray]:
        """(length of the longest suffix that also ends earlier, its earlier end positions considered: int64
        [<= max_occurrences], most recent first); (0, []) when shorter than ``min_match``."""
        sam = self._automaton
        state = sam.link[sam.last] if sam.last else -1
        length = sam.length[state] if state > 0 else 0
        if length < max(min_match, 1):
            return 0, np.zeros(0, dtype=np.int64)
        limit = OCCURRENCE_SEARCH * self.max_occurrences
        found, _ = sam.end_positions(state, limit + 1, visits=4 * limit)  # + 1: the text's own end is among them
        return length, _recent([p for p in found if p != sam.size - 1], self.max_occurrences)

    def propose(self, max_depth: int, max_nodes: int, min_match: int = 1) -> SuffixProposal:
        """Continuations of the longest suffix of the text that also ends earlier, as a trie of at most
        ``max_nodes`` nodes and ``max_depth`` levels (see :class:`SuffixProposal`); empty when there is no match
        of at least ``min_match`` tokens."""
        _check_propose(max_depth, max_nodes, min_match)
        length, ends = self.match(min_match)
        if not len(ends):
            return SuffixProposal.empty()
        rows = _continuations(self._text.view, ends, max_depth, self.periodic)
        return build_proposal(rows, max_nodes, length)

    def memory_bytes(self) -> int:
        return self._automaton.memory_bytes() + self._text.data.nbytes


class SharedSuffixIndex:
    """Optional global index over earlier requests' outputs (SuffixDecoding's global tree), bounded.

    At most ``max_tokens`` output tokens are kept (an output longer than that keeps its last ``max_tokens``);
    adding an output evicts the oldest ones first. One automaton over the kept outputs, each followed by a
    separator; evicted outputs stay in it, ignored, until they amount to ``max_tokens / 2`` positions, when it is
    rebuilt from the kept outputs (amortised: at most three automaton extensions per added token; the rebuild
    itself is a pause, about 0.5 s for 65536 kept tokens: docs/results/suffix-proposer).

    Memory cap: the automaton spans fewer than ``1.5 * max_tokens + outputs kept`` positions (the kept outputs,
    not yet dropped ones, and their separators), at most two states each, about 600 bytes a position;
    :meth:`memory_bytes` (checked against tracemalloc in tests/test_suffix.py) stays under
    ``MEMORY_BYTES_PER_TOKEN * max_tokens`` bytes (128 MiB at the default 65536) for outputs of 16 tokens or more.
    """

    MEMORY_BYTES_PER_TOKEN = 2048

    def __init__(self, max_tokens: int = 65536, max_occurrences: int = 32) -> None:
        _check_positive(max_tokens=max_tokens, max_occurrences=max_occurrences)
        self.max_tokens, self.max_occurrences = int(max_tokens), int(max_occurrences)
        self._outputs: deque[tuple[int, list[int]]] = deque()  # (start position in the automaton, tokens)
        self._kept = 0  # tokens in self._outputs
        self._rebuild([])

    def _rebuild(self, outputs: list[list[int]]) -> None:
        self._automaton, self._text, self._base = _Automaton(), _TokenBuffer(), 0
        self._outputs.clear()
        self._kept = 0
        for tokens in outputs:
            self._append(tokens)

    def _append(self, tokens: list[int]) -> None:
        self._outputs.append((self._text.size, tokens))
        self._kept += len(tokens)
        for token in tokens:
            self._automaton.append(token)
        self._automaton.append(SEPARATOR)
        self._text.extend(tokens + [SEPARATOR])

    def add(self, tokens: Sequence[int]) -> None:
        """Index one finished request's output, evicting the oldest outputs beyond ``max_tokens``."""
        tokens = _checked_tokens(tokens)[-self.max_tokens:]
        if not tokens:
            return
        while self._outputs and self._kept + len(tokens) > self.max_tokens:
            self._kept -= len(self._outputs.popleft()[1])
        self._base = self._outputs[0][0] if self._outputs else self._text.size
        if 2 * self._base >= self.max_tokens:  # the dropped outputs' positions amount to max_tokens / 2: rebuild
            self._rebuild([kept for _, kept in self._outputs])
        self._append(tokens)

    @property
    def num_tokens(self) -> int:
        """Output tokens kept (separators not counted)."""
        return self._kept

    def outputs(self) -> list[list[int]]:
        """The kept outputs, oldest first."""
        return [list(tokens) for _, tokens in self._outputs]

    def memory_bytes(self) -> int:
        outputs = sys.getsizeof(self._outputs) + sum(sys.getsizeof(t) + 56 for _, t in self._outputs)
        return self._automaton.memory_bytes() + self._text.data.nbytes + outputs

    def _longest(self, context: list[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``context`` found in the automaton's text."""
        sam, state, length = self._automaton, 0, 0
        trans, link = sam.trans, sam.link
        for token in context:
            while state and token not in trans[state]:
                state = link[state]
                length = sam.length[state]
            if token in trans[state]:
                state, length = trans[state][token], length + 1
        return state, length

    def match(self, context: Sequence[int], min_match: int = 1) -> tuple[int, np.ndarray]:
        """(length of the longest suffix of ``context``'s last 64 tokens that occurs in a kept output followed by
        at least one token of it, its end positions considered, most recent first); (0, []) if none >= min_match."""
        state, length = self._longest(_checked_tokens(context[-SHARED_CONTEXT:]))
        sam = self._automaton
        limit = OCCURRENCE_SEARCH * self.max_occurrences
        while state > 0 and length >= max(min_match, 1):
            found, complete = sam.end_positions(state, limit, visits=4 * limit)
            if not complete and not self._usable(found):  # the bounded walk may have missed kept ones
                found, _ = sam.end_positions(state, len(sam.pos), visits=len(sam.pos))
            ends = self._usable(found)
            if ends:
                return length, _recent(ends, self.max_occurrences)
            state = sam.link[state]  # every suffix in this state has the same end positions: back off
            length = sam.length[state]
        return 0, np.zeros(0, dtype=np.int64)

    def _usable(self, ends: list[int]) -> list[int]:
        """The end positions in kept outputs that a token of the same output follows."""
        text = self._text.view
        return [p for p in ends if p >= self._base and text[p + 1] != SEPARATOR]

    def propose(self, context: Sequence[int], max_depth: int, max_nodes: int, min_match: int = 1) -> SuffixProposal:
        """Continuations, in the kept outputs, of the longest suffix of ``context`` (its last 64 tokens) found
        there; as :meth:`SuffixIndex.propose`, a continuation stopping at the end of its output."""
        _check_propose(max_depth, max_nodes, min_match)
        length, ends = self.match(context, min_match)
        if not len(ends):
            return SuffixProposal.empty()
        rows = _continuations(self._text.view, ends, max_depth, periodic=False)
        return build_proposal(rows, max_nodes, length)
