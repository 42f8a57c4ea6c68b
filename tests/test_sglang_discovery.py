"""``sglang://`` with nothing in the URL: the vocabulary size and context length come from the server.

A stock SGLang server answers ``/server_info`` with ``context_length: null`` unless launched with
``--context-length``, ``/v1/models`` with the resolved ``max_model_len``, and ``/model_info`` with
the ``model_path`` (no vocabulary size); the vocabulary is read from that directory's
``config.json`` where it is readable here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web

import rollout_backends as rb
from rollout_backends.adapters.sglang import connect
from tests.aiohttp_app import serving


def _app(model_info: dict[str, Any], server_info: dict[str, Any], models: dict[str, Any] | None) -> web.Application:
    def route(body: Any) -> Any:
        async def answer(request: web.Request) -> web.Response:
            return web.json_response(body)

        return answer

    app = web.Application()
    app.router.add_get("/model_info", route(model_info))
    app.router.add_get("/server_info", route(server_info))
    if models is not None:
        app.router.add_get("/v1/models", route(models))
    return app


async def test_stock_sglang_limits_are_discovered(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 321, "max_position_embeddings": 9999}))
    app = _app(
        {"model_path": str(tmp_path), "weight_version": "default"},
        {"context_length": None, "model_path": str(tmp_path)},
        {"object": "list", "data": [{"id": "m", "max_model_len": 2048}]},
    )
    async with serving(app) as url:
        backend = await rb.open_backend(f"sglang://{url.removeprefix('http://')}")
        try:
            assert backend.capabilities.vocab_size == 321
            assert backend.capabilities.max_context == 2048  # the server's, not config.json's 9999
        finally:
            await backend.aclose()
        # What the caller gives wins over what the server says.
        given = await connect(url, vocab_size=100)
        try:
            assert given.capabilities.vocab_size == 100
        finally:
            await given.aclose()


async def test_reported_values_and_unknowns() -> None:
    app = _app({"model_path": "/not/here", "vocab_size": 77}, {"context_length": 512}, None)
    async with serving(app) as url:
        backend = await connect(url)
        try:
            assert (backend.capabilities.vocab_size, backend.capabilities.max_context) == (77, 512)
        finally:
            await backend.aclose()
    # A model directory not readable here and no limits answered: unknown, not guessed.
    app = _app({"model_path": "/not/here"}, {"context_length": None}, {"data": []})
    async with serving(app) as url:
        backend = await connect(url)
        try:
            assert (backend.capabilities.vocab_size, backend.capabilities.max_context) == (None, None)
        finally:
            await backend.aclose()
