import pytest

from sparse_cache import BlockTable, LayerTables


def test_slots_and_last_block_len():
    t = BlockTable(block_size=4, block_ids=[7, 2], num_tokens=6)
    assert [t.slot(p) for p in range(6)] == [28, 29, 30, 31, 8, 9]
    assert t.last_block_len() == 2
    assert t.blocks_needed(8) == 0 and t.blocks_needed(9) == 1
    with pytest.raises(IndexError):
        t.slot(8)


def test_shared_and_per_layer_tables():
    shared = LayerTables(3, block_size=16, shared=True)
    assert shared[0] is shared[2]
    split = LayerTables(3, block_size=16, shared=False)
    assert split[0] is not split[1]
    with pytest.raises(IndexError):
        split[3]
