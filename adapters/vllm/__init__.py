"""The vLLM adapter: ``vllm serve`` servers (0.26), directly or behind a router.

Generation is token-in/token-out ``POST /inference/v1/generate``; control calls go to each server's
RL and dev routes (``VLLM_SERVER_DEV_MODE=1``). ``launch_vllm_fleet`` starts servers and hands back
the connected backend. Behind NVIDIA Dynamo, vLLM workers (``dynamo.vllm``) are the Dynamo
adapter's ``vllm`` worker kind. See ``docs/vllm.md``.
"""

from ._client import ServedConfig, connect, open_from_url, served_config
from ._launch import VllmServerCommand
from ._launcher import RunningVllmFleet, VllmFleetConfig, launch_vllm_fleet
from ._tensors import VllmNcclSender, ipc_update_info
from ._wire import DEFAULT_LOGPROBS_MODE, LOGPROBS_MODES, PAUSE_QUERY, VllmWire, filtered_logprobs

__all__ = [
    "DEFAULT_LOGPROBS_MODE",
    "LOGPROBS_MODES",
    "PAUSE_QUERY",
    "RunningVllmFleet",
    "ServedConfig",
    "VllmFleetConfig",
    "VllmNcclSender",
    "VllmServerCommand",
    "VllmWire",
    "connect",
    "filtered_logprobs",
    "ipc_update_info",
    "launch_vllm_fleet",
    "open_from_url",
    "served_config",
]
