"""Request lease state machine: legal path, illegal transitions, stale handles, invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qsa_core import (
    CapacityError,
    LeaseError,
    LeaseHandle,
    LeaseOutcome,
    LeaseState,
    LeaseTable,
    ResidentRows,
    admit_request,
    release_request,
)

_PATH = (
    LeaseState.PREFILLING,
    LeaseState.COPYING_TO_HOST,
    LeaseState.HOST_READY,
    LeaseState.DECODING,
    LeaseState.DRAINING,
)
#: The forward transitions the table allows, written out independently of its own table.
_LEGAL = {
    (LeaseState.ALLOCATED, LeaseState.PREFILLING),
    (LeaseState.PREFILLING, LeaseState.COPYING_TO_HOST),
    (LeaseState.PREFILLING, LeaseState.DECODING),
    (LeaseState.PREFILLING, LeaseState.DRAINING),
    (LeaseState.COPYING_TO_HOST, LeaseState.HOST_READY),
    (LeaseState.HOST_READY, LeaseState.DECODING),
    (LeaseState.HOST_READY, LeaseState.DRAINING),
    (LeaseState.DECODING, LeaseState.DRAINING),
}


def test_full_lifecycle_frees_the_slot() -> None:
    """A lease walks allocated -> ... -> released and its slot becomes free."""
    table = LeaseTable(2)
    h = table.acquire("a")
    assert table.state(h) is LeaseState.ALLOCATED
    for step in (table.begin_prefill, table.begin_copy, table.finish_copy, table.begin_decode):
        step(h)
    assert table.state(h) is LeaseState.DECODING
    table.finish(h)
    assert table.state(h) is LeaseState.DRAINING
    assert not table.is_aborted(h)
    table.release(h)
    assert table.state(h) is LeaseState.RELEASED
    assert table.num_free == 2


def test_a_request_that_stays_on_the_device_decodes_straight_after_prefill() -> None:
    table = LeaseTable(1)
    h = table.acquire("a")
    table.begin_prefill(h)
    table.begin_decode(h)
    assert table.state(h) is LeaseState.DECODING


def test_resident_rows_decode_once_the_whole_prompt_is_in_the_pool() -> None:
    """Admitted PREFILLING; a partial prompt leaves it; the whole prompt decodes; release frees."""
    rows = ResidentRows(2)
    h = rows.admit("a", 5)
    assert (rows.leases.state(h), rows.leases.at_engine_slot(5)) == (LeaseState.PREFILLING, h)
    rows.prompt_written(h, 64, 100)  # one chunk of two
    assert rows.leases.state(h) is LeaseState.PREFILLING
    rows.prompt_written(h, 100, 100)
    assert rows.leases.state(h) is LeaseState.DECODING
    rows.prompt_written(h, 100, 100)  # a later checkpoint while decoding changes nothing
    assert rows.leases.state(h) is LeaseState.DECODING
    rows.release(h)
    assert rows.leases.num_free == 2
    with pytest.raises(LeaseError, match=r"stale lease handle .* cannot advance to draining"):
        rows.release(h)


@pytest.mark.parametrize(
    ("finished", "aborted", "outcome"),
    [
        (True, False, LeaseOutcome.FINISHED),
        (True, True, LeaseOutcome.ABORTED),
        (False, False, LeaseOutcome.RETRACTED),
        (False, True, LeaseOutcome.RETRACTED),  # taken back before its abort finished it
    ],
)
def test_a_request_that_gives_its_row_back_has_one_outcome(
    finished: bool, aborted: bool, outcome: LeaseOutcome
) -> None:
    assert LeaseOutcome.of(finished=finished, aborted=aborted) is outcome


def test_a_table_is_idle_only_while_no_lease_is_live() -> None:
    rows = ResidentRows(2)
    seen = [rows.leases.idle]
    h = rows.admit("a", 0)
    seen.append(rows.leases.idle)
    rows.release(h)
    seen.append(rows.leases.idle)
    assert seen == [True, False, True]


@pytest.mark.parametrize(
    ("outcome", "aborted"),
    [(LeaseOutcome.FINISHED, False), (LeaseOutcome.ABORTED, True), (LeaseOutcome.RETRACTED, True)],
)
def test_a_lease_ends_aborted_unless_its_request_finished(
    outcome: LeaseOutcome, aborted: bool
) -> None:
    """An abort or a retraction mid-prompt ends the lease aborted; a finish ends it normally."""
    assert outcome.aborted is aborted
    rows = ResidentRows(1)
    h = rows.admit("a", 0)
    rows.release(h, aborted=outcome.aborted)
    assert rows.leases.num_free == 1
    assert rows.leases.state(h) is LeaseState.RELEASED


def test_a_request_may_end_at_its_first_token_but_not_while_its_copy_is_in_flight() -> None:
    """Finish from PREFILLING drains; finish from COPYING_TO_HOST is refused, naming the way on."""
    table = LeaseTable(2)
    first = table.acquire("a")
    table.begin_prefill(first)
    table.finish(first)
    assert table.state(first) is LeaseState.DRAINING
    assert not table.is_aborted(first)
    copying = table.acquire("b")
    table.begin_prefill(copying)
    table.begin_copy(copying)
    with pytest.raises(
        LeaseError, match=r"'copying_to_host' -> 'draining'.*allowed next state: 'host_ready'"
    ):
        table.finish(copying)
    table.finish_copy(copying)
    table.finish(copying)  # ended before its first decode step read the host
    assert table.state(copying) is LeaseState.DRAINING


def test_a_lease_is_found_by_its_request_id_and_its_engine_slot_until_released() -> None:
    table = LeaseTable(2)
    h = table.acquire("a", engine_slot=7)
    assert h.engine_slot == 7
    assert table.find("a") == h
    assert table.at_engine_slot(7) == h
    assert table.at_engine_slot(0) is None
    assert table.find("b") is None
    table.abort(h)
    table.release(h)
    assert table.find("a") is None
    assert table.at_engine_slot(7) is None
    again = table.acquire("b", engine_slot=7)  # the engine reuses its slot for the next request
    assert table.at_engine_slot(7) == again


def test_an_engine_slot_of_a_live_lease_is_refused_naming_its_holder() -> None:
    table = LeaseTable(2)
    table.acquire("a", engine_slot=3)
    with pytest.raises(LeaseError, match=r"engine slot 3 of request 'b' belongs to .*'a'"):
        table.acquire("b", engine_slot=3)
    assert table.num_free == 1
    assert table.find("b") is None
    with pytest.raises(LeaseError, match="engine_slot=-1 is not allowed"):
        table.acquire("b", engine_slot=-1)


@pytest.mark.parametrize("aborted", [False, True])
def test_ending_a_lease_frees_its_slot_and_counts_it_aborted_or_not(aborted: bool) -> None:
    table = LeaseTable(1)
    h = table.acquire("a", engine_slot=0)
    table.begin_prefill(h)
    table.begin_decode(h)
    table.end(h, aborted=aborted)
    assert table.state(h) is LeaseState.RELEASED
    assert table.num_free == 1
    assert table.at_engine_slot(0) is None


def test_skipping_a_state_is_illegal() -> None:
    """ALLOCATED cannot jump to DECODING; the error names both states and the allowed one."""
    table = LeaseTable(1)
    h = table.acquire("a")
    with pytest.raises(
        LeaseError, match=r"'allocated' -> 'decoding'.*allowed next state: 'prefilling'"
    ):
        table.advance(h, LeaseState.DECODING)


def test_release_requires_draining() -> None:
    """Releasing a decoding lease is illegal; advance() cannot release either."""
    table = LeaseTable(1)
    h = table.acquire("a")
    with pytest.raises(LeaseError, match="released only from 'draining'"):
        table.release(h)
    table.abort(h)
    with pytest.raises(LeaseError, match="call release"):
        table.advance(h, LeaseState.RELEASED)


@pytest.mark.parametrize("steps", range(5))
def test_abort_from_any_live_state_drains(steps: int) -> None:
    """Abort from every state before DRAINING moves to DRAINING and marks the lease aborted."""
    table = LeaseTable(1)
    h = table.acquire("a")
    for target in _PATH[:steps]:
        table.advance(h, target)
    table.abort(h)
    assert table.state(h) is LeaseState.DRAINING
    assert table.is_aborted(h)
    table.abort(h)  # idempotent while draining
    table.release(h)
    assert table.num_free == 1


def test_stale_handle_cannot_touch_the_reused_slot() -> None:
    """After release and reuse of slot 0, the old handle is rejected and the new lease unharmed."""
    table = LeaseTable(1)
    old = table.acquire("a")
    table.abort(old)
    table.release(old)
    new = table.acquire("b")
    assert new.slot == old.slot
    assert new.generation > old.generation
    with pytest.raises(LeaseError, match="stale lease handle"):
        table.abort(old)
    with pytest.raises(LeaseError, match="stale lease handle"):
        table.begin_prefill(old)
    assert table.state(new) is LeaseState.ALLOCATED


def test_full_table_and_duplicate_request_are_rejected() -> None:
    """No free slot and a second live lease for one request id both raise."""
    table = LeaseTable(1)
    table.acquire("a")
    with pytest.raises(LeaseError, match="request 'a' already holds"):
        table.acquire("a")
    with pytest.raises(LeaseError, match="no free slot for request 'b'"):
        table.acquire("b")


def test_forged_handle_is_rejected() -> None:
    """A handle with a generation never issued is not reported as released."""
    table = LeaseTable(1)
    with pytest.raises(LeaseError, match="never issued"):
        table.state(LeaseHandle(0, 99, "x"))


def test_table_size_must_be_positive() -> None:
    """A table needs at least one slot."""
    with pytest.raises(CapacityError, match="num_slots=0"):
        LeaseTable(0)


class LeaseMachine(RuleBasedStateMachine):
    """Random interleavings of every operation, legal or not, against a model of the table."""

    def __init__(self) -> None:
        super().__init__()
        self.table = LeaseTable(3)
        self.model: dict[LeaseHandle, LeaseState] = {}
        self.dead: list[LeaseHandle] = []
        self.counter = 0

    @rule(engine_slot=st.integers(0, 4))
    def acquire(self, engine_slot: int) -> None:
        self.counter += 1
        live = list(self.model)
        if len(live) == 3 or any(h.engine_slot == engine_slot for h in live):
            with pytest.raises(LeaseError):
                self.table.acquire(f"r{self.counter}", engine_slot=engine_slot)
            return
        h = self.table.acquire(f"r{self.counter}", engine_slot=engine_slot)
        assert self.table.at_engine_slot(engine_slot) == h
        assert all(h.slot != other.slot for other in live)
        assert all(h.generation > d.generation for d in self.dead)
        self.model[h] = LeaseState.ALLOCATED

    @precondition(lambda self: self.model)
    @rule(data=st.data(), to=st.sampled_from(list(LeaseState)))
    def advance(self, data: st.DataObject, to: LeaseState) -> None:
        h = data.draw(st.sampled_from(sorted(self.model, key=lambda x: x.generation)))
        if (self.model[h], to) in _LEGAL:
            self.table.advance(h, to)
            self.model[h] = to
        else:
            with pytest.raises(LeaseError):
                self.table.advance(h, to)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model, key=lambda x: x.generation)))
        self.table.abort(h)
        self.model[h] = LeaseState.DRAINING

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(sorted(self.model, key=lambda x: x.generation)))
        if self.model[h] is LeaseState.DRAINING:
            self.table.release(h)
            del self.model[h]
            self.dead.append(h)
        else:
            with pytest.raises(LeaseError):
                self.table.release(h)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def stale_handle_is_rejected(self, data: st.DataObject) -> None:
        h = data.draw(st.sampled_from(self.dead))
        assert self.table.state(h) is LeaseState.RELEASED
        with pytest.raises(LeaseError, match="stale"):
            self.table.abort(h)

    @invariant()
    def table_matches_model(self) -> None:
        self.table.check_invariants()
        assert set(self.table.live_handles()) == set(self.model)
        for h, s in self.model.items():
            assert self.table.state(h) is s
            assert self.table.find(h.request_id) == h
            assert h.engine_slot is None or self.table.at_engine_slot(h.engine_slot) == h
        slots = [h.slot for h in self.model]
        assert len(slots) == len(set(slots))
        assert self.table.num_free == 3 - len(self.model)

    def teardown(self) -> None:
        # nothing leaks: draining everything that is left frees every slot
        for h in list(self.model):
            self.table.abort(h)
            self.table.release(h)
        assert self.table.num_free == 3


LeaseMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_lease_invariants_under_random_operations = LeaseMachine.TestCase


def test_admit_request_leases_a_prompt_once_over_its_chunks() -> None:
    """The first chunk admits (PREFILLING, at its engine slot); a later chunk gets None."""
    rows = ResidentRows(2)
    h = admit_request(rows, "a", 3)
    assert h is not None
    assert (rows.leases.state(h), rows.leases.at_engine_slot(3)) == (LeaseState.PREFILLING, h)
    assert admit_request(rows, "a", 3) is None
    assert rows.leases.live_handles() == (h,)
    with pytest.raises(LeaseError, match="engine slot 3 of request 'b' belongs to"):
        admit_request(rows, "b", 3)


class _RecordingRows(ResidentRows):
    """Resident rows that record how each lease was released."""

    __slots__ = ("released",)

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.released: list[tuple[str, bool]] = []

    def release(self, handle: LeaseHandle, *, aborted: bool = False) -> None:
        self.released.append((handle.request_id, aborted))
        super().release(handle, aborted=aborted)


@pytest.mark.parametrize(
    ("finished", "aborted", "outcome"),
    [
        (True, False, LeaseOutcome.FINISHED),
        (True, True, LeaseOutcome.ABORTED),
        (False, False, LeaseOutcome.RETRACTED),
    ],
)
def test_release_request_ends_the_lease_with_its_outcome(
    finished: bool, aborted: bool, outcome: LeaseOutcome
) -> None:
    """The outcome of :meth:`LeaseOutcome.of`, released aborted unless it finished normally."""
    rows = _RecordingRows(1)
    h = rows.admit("a", 0)
    rows.prompt_written(h, 8, 8)
    assert release_request(rows, "a", finished=finished, aborted=aborted) is outcome
    assert (rows.released, rows.leases.idle) == ([("a", outcome.aborted)], True)
    with pytest.raises(LeaseError, match="request 'a' released a KV row without holding a lease"):
        release_request(rows, "a", finished=True, aborted=False)
