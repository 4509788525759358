"""Tail rows: one row per request, never shared, always returned (hypothesis state machine)."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sparse_cache import TailRows


def test_rows_are_per_request_and_reused_after_release():
    rows = TailRows(2)
    assert rows.row("a") == 0 and rows.row("b") == 1 and rows.row("a") == 0
    with pytest.raises(RuntimeError, match="no free tail row"):
        rows.row("c")
    rows.release("a")
    assert rows.row("c") == 0
    rows.release("unknown")  # no-op
    assert rows.num_free == 0


class TailRowsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rows = TailRows(4)
        self.model: dict[int, int] = {}

    @rule(req=st.integers(0, 7))
    def take(self, req):
        if req not in self.model and len(self.model) == 4:
            with pytest.raises(RuntimeError):
                self.rows.row(req)
            return
        row = self.rows.row(req)
        assert self.model.setdefault(req, row) == row

    @rule(req=st.integers(0, 7))
    def release(self, req):
        self.rows.release(req)
        self.model.pop(req, None)

    @invariant()
    def rows_are_distinct_and_accounted(self):
        held = self.rows.held()
        assert held == self.model
        assert len(set(held.values())) == len(held)
        assert self.rows.num_free + len(held) == 4


TestTailRows = TailRowsMachine.TestCase
TestTailRows.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
