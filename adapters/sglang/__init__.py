"""The SGLang adapter: a server directly, or workers behind an smg / sglang-router router.

Generation goes to the entry point (router or server); control calls fan out to every worker,
because routers forward none of them. ``launch_sglang_fleet`` starts workers (real SGLang or
reference servers) and a router and hands back the connected backend.
"""

from ._client import connect, open_from_url
from ._launch import ReferenceServerCommand, SGLangServerCommand, SmgRouter, connect_engines
from ._launcher import RunningSGLangFleet, SGLangFleet, SGLangFleetConfig, launch_sglang_fleet, start_sglang_fleet
from ._wire import SGLangWire, sampling_params_body

__all__ = [
    "ReferenceServerCommand",
    "RunningSGLangFleet",
    "SGLangFleet",
    "SGLangFleetConfig",
    "SGLangServerCommand",
    "SGLangWire",
    "SmgRouter",
    "connect",
    "connect_engines",
    "launch_sglang_fleet",
    "open_from_url",
    "sampling_params_body",
    "start_sglang_fleet",
]
