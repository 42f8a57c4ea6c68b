"""SGLang's ``update_weights_from_tensor`` payloads as Miles sends them, decoded to named tensors.

Shared by the facade server and the engine actor class. The decoder is the core's
(``rollout_backends.kit.decode_tensor_payload``: per-tensor lists and Miles' colocated
``flattened_bucket`` payloads, SGLang's metadata class included); SGLang's ``/generate`` format
lives in the codec (``rollout_backends.sglang_native``), which the facade and the generate
function use.
"""

from __future__ import annotations

from rollout_backends.kit import decode_tensor_payload

__all__ = ["decode_tensor_payload"]
