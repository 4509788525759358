"""``KVCacheManager.block_id_array`` (the packed int32 copy of each held table) always equals the
table's ``block_ids``: checked after every manager call while the existing state machines (plain
requests with prefix caching; chains with forks, copies, compaction and pruning) run."""

import functools
import importlib.util
from array import array
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from sparse_cache import KVCacheManager

TESTS = Path(__file__).parent


class CheckedManager(KVCacheManager):
    """Compares every held table with its packed copy after each public call."""

    def check(self) -> None:
        for request_id, held in self._requests.items():
            for t, (ids, table) in enumerate(zip(held.ids, held.tables, strict=True)):
                assert ids == array("i", table.block_ids), request_id
                assert self.block_id_array(request_id, t) is ids


def _checked(name):
    method = getattr(KVCacheManager, name)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        finally:
            self.check()

    return call


for _name in (
    "allocate",
    "make_exclusive",
    "cache_blocks",
    "shrink",
    "free",
    "attach",
    "detach",
    "resume_chain",
    "save_chain",
    "add_pruned_chain",
    "take_copies",
    "slide",
):
    setattr(CheckedManager, _name, _checked(_name))


def _load(module: str):
    spec = importlib.util.spec_from_file_location(f"_block_id_array_{module}", TESTS / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.KVCacheManager = CheckedManager  # the machines build their manager through this name
    return mod


@pytest.mark.parametrize(
    ("module", "machine"),
    [
        ("test_kv_cache_manager", "ManagerMachine"),
        ("test_chain_cache", "ChainMachine"),
        ("test_chain_cache", "RadixChainMachine"),
    ],
)
def test_packed_block_ids_follow_the_tables(module, machine):
    run_state_machine_as_test(
        getattr(_load(module), machine), settings=settings(max_examples=60, stateful_step_count=30, deadline=None)
    )


def test_packed_block_ids_through_prefix_copy_and_shrink():
    m = CheckedManager(num_blocks=16, block_size=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    m.allocate("a", 7)
    m.cache_blocks("a", prompt, 7)
    hit = m.match_prefix(prompt + [8])
    m.allocate("b", 8, prefix=hit)
    assert m.block_id_array("b")[:3] == array("i", m.table("a").block_ids[:3])
    assert m.make_exclusive("b", 0, 2)  # shared with "a": swapped for copies
    assert m.block_id_array("b")[:2] != array("i", m.table("a").block_ids[:2])
    m.allocate("a", 12)
    m.free("b")
    m.allocate("c", 5)
    m.shrink("c", 1)
    assert list(m.block_id_array("c")) == m.table("c").block_ids and len(m.table("c").block_ids) == 1
