"""The SGLang adapter: a server directly, or workers behind an smg / sglang-router router.

Generation goes to the entry point (router or server); control calls fan out to every worker,
because routers forward none of them.
"""

from rollout_backends.adapters.sglang._client import connect, open_from_url
from rollout_backends.adapters.sglang._launch import SGLangServerCommand, SmgRouter, connect_engines
from rollout_backends.adapters.sglang._wire import SGLangWire, sampling_params_body

__all__ = [
    "SGLangServerCommand",
    "SGLangWire",
    "SmgRouter",
    "connect",
    "connect_engines",
    "open_from_url",
    "sampling_params_body",
]
