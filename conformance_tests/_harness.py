"""``Harness``: what the environment gives the checks that a backend cannot give itself.

Every hook is optional. A check that needs a hook the harness does not provide is *skipped* with
a reason naming the hook, never failed.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Awaitable, Callable, Collection, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs

from rollout_backends import RolloutBackend, WeightBucket, WeightGroup

__all__ = ["BackendFactory", "Harness", "WeightSender", "load_safetensors_dir", "permute_safetensors_vocabulary"]

#: An async callable returning a *new, ready* backend. The runner calls it once per check and
#: ``aclose()``s what it returns when the check ends. For a remote server the factory typically
#: connects (``lambda: rb.open_backend(url)``): the checks then share the server and each one
#: undoes what it changed (pause, version label, weights when ``Harness.base_weights_path`` is set).
BackendFactory = Callable[[], Awaitable[RolloutBackend]]


@runtime_checkable
class WeightSender(Protocol):
    """The trainer (rank 0) side of a torch.distributed weight-update group.

    The methods block; the checks run them in a thread, concurrently with the backend's
    ``init_weight_group`` / ``update_weights_from_distributed``.
    ``rollout_backends.adapters.reference.WeightSender`` (gloo on CPU) is one.
    """

    def connect(self) -> None:
        """Join the group as rank 0 (returns once every engine rank joined)."""
        ...

    def broadcast(self, named_tensors: Sequence[tuple[str, Any]]) -> WeightBucket:
        """Broadcast the tensors in order from rank 0; returns the bucket the receivers need."""
        ...

    def close(self) -> None:
        """Leave the group (idempotent)."""
        ...


def load_safetensors_dir(path: str) -> list[tuple[str, Any]]:
    """Every tensor of every ``*.safetensors`` file in a checkpoint directory, in file and key order."""
    from safetensors.torch import load_file

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: list[tuple[str, Any]] = []
    for f in files:
        out.extend(sorted(load_file(str(f)).items()))
    return out


#: Module names of input embeddings and LM heads in Hugging Face checkpoints (Llama/Qwen, GPT-2,
#: BERT-likes, GPT-NeoX, Mistral's original).
_EMBEDDINGS = frozenset({"embed_tokens", "wte", "word_embeddings", "embed_in", "tok_embeddings"})
_HEADS = frozenset({"lm_head", "embed_out", "output"})


def _by_token(name: str, shape: tuple[int, ...], vocab: int, hidden: int) -> bool:
    """Whether tensor ``name`` of ``shape`` has a row per token: an embedding's or a head's weight
    (``[vocab, hidden]``), or a head's bias (``[vocab]``)."""
    *_, module, kind = ["", *name.split(".")]
    if kind == "weight" and (module in _EMBEDDINGS or module in _HEADS):
        return shape == (vocab, hidden)
    return kind == "bias" and module in _HEADS and shape == (vocab,)


def permute_safetensors_vocabulary(src: str, dst: str, pairs: Sequence[tuple[int, int]]) -> None:
    """Write to ``dst`` the checkpoint ``src`` with each pair of token ids swapped.

    In every tensor indexed by token (an input embedding or an LM head by its module name, of
    ``vocab_size`` rows of ``hidden_size``, as ``config.json`` says; tied or not) the rows of each
    pair change places; every other file is copied as it is. The names matter: a tiny model's MLP
    can be as wide as its vocabulary (512 and 512 in the suite's own), and must not be touched.

    The model on ``dst`` answers a prompt with the ids swapped exactly as the model on ``src``
    answers the original, with the ids of its answer swapped and the same logprobs: other weights
    whose outputs are known without running them. ``ValueError`` says why ``src`` cannot be used.
    """
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    source, target = Path(src), Path(dst)
    try:
        config = json.loads((source / "config.json").read_text())
        vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{src}: no config.json with vocab_size and hidden_size ({exc})") from None
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors files")
    order = list(range(vocab))
    for a, b in pairs:
        order[a], order[b] = order[b], order[a]
    index = torch.tensor(order)
    target.mkdir(parents=True, exist_ok=True)
    permuted = 0
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
        for name, t in tensors.items():
            if _by_token(name, tuple(t.shape), vocab, hidden):
                tensors[name] = t.index_select(0, index).contiguous()
                permuted += 1
        save_file(tensors, str(target / f.name), metadata=metadata)
    if not permuted:
        raise ValueError(f"{src}: no tensor of shape [vocab_size={vocab}, hidden_size={hidden}] (no embedding)")
    for other in source.iterdir():
        if other.is_file() and other.suffix != ".safetensors":
            shutil.copy2(other, target / other.name)


@attrs.frozen(kw_only=True)
class Harness:
    """Environment hooks and knobs for the conformance checks (all optional).

    Hooks:

    * ``alt_weights_path``: a checkpoint directory with *other* weights of the same architecture
      (the weight-update checks load it; it must change greedy outputs).
    * ``base_weights_path``: the weights the backend started with. When set, every check that
      changed the weights loads these back before it ends (needed when the factory reconnects
      to one long-lived server instead of starting a fresh engine).
    * ``fresh_factory_on(path)``: a factory for a *fresh* engine started on ``path`` (the oracle
      that a weight update is compared with).
    * ``make_sender(world_size)``: returns ``(group, sender)`` for a distributed update: the
      ``WeightGroup`` to pass to ``init_weight_group`` (``world_size`` = 1 + engine ranks) and the
      rank-0 ``WeightSender``.
    * ``inject_failure(backend, worker)``: an async context manager; while it is entered, the
      next weight load on ``worker`` fails.
    * ``hf_model_path``: a Hugging Face model directory with the weights the backend serves, for
      the transformers logprob parity check.
    * ``held_requests(backend)``: the request ids the backend's engines hold now (admitted or
      queued), seen on the engines themselves; the streaming checks use it where given.
    * ``load_weights(path)``: reads ``(name, tensor)`` pairs of a checkpoint for the tensor and
      distributed updates (default: every ``*.safetensors`` file).
    * ``permute_vocabulary(src, dst, pairs)``: writes to ``dst`` the checkpoint ``src`` with each
      pair of token ids swapped (default: ``permute_safetensors_vocabulary``); the checks that need
      no alt weights derive theirs from the served checkpoint with it.

    Knobs: ``concurrency`` (requests in the concurrent-vs-sequential check; lower it on slow
    backends), tolerances, token budgets and timeouts; ``vocab_size``/``max_context`` fill in what
    the backend's ``Capabilities`` leave ``None``.
    """

    alt_weights_path: str | None = None
    base_weights_path: str | None = None
    fresh_factory_on: Callable[[str], BackendFactory] | None = None
    make_sender: Callable[[int], tuple[WeightGroup, WeightSender]] | None = None
    inject_failure: Callable[[RolloutBackend, str], AbstractAsyncContextManager[Any]] | None = None
    hf_model_path: str | None = None
    held_requests: Callable[[RolloutBackend], Awaitable[Collection[str]]] | None = None
    load_weights: Callable[[str], Sequence[tuple[str, Any]]] = load_safetensors_dir
    permute_vocabulary: Callable[[str, str, Sequence[tuple[int, int]]], None] = permute_safetensors_vocabulary
    #: Where derived weights are written (default: the system's temporary folder); the engines
    #: load them from there, so it must be a folder they can read.
    scratch_dir: str | None = None
    #: Largest served checkpoint the suite copies to derive other weights from (bytes).
    max_derived_bytes: int = 4 << 30

    #: Requests sent at once in ``check_concurrent_equals_sequential`` (the issue's default: 200).
    concurrency: int = 200
    #: Fallbacks where ``Capabilities.vocab_size`` / ``max_context`` are ``None``.
    vocab_size: int | None = None
    max_context: int | None = None
    #: torch.distributed ranks the fleet contributes to a weight group (default: one per worker).
    engine_ranks: int | None = None
    #: Largest |Δlogprob| accepted where two runs of the same weights must agree.
    logprob_tolerance: float = 1e-3
    #: Largest |Δlogprob| accepted against a transformers forward pass.
    hf_logprob_tolerance: float = 2e-2
    #: Tokens generated per request in the ordinary checks.
    max_new_tokens: int = 8
    #: ``max_new_tokens`` of the request kept in flight by the abort checks (capped by the context).
    long_max_new_tokens: int = 2048
    #: ``max_new_tokens`` of requests paused and resumed (long enough to be caught in flight).
    pause_max_new_tokens: int = 192
    #: How long a paused backend is watched to see that requests wait (seconds).
    wait_s: float = 0.3
    #: Extra time to let an in-flight request produce its first tokens (added to the measured one).
    progress_wait_s: float = 0.0
    #: Per-check time limit (a hang is a failure).
    check_timeout_s: float = 300.0
    #: Time limit for the factory to return a backend.
    open_timeout_s: float = 120.0
    #: Smallest token id used in generated prompts (keeps special ids such as 0 out of prompts).
    min_prompt_token: int = 1
    #: Largest token id used in generated prompts (exclusive); capped by the vocabulary.
    max_prompt_token: int = 4096

    def replace(self, **changes: Any) -> Harness:
        return attrs.evolve(self, **changes)

    def missing(self, hooks: Sequence[str]) -> list[str]:
        """The hooks (attribute names) that are not provided."""
        return [h for h in hooks if getattr(self, h) is None]
