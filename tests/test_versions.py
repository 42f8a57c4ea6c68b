"""The weight-version rule, tested once: over the one ``Fleet`` every backend is.

The rule (``rollout_backends/_versions.py``, the protocol's ``expect_version`` docstring):

- the expected version is the one declared last: ``expect_version(v)`` declares it, and so does
  every call that relabels the whole fleet (``set_weight_version``, a weight load with
  ``version=``);
- a call on some of the workers only does not move it;
- a worker is stale when it is live and serves a version other than the expected one.

Four hand-written implementations used to answer the same calls four ways (issue 15 item 1).
Now the HTTP fleet, the reference backend and the public in-memory fake are one ``Fleet`` over
different drivers, none re-implementing a protocol member
(``test_every_backend_is_the_one_fleet``), so the rule is shown here once, through public calls
on the in-memory fleet; ``VersionBook`` itself is tested in ``tests/test_version_book.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend
from rollout_backends.kit import Fleet, HttpFleetBackend
from rollout_backends.testing import FakeFleet, fake_fleet, write_checkpoint
from tests.miles.scripted import ScriptedBackend


@pytest.fixture
async def backend() -> AsyncIterator[FakeFleet]:
    b = fake_fleet(workers=2)
    try:
        yield b
    finally:
        await b.aclose()


def _last(b: FakeFleet) -> str:
    return b.workers[-1]


async def _served(backend: Fleet) -> set[str | None]:
    return set((await backend.weight_versions()).values())


async def _expect_v1_then_load_v2(b: FakeFleet, tmp: Path) -> None:
    """The start of the drift scenario: a declared version, then a whole-fleet load labelled anew."""
    b.expect_version("v1")
    await b.update_weights_from_disk(write_checkpoint(tmp / "ckpt", 2), version="v2")


def test_every_backend_is_the_one_fleet() -> None:
    protocol = {m for m in dir(rb.RolloutBackend) if not m.startswith("_")}
    for cls in (HttpFleetBackend, ReferenceBackend, FakeFleet, ScriptedBackend):
        assert issubclass(cls, Fleet), cls
        own = protocol & set(vars(cls))
        assert not own, f"{cls.__name__} re-implements {sorted(own)}"


async def test_a_whole_fleet_load_with_a_version_moves_the_expected_version(backend: FakeFleet, tmp_path: Path) -> None:
    await _expect_v1_then_load_v2(backend, tmp_path)
    assert await _served(backend) == {"v2"}
    report = await backend.health()
    assert report.expected_version == "v2"
    assert report.stale_workers == ()


async def test_a_whole_fleet_relabel_moves_the_expected_version(backend: FakeFleet, tmp_path: Path) -> None:
    await _expect_v1_then_load_v2(backend, tmp_path)
    await backend.set_weight_version("v3")
    assert await _served(backend) == {"v3"}
    report = await backend.health()
    assert report.expected_version == "v3"
    assert report.stale_workers == ()


async def test_a_relabel_of_some_workers_leaves_the_expected_version(backend: FakeFleet) -> None:
    await backend.set_weight_version("v2")
    await backend.set_weight_version("v9", workers=[_last(backend)])
    report = await backend.health()
    assert report.expected_version == "v2"
    assert report.stale_workers == (_last(backend),)


async def test_a_worker_is_stale_only_while_it_is_live(backend: FakeFleet) -> None:
    last = _last(backend)
    await backend.set_weight_version("v2")
    await backend.set_weight_version("v1", workers=[last])
    assert (await backend.health()).stale_workers == (last,)  # live and behind: stale
    backend.fake(last).live = False
    report = await backend.health()
    assert not report.worker(last).live
    assert report.expected_version == "v2"
    assert report.stale_workers == ()


async def test_stale_weights_carries_the_expected_version(backend: FakeFleet) -> None:
    first, last = backend.workers[0], _last(backend)
    await backend.set_weight_version("v2")
    await backend.set_weight_version("v9", workers=[last])
    backend.expect_version("v1")  # served by no worker: what most workers serve would be v2 or v9
    with pytest.raises(rb.StaleWeights) as info:
        await backend.weight_version()
    assert info.value.expected == "v1"
    assert info.value.served == {first: "v2", last: "v9"}
    backend.expect_version(None)  # withdrawn, and the labels disagree: nothing is expected
    with pytest.raises(rb.StaleWeights) as info:
        await backend.weight_version()
    assert info.value.expected is None
    assert (await backend.health()).expected_version is None


async def test_stamped_versions_are_the_labels_the_fleet_gave() -> None:
    # Engines that do not report versions (VersionSource.STAMPED): the fleet stamps each
    # generation with its worker's label, and weight_versions() are the labels.
    caps = rb.Capabilities(version_source=rb.VersionSource.STAMPED, worker_pinning=True, vocab_size=64)
    b = fake_fleet(workers=2, capabilities=caps)
    await b.set_weight_version("s1")
    await b.set_weight_version("s2", workers=["fake-1"])
    b.fake("fake-1").version = "what the engine would say"
    assert await b.weight_versions() == {"fake-0": "s1", "fake-1": "s2"}
    gen = await b.generate(rb.GenerateRequest(input_ids=[1, 2], worker="fake-1"))
    assert gen.weight_version == "s2"
