"""The NVIDIA Dynamo adapter: a frontend (``python -m dynamo.frontend``) and its workers.

Generation goes to the frontend's ``/v1/completions`` with a token-id prompt; control calls go
to each worker's system port (``/engine/<route>``), which the frontend never proxies.
``launch_dynamo_fleet`` starts a whole fleet (frontend + reference / mocker / sglang workers)
under the shared supervisor; ``DynamoWorkerCommand`` and ``DynamoFrontend`` are its processes as
launch commands (for Ray or any launcher), ``EtcdNats`` and ``DynamoPlanes`` the discovery and
event planes across hosts. See ``docs/dynamo.md`` and ``docs/multinode.md``.
"""

from ._client import connect, detect_flavor, open_from_url
from ._commands import DynamoFrontend, DynamoWorkerCommand
from ._launcher import DynamoFleet, DynamoFleetConfig, RunningDynamoFleet, launch_dynamo_fleet
from ._services import DynamoPlanes, EtcdNats
from ._wire import DynamoWire, completion_body

__all__ = [
    "DynamoFleet",
    "DynamoFleetConfig",
    "DynamoFrontend",
    "DynamoPlanes",
    "DynamoWire",
    "DynamoWorkerCommand",
    "EtcdNats",
    "RunningDynamoFleet",
    "completion_body",
    "connect",
    "detect_flavor",
    "launch_dynamo_fleet",
    "open_from_url",
]
