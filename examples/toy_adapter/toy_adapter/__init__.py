"""A worked third-party adapter: a toy engine, its wire, and its fleet, kept green by CI.

``open_backend("toy://?workers=2")`` (after ``register_scheme("toy", open_from_url)``, or with this
package installed: its entry point registers the scheme) starts two toy engines and returns the
router-less HTTP fleet over them; the conformance suite runs on it (``tests/test_toy_adapter.py``).
See README.md.
"""

from ._engine import EOS, MAX_CONTEXT, VOCAB_SIZE, ToyEngine, read_checkpoint, start_server, write_checkpoint
from ._fleet import connect, harness, open_from_url
from ._wire import ToyWire

__all__ = [
    "EOS",
    "MAX_CONTEXT",
    "VOCAB_SIZE",
    "ToyEngine",
    "ToyWire",
    "connect",
    "harness",
    "open_from_url",
    "read_checkpoint",
    "start_server",
    "write_checkpoint",
]
