"""Building blocks for adapter authors (httpx-style transport seam included).

An HTTP adapter is a ``Wire``: pure request builders and response parsers. ``HttpFleetBackend``
owns I/O, fan-out, retries, timeouts, versions and health. A non-HTTP backend subclasses
``BackendBase`` and gets the weight-update transaction, readiness and selection for free.
"""

from rollout_backends._base import BackendBase, fan_out
from rollout_backends._fleet import HttpFleetBackend, Op, Wire, Worker
from rollout_backends._http import (
    AiohttpTransport,
    HttpClient,
    HttpRequest,
    HttpResponse,
    MockTransport,
    RetryPolicy,
    Transport,
)
from rollout_backends._tensors import deserialize_named_tensors, serialize_named_tensors

__all__ = [
    "AiohttpTransport",
    "BackendBase",
    "HttpClient",
    "HttpFleetBackend",
    "HttpRequest",
    "HttpResponse",
    "MockTransport",
    "Op",
    "RetryPolicy",
    "Transport",
    "Wire",
    "Worker",
    "deserialize_named_tensors",
    "fan_out",
    "serialize_named_tensors",
]
