"""The NVIDIA Dynamo adapter: a frontend (``python -m dynamo.frontend``) and its workers.

Generation goes to the frontend's ``/v1/completions`` with a token-id prompt; control calls go
to each worker's system port (``/engine/<route>``), which the frontend never proxies.
``launch_dynamo_fleet`` starts a whole fleet (frontend + reference / mocker / sglang workers)
under the shared supervisor. See ``docs/dynamo.md``.
"""

from ._client import connect, detect_flavor, open_from_url
from ._launcher import DynamoFleet, RunningDynamoFleet, launch_dynamo_fleet
from ._wire import DynamoWire, completion_body

__all__ = [
    "DynamoFleet",
    "DynamoWire",
    "RunningDynamoFleet",
    "completion_body",
    "connect",
    "detect_flavor",
    "launch_dynamo_fleet",
    "open_from_url",
]
