from __future__ import annotations

import pytest

from engine.prefix_tree import ROOT_KEY, PrefixMatch, PrefixTree, block_key

T = 4


def build_chain(
    tree: PrefixTree, token_ids: list[int], block_ids: list[int], salt: bytes = b""
) -> list[bytes]:
    keys = []
    parent_key = ROOT_KEY
    for index, block_id in enumerate(block_ids):
        parent_key = tree.insert(parent_key, token_ids[index * T : (index + 1) * T], salt, block_id)
        keys.append(parent_key)
        tree.check_integrity()
    return keys


def test_key_depends_on_parent_tokens_and_salt() -> None:
    key = block_key(ROOT_KEY, [1, 2, 3, 4])
    assert key == block_key(ROOT_KEY, (1, 2, 3, 4))
    assert len(key) == 32
    assert key != block_key(ROOT_KEY, [1, 2, 3, 5])
    assert key != block_key(ROOT_KEY, [1, 2, 3, 4], b"tenant")
    assert key != block_key(block_key(ROOT_KEY, [0]), [1, 2, 3, 4])
    # The salt is length-prefixed: moving bytes between salt and tokens changes the key.
    assert block_key(ROOT_KEY, [1], b"") != block_key(ROOT_KEY, [], b"\x01\x00\x00\x00\x00\x00\x00\x00")


def test_match_full_blocks_stops_at_first_mismatch() -> None:
    tree = PrefixTree(T)
    build_chain(tree, list(range(12)), [7, 3, 5])
    assert tree.match(list(range(13))) == PrefixMatch([7, 3, 5], 12)
    assert tree.match(list(range(11))) == PrefixMatch([7, 3], 8)
    assert tree.match([0, 1, 2, 3, 4, 5, 9, 7, 8, 9, 10, 11]) == PrefixMatch([7], 4)
    assert tree.match([9]) == PrefixMatch([], 0)
    assert tree.match([]) == PrefixMatch([], 0)


def test_salt_isolates_tenants_also_for_partial_reuse() -> None:
    tree = PrefixTree(T)
    build_chain(tree, list(range(8)), [0, 1], salt=b"alice")
    assert tree.match(list(range(8)), b"bob", allow_partial_reuse=True) == PrefixMatch([], 0)
    assert tree.match(list(range(8)), b"") == PrefixMatch([], 0)
    assert tree.match(list(range(8)), b"alice") == PrefixMatch([0, 1], 8)
    assert tree.match([0, 1, 2], b"alice", allow_partial_reuse=True) == PrefixMatch([], 3, 0, 3)


def test_partial_reuse_takes_longest_common_prefix_of_a_child() -> None:
    tree = PrefixTree(T)
    keys = build_chain(tree, [0, 1, 2, 3, 4, 5, 6, 7], [10, 11])
    tree.insert(keys[0], [4, 5, 9, 9], b"", 12)
    tree.insert(keys[0], [4, 8], b"", 13)
    tree.check_integrity()
    lookup = [0, 1, 2, 3, 4, 5, 6, 9]
    assert tree.match(lookup) == PrefixMatch([10], 4)
    assert tree.match(lookup, allow_partial_reuse=True) == PrefixMatch([10], 7, 11, 3)
    assert tree.match([0, 1, 2, 3, 4, 8, 1], allow_partial_reuse=True) == PrefixMatch([10], 6, 13, 2)
    assert tree.match([0, 1, 2, 3, 7], allow_partial_reuse=True) == PrefixMatch([10], 4)


def test_published_partial_block_matches_exactly_without_partial_reuse() -> None:
    tree = PrefixTree(T)
    keys = build_chain(tree, [0, 1, 2, 3], [0])
    tree.insert(keys[0], [4, 5], b"", 1)
    assert tree.match([0, 1, 2, 3, 4, 5]) == PrefixMatch([0], 6, 1, 2)
    # One token short of the published block: only partial reuse may use it.
    assert tree.match([0, 1, 2, 3, 4]) == PrefixMatch([0], 4)
    assert tree.match([0, 1, 2, 3, 4], allow_partial_reuse=True) == PrefixMatch([0], 5, 1, 1)


def test_insert_keeps_first_publisher_and_rejects_bad_blocks() -> None:
    tree = PrefixTree(T)
    key = tree.insert(ROOT_KEY, [1, 2, 3, 4], b"", 0)
    assert tree.insert(ROOT_KEY, [1, 2, 3, 4], b"", 5) == key
    assert tree.key_of_block(0) == key and tree.key_of_block(5) is None
    assert len(tree) == 1
    with pytest.raises(ValueError):
        tree.insert(ROOT_KEY, [9, 9, 9, 9], b"", 0)  # block 0 already holds another key
    with pytest.raises(ValueError):
        tree.insert(ROOT_KEY, [1, 2, 3, 4, 5], b"", 6)
    with pytest.raises(ValueError):
        tree.insert(ROOT_KEY, [], b"", 6)
    tree.check_integrity()


def test_evict_forgets_key_and_orphan_is_found_again_after_parent_returns() -> None:
    tree = PrefixTree(T)
    build_chain(tree, list(range(8)), [0, 1])
    tree.evict(0)
    tree.check_integrity()
    assert tree.key_of_block(0) is None and len(tree) == 1
    assert tree.match(list(range(9))) == PrefixMatch([], 0)
    tree.evict(0)  # no key: no-op
    tree.insert(ROOT_KEY, [0, 1, 2, 3], b"", 4)
    tree.check_integrity()
    assert tree.match(list(range(9))) == PrefixMatch([4, 1], 8)


def test_check_integrity_catches_a_stale_index() -> None:
    tree = PrefixTree(T)
    build_chain(tree, list(range(4)), [0])
    tree._key_of_block[3] = tree._key_of_block.pop(0)
    with pytest.raises(AssertionError):
        tree.check_integrity()
