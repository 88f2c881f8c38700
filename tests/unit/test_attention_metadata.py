"""prepare_attention packs a mixed batch into exact index tensors."""

from __future__ import annotations

import pytest
import torch

from engine.attention import prepare_attention


def test_mixed_batch_metadata() -> None:
    # Block size 16. Sequence 0: prefill 3 tokens into block 7. Sequence 1: 17 cached tokens in
    # blocks [2, 5], decode 1 token at position 17 (block 5, offset 1). Sequence 2: chunk of 2
    # tokens at positions 15 and 16, crossing from block 4 into block 0.
    metadata = prepare_attention([([7], 0, 3), ([2, 5, 9], 17, 1), ([4, 0], 15, 2)], 16, "cpu")
    assert metadata.slot_mapping.tolist() == [112, 113, 114, 81, 79, 0]
    assert metadata.positions.tolist() == [0, 1, 2, 17, 15, 16]
    # Only blocks the contexts span are gathered: max ceil(18 / 16) = 2 columns.
    assert metadata.block_tables.tolist() == [[7, 0], [2, 5], [4, 0]]
    assert metadata.context_lens.tolist() == [3, 18, 17]
    assert metadata.query_start_loc.tolist() == [0, 3, 4, 6]
    assert metadata.logits_indices.tolist() == [2, 3, 5]
    assert metadata.query_seq_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert metadata.query_offsets.tolist() == [0, 1, 2, 0, 0, 1]
    assert metadata.key_mask.shape == (3, 3, 32)
    visible = metadata.key_mask.sum(dim=-1)  # [B, Q] keys each padded query sees
    assert visible.tolist() == [[1, 2, 3], [18, 1, 1], [16, 17, 1]]
    assert (metadata.num_seqs, metadata.num_new_tokens) == (3, 6)


@pytest.mark.parametrize(
    ("seqs", "message"),
    [
        ([], "at least one"),
        ([([0], 4, 0)], "num_new_tokens"),
        ([([0], 10, 7)], "cannot hold"),
    ],
)
def test_rejects_bad_sequences(seqs: list[tuple[list[int], int, int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        prepare_attention(seqs, 16, torch.device("cpu"))
