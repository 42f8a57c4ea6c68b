"""``VersionBook``: the weight-version rule of a fleet, stated once.

Before this module each backend kept its own expected version, and their rules drifted: after
``expect_version("v1")`` and a whole-fleet load labelled ``"v2"``, the HTTP fleet reported every
worker stale while the reference fleet moved on (REDESIGN-PLAN.md section 2.1 has the
reproduction; ``tests/test_versions.py`` runs it over every backend). The rule, as the protocol's
``expect_version`` docstring states it:

- the expected version is the one declared last;
- ``expect_version(v)`` declares ``v``; so does every operation that relabels the whole fleet
  (``set_weight_version``, and a weight load with ``version=``, on all workers), so a committed
  ``weight_update`` declares its version and a rolled-back one the version served before it;
- an operation on some of the workers only declares nothing;
- with nothing declared (or after ``expect_version(None)``), the expected version is the one label
  the labelled workers agree on, else ``None``;
- a worker is stale only while it is live and serves a version other than the expected one (with
  no expected version, none is).

The book also keeps the fleet's history of labels: each label it recorded or relabelled, once, in
the order it first appeared (a label put back by a rollback keeps its first place). That order is
what ``GenerateRequest.min_version`` means by "this version or a later one" (``satisfies``): labels
are names the trainer chose, not numbers, so the only order the fleet can vouch for is the one in
which it installed them.

The book holds labels, not served versions: the label is what a worker was last told to serve,
which is all a fleet knows of engines that do not report versions (``VersionSource.STAMPED``
stamps generations with it). Where engines report versions, the served version is read from them
and compared with ``expected``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

from rollout_backends._errors import InvalidRequest, StaleWeights

__all__ = ["VersionBook"]


class VersionBook:
    """The version label of each worker of a fleet, and the version they are all expected to serve.

    Mutable state owned by one fleet (not a value type); every method is synchronous, so no
    ``await`` can interleave with an update.
    """

    __slots__ = ("_declared", "_history", "_labels", "_rank", "_view")

    def __init__(self, workers: Iterable[str], label: str | None = None) -> None:
        """A book for ``workers``, each labelled ``label`` (the start-up version, where known).

        The start-up label is a record, not a declaration: a fleet that started on ``"default"``
        expects ``"default"`` only while its labels agree on it.
        """
        self._labels: dict[str, str | None] = dict.fromkeys(workers, label)
        if not self._labels:
            raise InvalidRequest("workers", "a fleet needs at least one worker")
        _check(label, "label")
        self._declared: str | None = None
        self._rank: dict[str, int] = {}  # label -> its place in the history
        self._history: tuple[str, ...] = ()
        self._view: Mapping[str, str | None] = MappingProxyType({})
        self._changed(label)

    def _changed(self, label: str | None) -> None:
        # Copy on write: a snapshot taken before a change (``view``) never sees it.
        if self._view != self._labels:
            self._view = MappingProxyType(dict(self._labels))
        if label is not None and label not in self._rank:
            self._rank[label] = len(self._history)
            self._history = (*self._history, label)

    @property
    def view(self) -> Mapping[str, str | None]:
        """The labels now, read-only and never changed afterwards: a snapshot costs nothing, and
        ``view is`` a later ``view`` exactly when no label changed in between."""
        return self._view

    @property
    def history(self) -> tuple[str, ...]:
        """Every label recorded or relabelled, once, in the order it first appeared."""
        return self._history

    def rank(self, label: str | None) -> int | None:
        """The place of ``label`` in the history (0: first); ``None`` if it never reached a worker."""
        return self._rank.get(label) if label is not None else None

    def satisfies(self, label: str | None, *, min_version: str | None, exact_version: str | None) -> bool:
        """Whether a worker labelled ``label`` may serve a request with these constraints: its label
        is ``exact_version`` (if given) and is ``min_version`` or a label first installed after it
        (if given). An unknown label satisfies no constraint; no constraint is satisfied by any.

        A ``min_version`` this fleet never installed has no place in the history; where it and the
        label are both decimal numbers, they compare as numbers: Miles numbers its versions and
        Stitch's floor is ``applied >= min_version`` (``VersionConstraint.satisfied_by``,
        modal-projects/stitch a250dc3), sent as ``latest - lag`` whether or not this fleet saw it."""
        if exact_version is not None and label != exact_version:
            return False
        if min_version is None:
            return True
        if label is None:
            return False
        at, least = self._rank.get(label), self._rank.get(min_version)
        if least is None:
            return _decimal(label) and _decimal(min_version) and int(label) >= int(min_version)
        return at is not None and at >= least

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._labels)

    @property
    def labels(self) -> dict[str, str | None]:
        """Each worker's label (a copy)."""
        return dict(self._labels)

    def label(self, worker: str | None) -> str | None:
        """The label of ``worker``; ``None`` for a worker the book does not know (or ``None``)."""
        return self._labels.get(worker) if worker is not None else None

    @property
    def declared(self) -> str | None:
        """The version declared last, if any (``None``: the labels decide)."""
        return self._declared

    @property
    def expected(self) -> str | None:
        """The version every worker should serve: the declared one, else the labels' common one."""
        if self._declared is not None:
            return self._declared
        agreed = {v for v in self._labels.values() if v is not None}
        return next(iter(agreed)) if len(agreed) == 1 else None

    def record(self, version: str | None, workers: Sequence[str] | None = None) -> None:
        """Note that ``workers`` (``None``: all) serve ``version``, declaring nothing.

        For what a fleet learns rather than does: a launcher that knows the start-up version.
        """
        _check(version, "version")
        selected = self._selected(workers)
        for w in selected:
            self._labels[w] = version
        self._changed(version if selected else None)

    def relabelled(self, version: str | None, workers: Sequence[str] | None = None) -> None:
        """An operation gave ``workers`` (``None``: all) the label ``version``: record it, and if it
        covered the whole fleet, declare ``version`` expected.

        Call it after the operation succeeded. ``version=None`` (a load that keeps the labels)
        changes nothing.
        """
        if version is None:
            return
        _check(version, "version")
        selected = self._selected(workers)
        for w in selected:
            self._labels[w] = version
        self._changed(version if selected else None)
        if set(selected) >= self._labels.keys():
            self._declared = version

    def declare(self, version: str | None) -> None:
        """``expect_version``: ``version`` is expected from now on; ``None`` withdraws the declaration."""
        _check(version, "version")
        self._declared = version

    @staticmethod
    def is_stale(version: str | None, *, expected: str | None, live: bool) -> bool:
        """Whether a worker serving ``version`` is stale against ``expected`` (read once per report)."""
        return live and expected is not None and version != expected

    def fleet_version(self, served: Mapping[str, str | None]) -> str | None:
        """The one version every worker serves; ``StaleWeights`` (with the expected version) if they
        disagree."""
        distinct = set(served.values())
        if len(distinct) > 1:
            raise StaleWeights(self.expected, dict(served))
        return next(iter(distinct), None)

    def _selected(self, workers: Sequence[str] | None) -> Sequence[str]:
        if workers is None:
            return tuple(self._labels)
        for i, w in enumerate(workers):
            if w not in self._labels:
                raise InvalidRequest(f"workers[{i}]", f"unknown worker {w!r} (known: {sorted(self._labels)})")
        return workers

    def __repr__(self) -> str:
        return f"<VersionBook expected={self.expected!r} declared={self._declared!r} labels={self._labels!r}>"


def _decimal(label: str) -> bool:
    """A label written as a number (``"7"``; not ``"07"``, ``"+7"`` or ``"7.0"``)."""
    return label.isascii() and label.isdigit() and (label == "0" or not label.startswith("0"))


def _check(version: object, field: str) -> None:
    if version is not None and (not isinstance(version, str) or not version):
        raise InvalidRequest(field, f"must be a non-empty string or None, got {version!r}"[:200])
