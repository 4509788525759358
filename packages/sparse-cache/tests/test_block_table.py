import pytest

from sparse_cache import BlockTable, LayerTables


def test_slots_and_last_block_len():
    t = BlockTable(block_size=4, block_ids=[7, 2], num_tokens=6)
    assert [t.slot(p) for p in range(6)] == [28, 29, 30, 31, 8, 9]
    assert t.last_block_len() == 2
    assert t.blocks_needed(8) == 0 and t.blocks_needed(9) == 1
    with pytest.raises(IndexError):
        t.slot(8)


def test_layer_tables_hold_every_layer_but_the_null_block():
    tables = LayerTables([BlockTable(4, [0, 5], 6), BlockTable(4, [3], 2)], null_block=0)
    assert tables[1].block_ids == [3] and len(tables) == 2
    assert tables.block_ids == [5, 3] and tables.num_tokens == 6 and tables.block_size == 4
    copy = tables.copy()
    copy[0].block_ids.append(9)
    assert tables[0].block_ids == [0, 5] and copy.null_block == 0
