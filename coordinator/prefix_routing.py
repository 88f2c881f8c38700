"""Prefix-aware routing: which worker's prefix tree probably holds most of a prompt.

The coordinator TRACKS rather than asks: it computes the prompt's chained block keys exactly as
the workers' prefix trees do (`engine.prefix_tree.block_key`: same block size, same salt), and
remembers per worker, in a bounded LRU, the keys of the prompts it sent there that the worker
took (a generation worker that streamed, a context worker that prefilled). A worker evicts on its
own, restarts empty, and other coordinators route too, so the score is a hint: a wrong guess
costs a pull or a prefill, never a wrong answer.

Choice (`rank`): among the candidates whose load is within `slack` requests of the least loaded
one, the most leading prompt blocks matched wins; ties, and everything past the slack, go by
load. The slack keeps a popular shared prefix (a system prompt) from piling every request onto
one worker.

    prompt, block T:  [ key0 ][ key1 ][ key2 ][ tail )   recorded: full blocks of the prompt
    lookup:           [ key0 ][ key1 ][ key2 )           prompt[:-1], as a worker's lookup
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.prefix_tree import ROOT_KEY, block_key

DEFAULT_CAPACITY = 65536  # keys per worker when its pool size is unknown


@dataclass(frozen=True)
class PromptKeys:
    """A prompt's block keys: what a worker's tree holds once it took the prompt (`recorded`), and
    what its lookup can match (`lookup`, the full blocks of prompt[:-1])."""

    recorded: tuple[bytes, ...]
    num_lookup: int

    @property
    def lookup(self) -> tuple[bytes, ...]:
        return self.recorded[: self.num_lookup]


def prompt_keys(prompt_ids: Sequence[int], salt: bytes, tokens_per_block: int) -> PromptKeys:
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    keys = []
    parent = ROOT_KEY
    for start in range(0, len(prompt_ids) - tokens_per_block + 1, tokens_per_block):
        parent = block_key(parent, list(prompt_ids[start : start + tokens_per_block]), salt)
        keys.append(parent)
    return PromptKeys(tuple(keys), max(0, len(prompt_ids) - 1) // tokens_per_block)


class PrefixIndex:
    """The block keys this coordinator believes one worker's prefix tree holds, LRU-bounded."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, lookup: Sequence[bytes]) -> int:
        """Leading blocks found: a chain stops at its first missing key, as a tree lookup does."""
        num_matched = 0
        for key in lookup:
            if key not in self._keys:
                break
            num_matched += 1
        return num_matched

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)  # least recently sent first, like the workers' LRU

    def resize(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def clear(self) -> None:
        self._keys.clear()

    def check_integrity(self) -> None:
        assert 0 <= len(self._keys) <= self.capacity, f"{len(self._keys)} keys past capacity {self.capacity}"
        assert all(len(key) == len(ROOT_KEY) for key in self._keys), "a key of the wrong size"


@dataclass(frozen=True)
class Candidate:
    """One routable worker as `rank` sees it."""

    index: int  # position in the pool: the last tie-break, so idle workers fill in order
    load: int
    num_in_flight: int
    num_matched_blocks: int


def rank(candidates: Sequence[Candidate], slack: int) -> Candidate:
    """The worker to route to (see the module docstring); `candidates` must not be empty."""
    least_load = min(candidate.load for candidate in candidates)

    def preference(candidate: Candidate) -> tuple[int, int, int, int]:
        is_within_slack = candidate.load <= least_load + slack
        affinity = candidate.num_matched_blocks if is_within_slack else 0
        return (-affinity, candidate.load, candidate.num_in_flight, candidate.index)

    return min(candidates, key=preference)
