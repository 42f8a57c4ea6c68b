"""Version-constrained requests (issue 17 item 2): ``GenerateRequest.min_version`` / ``exact_version``
are routed only to workers whose installed label satisfies them (the order of labels is the fleet's
history, ``VersionBook.history``); none: ``NoCompatibleVersion``, retryable, nothing sent. The
``Generation`` reports the version at the start and at the end (``version_at_start``, ``weight_version``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import pytest

import rollout_backends as rb
from rollout_backends.adapters.reference import ReferenceBackend, make_tiny_model
from rollout_backends.adapters.sglang import SGLangWire
from rollout_backends.kit import Fleet, HttpClient, HttpFleetBackend, HttpRequest, HttpResponse, MockTransport, Worker

GREEDY = rb.SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)


def req(**kw: object) -> rb.GenerateRequest:
    return rb.GenerateRequest(input_ids=[1, 2, 3], sampling=GREEDY, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("constraints-model"), seed=0)


@pytest.fixture
async def fleet(model_dir: Path) -> AsyncIterator[ReferenceBackend]:
    backend = ReferenceBackend.create(model_dir, workers=3)
    try:
        yield backend
    finally:
        await backend.aclose()


@pytest.mark.parametrize("field", ["min_version", "exact_version"])
@pytest.mark.parametrize("bad", ["", 3, b"v1"])
def test_a_constraint_is_a_label(field: str, bad: object) -> None:
    with pytest.raises(rb.InvalidRequest) as info:
        req(**{field: bad})
    assert info.value.field == field


async def test_an_unknown_exact_version_is_retryable_and_sends_nothing(fleet: ReferenceBackend) -> None:
    before = [e.health().tokens_generated for e in fleet.engines]
    with pytest.raises(rb.NoCompatibleVersion) as info:
        await fleet.generate(req(exact_version="v9"))
    err = info.value
    assert isinstance(err, rb.TransientError) and err.retryable and err.nothing_generated
    assert err.exact_version == "v9" and err.min_version is None
    assert err.served == {"ref-0": "default", "ref-1": "default", "ref-2": "default"}
    assert err.history == ("default",)
    assert [e.health().tokens_generated for e in fleet.engines] == before
    with pytest.raises(rb.NoCompatibleVersion):  # a label not installed yet is later than none
        await fleet.generate(req(min_version="v9"))


async def test_a_numbered_floor_never_installed_compares_as_a_number(fleet: ReferenceBackend) -> None:
    """Stitch's bounded-lag floor is ``latest - lag`` (``constrain_request``), a number this fleet may
    never have installed: decimal labels compare as numbers then (Stitch's ``applied >= min``),
    where the history alone refused every such request forever."""
    await fleet.set_weight_version("5", workers=["ref-1"])
    await fleet.set_weight_version("6", workers=["ref-2"])
    gens = await asyncio.gather(*(fleet.generate(req(min_version="4")) for _ in range(4)))
    assert {g.worker for g in gens} == {"ref-1", "ref-2"}  # "default" is not a number: not at least 4
    assert {g.worker for g in await asyncio.gather(*(fleet.generate(req(min_version="6")) for _ in range(2)))} == {
        "ref-2"
    }
    with pytest.raises(rb.NoCompatibleVersion):  # not yet installed anywhere
        await fleet.generate(req(min_version="7"))


async def test_after_a_partial_update_min_version_lands_on_the_updated_workers(fleet: ReferenceBackend) -> None:
    await fleet.set_weight_version("v2", workers=["ref-1"])
    assert fleet._versions.history == ("default", "v2")
    gens = await asyncio.gather(*(fleet.generate(req(min_version="v2")) for _ in range(6)))
    assert {g.worker for g in gens} == {"ref-1"}
    assert {(g.version_at_start, g.weight_version, g.version_at_end) for g in gens} == {("v2", "v2", "v2")}
    old = await asyncio.gather(*(fleet.generate(req(exact_version="default")) for _ in range(6)))
    assert {g.worker for g in old} == {"ref-0", "ref-2"}  # spread over both, never the updated one
    anyv = await asyncio.gather(*(fleet.generate(req(min_version="default")) for _ in range(6)))
    assert {g.worker for g in anyv} == {"ref-0", "ref-1", "ref-2"}  # every worker satisfies it
    with pytest.raises(rb.NoCompatibleVersion) as info:  # pinned to a worker that does not satisfy it
        await fleet.generate(req(min_version="v2", worker="ref-0"))
    assert info.value.served["ref-0"] == "default"
    pinned = await fleet.generate(req(min_version="v2", worker="ref-1"))
    assert pinned.worker == "ref-1"


async def test_the_history_orders_by_first_install_and_a_rollback_keeps_its_place(fleet: ReferenceBackend) -> None:
    await fleet.set_weight_version("v2")
    await fleet.set_weight_version("v3", workers=["ref-0"])
    await fleet.set_weight_version("default", workers=["ref-0"])  # rolled back: "default" is still first
    assert fleet._versions.history == ("default", "v2", "v3")
    gen = await fleet.generate(req(min_version="v2"))
    assert gen.worker in ("ref-1", "ref-2")
    with pytest.raises(rb.InvalidRequest) as info:
        await fleet.generate(req(min_version="v3", exact_version="v2"))
    assert info.value.field == "exact_version"
    both = await fleet.generate(req(min_version="v2", exact_version="v2"))
    assert both.version_at_start == "v2"


async def test_a_fleet_that_cannot_pin_refuses_while_its_workers_disagree(fleet: ReferenceBackend) -> None:
    caps = attrs.evolve(fleet.capabilities, worker_pinning=False)
    unpinned = Fleet(fleet.drivers, capabilities=caps)
    unpinned.set_installed_version("default")
    await unpinned.set_weight_version("v2", workers=["ref-1"])
    with pytest.raises(rb.NoCompatibleVersion) as info:
        await unpinned.generate(req(min_version="v2"))
    assert "cannot pin" in str(info.value)
    assert (await unpinned.generate(req(min_version="default"))).worker is not None  # all satisfy it
    await unpinned.set_weight_version("v2")
    gen = await unpinned.generate(req(min_version="v2"))
    assert gen.version_at_start == gen.weight_version == "v2"


async def test_an_undeclared_capability_is_unsupported(fleet: ReferenceBackend) -> None:
    bare = Fleet(fleet.drivers, capabilities=attrs.evolve(fleet.capabilities, version_constraints=False))
    bare.set_installed_version("default")
    with pytest.raises(rb.Unsupported) as info:
        await bare.generate(req(min_version="default"))
    assert info.value.capability == "version_constraints"
    assert (await bare.generate(req())).finish_reason is rb.FinishReason.LENGTH  # unconstrained: served


async def test_a_request_spanning_an_update_reports_both_versions(fleet: ReferenceBackend) -> None:
    long = rb.GenerateRequest(
        input_ids=[1, 2, 3],
        sampling=rb.SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True),
        worker="ref-0",
        exact_version="default",
    )
    task = asyncio.ensure_future(fleet.generate(long))
    engine = fleet.engine("ref-0")
    while engine.health().tokens_generated < 5:
        await asyncio.sleep(0.005)
    await fleet.pause(rb.PauseMode.IN_PLACE, workers=["ref-0"])
    try:
        await fleet.set_weight_version("v2", workers=["ref-0"])
    finally:
        await fleet.resume(workers=["ref-0"])
    gen = await asyncio.wait_for(task, 60)
    assert len(gen.output_ids) == 400
    assert (gen.version_at_start, gen.version_at_end) == ("default", "v2")
    quiet = await fleet.generate(req(worker="ref-0"))
    assert quiet.version_at_start == quiet.weight_version == "v2"


async def test_an_http_fleet_learns_the_labels_its_servers_report() -> None:
    """Connected to SGLang servers it did not start, a fleet knows no labels: a constrained request
    first asks each unlabelled worker's reported version (``/model_info``), then routes by it."""
    served = {"http://w0:1": "v1", "http://w1:2": "v2"}
    asked: list[str] = []

    def handle(http: HttpRequest) -> HttpResponse:
        parts = urlsplit(http.url)
        base = f"{parts.scheme}://{parts.netloc}"
        if parts.path == "/model_info":
            asked.append(base)
            return HttpResponse.from_json({"weight_version": served[base]})
        meta = {
            "id": "r",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 3,
            "cached_tokens": 0,
            "weight_version": served[base],
            "output_token_logprobs": [[-0.5, 7, None]],
        }
        return HttpResponse.from_json({"output_ids": [7], "meta_info": meta})

    workers = [Worker(id=f"w{i}", control_url=u, generate_url=u) for i, u in enumerate(served)]
    fleet = HttpFleetBackend(SGLangWire(entry_url="http://w0:1"), workers, client=HttpClient(MockTransport(handle)))
    async with fleet:
        one = rb.SamplingParams(max_new_tokens=1)
        gen = await fleet.generate(rb.GenerateRequest(input_ids=[1, 2, 3], sampling=one, min_version="v1"))
        assert gen.weight_version in ("v1", "v2") and sorted(asked) == sorted(served)
        # "v1" and "v2" entered the history in worker order: min_version="v2" is w1 only.
        gens = [
            await fleet.generate(rb.GenerateRequest(input_ids=[1, 2, 3], sampling=one, min_version="v2"))
            for _ in range(3)
        ]
        assert {(g.worker, g.weight_version, g.version_at_start) for g in gens} == {("w1", "v2", "v2")}
        assert len(asked) == 2  # learnt once
        with pytest.raises(rb.NoCompatibleVersion):
            await fleet.generate(rb.GenerateRequest(input_ids=[1, 2, 3], sampling=one, exact_version="v3"))
