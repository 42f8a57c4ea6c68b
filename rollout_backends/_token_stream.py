"""``TokenStream``: one request's tokens as they are generated (``RolloutBackend.stream``).

    async with backend.stream(request) as chunks:
        async for chunk in chunks:
            consume(chunk.output_ids)      # the new tokens only
        gen = chunks.generation            # the whole Generation (also the last chunk's ``final``)

Leaving the ``async with`` block, by ``break``, an exception or a cancellation, closes the stream:
the request is aborted on the engine before the block is left (the driver's generator ends it
there: the reference engine and the fake drop it, an HTTP driver closes its connection), and no
task of it is left running. Like ``as_completed``'s ``Completions``, a stream is iterated inside
its block only, so that leaving early always aborts.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType

from rollout_backends._errors import ContractViolation, InvalidRequest
from rollout_backends._types import Generation, TokenChunk

__all__ = ["TokenStream"]


class TokenStream(AsyncIterator[TokenChunk]):
    """A running stream; enter it, then iterate (see the module docstring).

    ``source`` is an async generator that opens the stream when first advanced and yields
    ``None`` once it is open (validated, claimed, routed: what can be refused before any token is
    refused there, from ``__aenter__``), then the chunks; closing it aborts the request.
    """

    __slots__ = ("_closed", "_entered", "_final", "_request_id", "_source")

    def __init__(self, request_id: str, source: AsyncGenerator[TokenChunk | None, None]) -> None:
        self._request_id = request_id
        self._source = source
        self._entered = False
        self._closed = False
        self._final: Generation | None = None

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def generation(self) -> Generation | None:
        """The whole ``Generation`` once the last chunk came (``None`` before, or if left early)."""
        return self._final

    async def __aenter__(self) -> TokenStream:
        if self._entered:
            raise InvalidRequest("stream", "can be entered once")
        self._entered = True
        try:
            opened = await self._source.__anext__()
        except StopAsyncIteration:
            raise ContractViolation(f"the stream of {self._request_id!r} ended before it opened") from None
        except BaseException:
            self._closed = True
            raise
        if opened is not None:  # pragma: no cover - the fleet's own source yields None first
            await self._source.aclose()
            raise ContractViolation(f"the stream of {self._request_id!r} yielded a chunk before it opened")
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def __aiter__(self) -> TokenStream:
        if not self._entered:
            raise InvalidRequest("stream", "iterate inside `async with` (leaving it aborts the request)")
        return self

    async def __anext__(self) -> TokenChunk:
        if self._closed:
            raise StopAsyncIteration
        chunk = await self._source.__anext__()
        if chunk is None:  # pragma: no cover - only the first item is the opening marker
            raise ContractViolation(f"the stream of {self._request_id!r} opened twice")
        if chunk.final is not None:
            self._final = chunk.final
        return chunk

    async def aclose(self) -> None:
        """Abort the request on the engine if it is still running; idempotent."""
        self._closed = True
        await self._source.aclose()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open" if self._entered else "new"
        return f"<TokenStream {self._request_id!r} {state}>"
