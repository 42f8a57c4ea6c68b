"""Toy fleets from public names: several workers and no router (``HttpLink``, ``HttpDriver``,
``RoundRobin``, ``Fleet``), opened by URL and checked by the conformance suite.

``toy://127.0.0.1:9001,127.0.0.1:9002`` connects to running engines; ``toy://?workers=2`` starts
that many engines in this event loop first (stopped when the backend closes), on ``weights=DIR``
(a checkpoint, ``write_checkpoint``) or ``seed=N``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from functools import cache
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from rollout_backends import InvalidRequest, RolloutBackend, open_backend
from rollout_backends.conformance import BackendFactory, Harness
from rollout_backends.kit import Fleet, HttpClient, HttpDriver, HttpLink, RoundRobin, Worker, get_json, worker_id_of

from ._engine import ToyEngine, read_checkpoint, start_server, write_checkpoint
from ._wire import ToyWire

__all__ = ["connect", "harness", "open_from_url"]


async def connect(urls: Sequence[str], *, client: HttpClient | None = None, on_close: Any = None) -> Fleet:
    """The backend over running toy engines at ``urls``: pinned requests to their worker, the rest
    round robin between them (no router), everything else fanned out by the fleet."""
    if not urls:
        raise InvalidRequest("urls", "a toy fleet needs at least one engine URL")
    client = client or HttpClient()
    status, info = await get_json(f"{urls[0]}/info", client=client)
    if status != 200 or not isinstance(info, dict):
        raise InvalidRequest("urls", f"{urls[0]} is not a toy engine (GET /info: HTTP {status})")
    wire = ToyWire(vocab_size=int(info["vocab_size"]), max_context=int(info["max_context"]), workers=len(urls))
    link = HttpLink(wire, client)  # one wire and client shared by every worker's driver
    caps = wire.capabilities()
    drivers = [HttpDriver(link, Worker(id=worker_id_of(u), control_url=u, generate_url=u), caps) for u in urls]

    async def close() -> None:
        await link.client.aclose()
        if on_close is not None:
            await on_close()

    return Fleet(drivers, entry=RoundRobin(drivers), capabilities=caps, name="toy", on_close=close)


async def open_from_url(url: str, **kwargs: Any) -> RolloutBackend:
    """The registry's entry point (group ``rollout_backends.adapters``, name ``toy``)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    known = {"workers", "weights", "seed"}
    for key in query:
        if key not in known:
            raise InvalidRequest(f"url.{key}", f"unknown option (known: {sorted(known)})")
    if parts.netloc:
        return await connect([f"http://{hostport}" for hostport in parts.netloc.split(",")], **kwargs)
    try:
        workers = int(query.get("workers", "1"))
        weights = read_checkpoint(query["weights"]) if "weights" in query else int(query.get("seed", "0"))
    except ValueError as exc:
        raise InvalidRequest("url", str(exc)) from None
    return await _start(workers, weights, **kwargs)


async def _start(workers: int, weights: int, **kwargs: Any) -> Fleet:
    """``workers`` engines on free ports of this host, in this event loop, and the fleet over them."""
    runners, urls = [], []
    try:
        for i in range(workers):
            runner, port = await start_server(ToyEngine(f"toy-{i}", weights=weights))
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")

        async def stop() -> None:
            for r in runners:
                await r.cleanup()

        return await connect(urls, on_close=stop, **kwargs)
    except BaseException:
        for r in runners:
            await r.cleanup()
        raise


@cache
def _alt_weights() -> str:
    """A checkpoint with other weights than the default (seed 0), made once per process."""
    return write_checkpoint(tempfile.mkdtemp(prefix="toy-alt-weights-"), seed=1)


def _fresh_on(path: str) -> BackendFactory:
    return lambda: open_backend(f"toy://?workers=1&weights={path}")


def harness(url: str = "") -> Harness:
    """What the conformance suite needs beyond the URL: other weights to load, and a fresh engine
    on them to compare an updated fleet with (``pytest --rb-harness toy_adapter:harness``)."""
    return Harness(alt_weights_path=_alt_weights(), fresh_factory_on=_fresh_on)
