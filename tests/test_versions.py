"""The weight-version rule, stated once and run over every hand-written ``RolloutBackend``.

The rule (REDESIGN-PLAN.md section 3.2, "VersionBook"):

- the expected version is the one declared last: ``expect_version(v)`` declares it, and so does
  every call that relabels the whole fleet (``set_weight_version``, a weight load with
  ``version=``);
- a call on some of the workers only does not move it;
- a worker is stale when it is live and serves a version other than the expected one.

Four implementations used to answer the same calls four ways (the plan's section 2.1 has the
reproduction these tests grew from); all four now keep their versions in one ``VersionBook``
(``rollout_backends/_versions.py``, tested on its own in ``tests/test_version_book.py``), and these
tests show each of them following the rule through its public calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend, make_tiny_model
from rollout_backends.adapters.sglang import SGLangWire
from rollout_backends.kit import HttpClient, HttpFleetBackend, HttpRequest, HttpResponse, MockTransport, Worker
from tests.conformance.fake_backend import FakeBackend, write_checkpoint
from tests.miles.scripted import ScriptedBackend

HTTP, REFERENCE, FAKE, SCRIPTED = "http-sglang", "reference", "conformance-fake", "miles-scripted"


@attrs.frozen
class Subject:
    backend: Any  # a RolloutBackend (BackendBase subclasses are not structurally one yet: B7)
    #: A checkpoint ``update_weights_from_disk`` accepts.
    weights: str
    #: Makes one worker not live (``None``: the implementation has no dead workers).
    kill: Callable[[str], Awaitable[None]] | None = None

    @property
    def last(self) -> str:
        return str(self.backend.workers[-1])


def _sglang_fleet() -> Subject:
    """Two SGLang-native workers behind a MockTransport, each keeping the version it was told."""
    versions = {f"http://w{i}:3000{i}": "v0" for i in range(2)}
    down: set[str] = set()

    def handle(req: HttpRequest) -> HttpResponse:
        parts = urlsplit(req.url)
        base, path, body = f"{parts.scheme}://{parts.netloc}", parts.path, req.json or {}
        if base in down:
            raise rb.ConnectionFailed(f"{req.method} {req.url}: cannot connect (refused)")
        if path == "/model_info":
            return HttpResponse.from_json({"weight_version": versions[base]})
        if path == "/update_weights_from_disk" and body.get("weight_version"):
            versions[base] = body["weight_version"]
        if path == "/update_weight_version":
            versions[base] = body["new_version"]
        if path in ("/health", "/health_generate"):
            return HttpResponse(200, b"")
        return HttpResponse.from_json({"success": True, "message": "ok"})

    urls = list(versions)
    workers = [Worker(id=f"w{i}", control_url=u, generate_url=u) for i, u in enumerate(urls)]
    backend = HttpFleetBackend(SGLangWire(entry_url=urls[0]), workers, client=HttpClient(MockTransport(handle)))

    async def kill(worker: str) -> None:
        down.add(urls[backend.workers.index(worker)])

    return Subject(backend, "/ckpt/step-2", kill)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("versions-model"), seed=0)


@pytest.fixture
async def subject(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Subject]:
    name = request.param
    if name == HTTP:
        made = _sglang_fleet()
    elif name == REFERENCE:
        model = request.getfixturevalue("model_dir")
        backend = ReferenceBackend.create(model, workers=2)

        async def close_engine(worker: str) -> None:
            await backend.engine(worker).aclose()

        made = Subject(backend, str(model), close_engine)
    elif name == FAKE:
        made = Subject(FakeBackend(workers=2), write_checkpoint(tmp_path / "ckpt", 2))
    else:
        made = Subject(ScriptedBackend(), "/ckpt/step-2")
    try:
        yield made
    finally:
        await made.backend.aclose()


def _over(names: tuple[str, ...] = (HTTP, REFERENCE, FAKE, SCRIPTED)) -> list[Any]:
    """The implementations, by name."""
    return [pytest.param(name, id=name) for name in names]


async def _served(backend: Any) -> set[str | None]:
    return set((await backend.weight_versions()).values())


async def _expect_v1_then_load_v2(subject: Subject) -> None:
    """The start of the drift scenario: a declared version, then a whole-fleet load labelled anew."""
    subject.backend.expect_version("v1")
    await subject.backend.update_weights_from_disk(subject.weights, version="v2")


@pytest.mark.parametrize("subject", _over(), indirect=True)
async def test_a_whole_fleet_load_with_a_version_moves_the_expected_version(subject: Subject) -> None:
    b = subject.backend
    await _expect_v1_then_load_v2(subject)
    assert await _served(b) == {"v2"}
    report = await b.health()
    assert report.expected_version == "v2"
    assert report.stale_workers == ()


@pytest.mark.parametrize("subject", _over(), indirect=True)
async def test_a_whole_fleet_relabel_moves_the_expected_version(subject: Subject) -> None:
    b = subject.backend
    await _expect_v1_then_load_v2(subject)
    await b.set_weight_version("v3")
    assert await _served(b) == {"v3"}
    report = await b.health()
    assert report.expected_version == "v3"
    assert report.stale_workers == ()


@pytest.mark.parametrize("subject", _over(), indirect=True)
async def test_a_relabel_of_some_workers_leaves_the_expected_version(subject: Subject) -> None:
    b = subject.backend
    await b.set_weight_version("v2")
    await b.set_weight_version("v9", workers=[subject.last])
    report = await b.health()
    assert report.expected_version == "v2"
    assert report.stale_workers == (subject.last,)


@pytest.mark.parametrize("subject", _over((HTTP, REFERENCE)), indirect=True)
async def test_a_worker_is_stale_only_while_it_is_live(subject: Subject) -> None:
    # The two test fakes have no dead workers, so the rule's last clause cannot be shown on them.
    b = subject.backend
    assert subject.kill is not None
    await b.set_weight_version("v2")
    await b.set_weight_version("v1", workers=[subject.last])
    assert (await b.health()).stale_workers == (subject.last,)  # live and behind: stale
    await subject.kill(subject.last)
    report = await b.health()
    assert not report.worker(subject.last).live
    assert report.expected_version == "v2"
    assert report.stale_workers == ()


@pytest.mark.parametrize("subject", _over(), indirect=True)
async def test_stale_weights_carries_the_expected_version(subject: Subject) -> None:
    b = subject.backend
    first = b.workers[0]
    await b.set_weight_version("v2")
    await b.set_weight_version("v9", workers=[subject.last])
    b.expect_version("v1")  # served by no worker: what most workers serve would be v2 or v9
    with pytest.raises(rb.StaleWeights) as info:
        await b.weight_version()
    assert info.value.expected == "v1"
    assert info.value.served == {first: "v2", subject.last: "v9"}
    b.expect_version(None)  # withdrawn, and the labels disagree: nothing is expected
    with pytest.raises(rb.StaleWeights) as info:
        await b.weight_version()
    assert info.value.expected is None
    assert (await b.health()).expected_version is None
