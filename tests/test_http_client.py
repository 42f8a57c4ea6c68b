"""The HTTP core's constructor checks and what its transport asks servers for."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from rollout_backends import InvalidRequest
from rollout_backends._http import HttpClient, HttpRequest, RetryPolicy
from tests.aiohttp_app import serving


@pytest.mark.parametrize("field", ["timeout", "control_timeout"])
@pytest.mark.parametrize("value", [None, 0, -1.0, float("nan"), float("inf"), True, "30"])
def test_timeouts_must_be_positive_seconds(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as e:
        HttpClient(**{field: value})
    assert e.value.field == field


def test_integer_seconds_are_fine() -> None:
    assert HttpClient(timeout=5, control_timeout=1).timeout == 5.0


@pytest.fixture
async def compressing_server() -> AsyncIterator[str]:
    """Compresses whenever the client's Accept-Encoding allows it (aiohttp's negotiation)."""

    async def handler(request: web.Request) -> web.Response:
        resp = web.json_response({"accept_encoding": request.headers.get("Accept-Encoding"), "pad": "x" * 2000})
        resp.enable_compression()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    async with serving(app) as base:
        yield f"{base}/"


async def test_bodies_come_back_uncompressed(compressing_server: str) -> None:
    # The transport reads bodies as sent (no decompression): it must not offer gzip/deflate.
    client = HttpClient(retry=RetryPolicy(attempts=1))
    try:
        resp = await client.send(HttpRequest("GET", compressing_server, idempotent=True))
    finally:
        await client.aclose()
    assert resp.status == 200
    assert resp.json()["accept_encoding"] == "identity"
