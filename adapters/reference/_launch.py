"""The reference server as an engine command (CPU): ``python -m rollout_backends.adapters.reference.serve``.

The command is an SGLang-native server's, so it is defined by the SGLang adapter (whose launcher
starts reference workers) and named here too.
"""

from __future__ import annotations

from ..sglang import ReferenceServerCommand

__all__ = ["ReferenceServerCommand"]
