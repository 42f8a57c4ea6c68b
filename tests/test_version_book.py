"""``VersionBook`` against a model of the rule written another way: as a replay of the history.

The book keeps state (labels, one declared version); the model keeps the list of calls and reads
the rule off it: the expected version is the one declared last, by ``declare`` or by a relabel that
covered every worker, unless a ``declare(None)`` came after it; then (or with nothing declared) it is
the one version the labels agree on. ``tests/test_versions.py`` shows the four backends that use
the book following the same rule through their public calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import rollout_backends as rb
from rollout_backends.kit import VersionBook

VERSIONS = st.sampled_from(["v0", "v1", "v2", "3", "10"])
#: Floors a request may name: the labels, and numbers no worker was ever labelled with.
FLOORS = st.none() | st.sampled_from(["v0", "v1", "v2", "3", "10", "2", "7", "11", "07"])
MAYBE_VERSION = st.none() | VERSIONS


@attrs.frozen
class Call:
    #: "record" (a launcher's knowledge), "relabel" (a set_weight_version or a load with version=),
    #: or "declare" (expect_version).
    kind: str
    version: str | None
    workers: tuple[str, ...] | None = None


@attrs.define
class Model:
    workers: tuple[str, ...]
    start: str | None
    calls: list[Call] = attrs.field(factory=list)

    def _covers(self, call: Call) -> tuple[str, ...]:
        return self.workers if call.workers is None else call.workers

    def labels(self) -> dict[str, str | None]:
        labels: dict[str, str | None] = dict.fromkeys(self.workers, self.start)
        for call in self.calls:
            if call.kind == "record" or (call.kind == "relabel" and call.version is not None):
                for w in self._covers(call):
                    labels[w] = call.version
        return labels

    def history(self) -> list[str]:
        """Labels in the order they first reached a worker (the start label first)."""
        seen: list[str] = [self.start] if self.start is not None else []
        for call in self.calls:
            new = call.version is not None and call.version not in seen
            if new and call.kind in ("record", "relabel") and self._covers(call):
                seen.append(call.version)
        return seen

    def satisfies(self, label: str | None, min_version: str | None, exact_version: str | None) -> bool:
        history = self.history()
        if exact_version is not None and label != exact_version:
            return False
        if min_version is None:
            return True
        if min_version not in history:  # never installed: numbers compare as numbers, nothing else does
            numeric = label is not None and all(
                v.isdigit() and not (len(v) > 1 and v[0] == "0") for v in (label, min_version)
            )
            return numeric and int(label) >= int(min_version)  # type: ignore[arg-type]
        return label in history and history.index(label) >= history.index(min_version)

    def expected(self) -> str | None:
        for call in reversed(self.calls):
            if call.kind == "declare":
                if call.version is not None:
                    return call.version
                break  # withdrawn: the labels decide
            if call.kind == "relabel" and call.version is not None and set(self._covers(call)) == set(self.workers):
                return call.version
        agreed = {v for v in self.labels().values() if v is not None}
        return agreed.pop() if len(agreed) == 1 else None


#: The workers, their start-up label, and the calls made on the fleet.
Fleet = tuple[tuple[str, ...], str | None, list[Call]]


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    workers = tuple(f"w{i}" for i in range(draw(st.integers(1, 3))))
    selection = st.none() | st.lists(st.sampled_from(workers), max_size=4).map(tuple)
    call = st.one_of(
        st.builds(Call, st.just("record"), MAYBE_VERSION, selection),
        st.builds(Call, st.just("relabel"), MAYBE_VERSION, selection),
        st.builds(Call, st.just("declare"), MAYBE_VERSION),
    )
    return workers, draw(MAYBE_VERSION), draw(st.lists(call, max_size=12))


def _apply(book: VersionBook, call: Call) -> None:
    if call.kind == "record":
        book.record(call.version, call.workers)
    elif call.kind == "relabel":
        book.relabelled(call.version, call.workers)
    else:
        book.declare(call.version)


@given(fleets())
def test_the_book_follows_the_rule_after_every_call(fleet: Fleet) -> None:
    workers, start, calls = fleet
    book, model = VersionBook(workers, label=start), Model(workers, start)
    for call in [None, *calls]:
        if call is not None:
            _apply(book, call)
            model.calls.append(call)
        assert book.labels == model.labels()
        assert {w: book.label(w) for w in workers} == model.labels()
        assert book.expected == model.expected(), (call, book)


@given(fleets(), FLOORS, MAYBE_VERSION)
def test_the_history_orders_labels_by_first_install(fleet: Fleet, least: str | None, exact: str | None) -> None:
    """The history (``min_version``'s order) after every call, what satisfies a constraint, and that a
    snapshot (``view``) never moves: the fleet reads a request's start version off one."""
    workers, start, calls = fleet
    book, model = VersionBook(workers, label=start), Model(workers, start)
    for call in [None, *calls]:
        before, snapshot = book.view, dict(book.view)
        if call is not None:
            _apply(book, call)
            model.calls.append(call)
        assert list(book.history) == model.history()
        assert dict(before) == snapshot  # copy on write
        assert (book.view is before) == (call is None or call.kind == "declare" or book.labels == snapshot)
        for label in [None, *model.history()]:
            got = book.satisfies(label, min_version=least, exact_version=exact)
            assert got is model.satisfies(label, least, exact), (label, least, exact, book.history)


@given(fleets(), st.data())
def test_stale_and_the_fleet_version(fleet: Fleet, data: st.DataObject) -> None:
    workers, start, calls = fleet
    book, model = VersionBook(workers, label=start), Model(workers, start, calls)
    for call in calls:
        _apply(book, call)
    expected = model.expected()
    served = {w: data.draw(MAYBE_VERSION, label=f"served[{w}]") for w in workers}
    live = {w: data.draw(st.booleans(), label=f"live[{w}]") for w in workers}
    for w in workers:
        # Stale only while live, and only against an expected version that the worker does not serve.
        want = live[w] and expected is not None and served[w] != expected
        assert VersionBook.is_stale(served[w], expected=book.expected, live=live[w]) is want
    if len(set(served.values())) == 1:
        assert book.fleet_version(served) == served[workers[0]]
    else:
        with pytest.raises(rb.StaleWeights) as info:
            book.fleet_version(served)
        assert info.value.expected == expected  # the expected version, not a vote among the served
        assert info.value.served == served


def test_the_drift_scenario_in_plain_calls() -> None:
    """The calls of REDESIGN-PLAN.md section 2.1, on the book alone."""
    book = VersionBook(["w0", "w1"])
    assert book.expected is None  # nothing known, nothing declared
    book.declare("v1")
    book.relabelled("v2")  # a whole-fleet load with version="v2"
    assert book.expected == "v2"
    book.relabelled("v3", ["w1", "w0"])  # a relabel naming every worker is a whole-fleet one
    assert book.expected == "v3"
    book.relabelled("v4", ["w1"])
    assert book.expected == "v3" and book.labels == {"w0": "v3", "w1": "v4"}
    book.declare(None)
    assert book.expected is None  # withdrawn, and the labels disagree


def test_a_start_label_is_expected_only_while_the_labels_agree() -> None:
    book = VersionBook(["ref-0", "ref-1"], label="default")
    assert book.expected == "default" and book.declared is None
    book.relabelled("v9", ["ref-0"])
    assert book.expected is None
    book.relabelled("v9", ["ref-1"])
    assert book.expected == "v9" and book.declared is None


def test_a_load_without_a_version_moves_nothing() -> None:
    book = VersionBook(["w0", "w1"], label="v0")
    book.declare("v1")
    book.relabelled(None)
    assert book.expected == "v1" and book.labels == {"w0": "v0", "w1": "v0"}


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: VersionBook([]), "workers"),
        (lambda: VersionBook(["w0"], label=""), "label"),
        (lambda: VersionBook(["w0"]).declare(""), "version"),
        (lambda: VersionBook(["w0"]).declare(3), "version"),  # type: ignore[arg-type]
        (lambda: VersionBook(["w0"]).record("v1", ["w0", "w9"]), "workers[1]"),
        (lambda: VersionBook(["w0"]).relabelled("v1", ["w9"]), "workers[0]"),
        (lambda: VersionBook(["w0"]).relabelled("", ["w0"]), "version"),
    ],
)
def test_bad_input_names_the_field(call: object, field: str) -> None:
    assert callable(call)
    with pytest.raises(rb.InvalidRequest) as info:
        call()
    assert info.value.field == field


def test_an_unknown_worker_has_no_label() -> None:
    book = VersionBook(["w0"], label="v0")
    unknown: Sequence[str | None] = ["w9", None]
    assert [book.label(w) for w in unknown] == [None, None]
