"""Miles (radixark/miles) on any rollout backend. Three ways in, see ``docs/miles.md``:

* ``generate``: Miles' custom generate function
  (``--custom-generate-function-path rollout_backends.integrations.miles.generate``);
* ``MilesFacade``: an SGLang-compatible router facade for stock Miles
  (``python -m rollout_backends.integrations.miles.facade``);
* ``RolloutEngine``: SGLangEngine's actor surface over one worker, for Ray actors.

Miles itself is never imported; its objects are duck-typed.
"""

from ._config import add_arguments, backend_url, close_backends, get_backend
from ._engine import EngineCrashed, RolloutEngine
from ._facade import MilesFacade, RunningFacade, start_facade
from ._generate import GenerateOutput, apply_generation, generate

__all__ = [
    "EngineCrashed",
    "GenerateOutput",
    "MilesFacade",
    "RolloutEngine",
    "RunningFacade",
    "add_arguments",
    "apply_generation",
    "backend_url",
    "close_backends",
    "generate",
    "get_backend",
    "start_facade",
]
