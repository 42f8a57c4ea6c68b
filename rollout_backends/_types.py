"""Value types: frozen, slotted, validated at construction.

A bad value raises :class:`~rollout_backends.InvalidRequest` naming the field, so that an
error surfaces where the request is built, not deep inside an engine.
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from operator import countOf
from typing import Any

import attrs

from rollout_backends._errors import ContractViolation, InvalidRequest

__all__ = [
    "Capabilities",
    "FinishReason",
    "GenerateRequest",
    "Generation",
    "HealthReport",
    "MemoryTag",
    "PauseMode",
    "RoutingKind",
    "SamplingParams",
    "TensorSpec",
    "TokenChunk",
    "VersionSource",
    "WeightBucket",
    "WeightGroup",
    "WeightTransport",
    "WorkerHealth",
]

#: Every integer fits a signed 64-bit integer: SGLang's schema types them so (``i64``), and the
#: JSON encoder (orjson) raises a bare TypeError past 64 bits. Also the largest seed.
_INT64_MAX = 2**63 - 1
_INT64_MIN = -(2**63)
#: The most alternatives ``SamplingParams.top_logprobs`` may ask for per token (OpenAI's chat
#: limit; SGLang has none, but each one costs a detokenisation on SGLang's tokenizer manager).
MAX_TOP_LOGPROBS = 20
#: ``SamplingParams.stop``: at most this many stop strings (SGLang's schema gate, 0.5.23), each
#: 1 to ``MAX_STOP_CHARS`` characters.
MAX_STOPS = 32
MAX_STOP_CHARS = 512


class FinishReason(str, enum.Enum):
    """Why a generation ended."""

    STOP = "stop"  #: an EOS or stop token was produced (and is included in the output)
    LENGTH = "length"  #: ``max_new_tokens`` (or the context) was reached
    ABORT = "abort"  #: aborted by ``abort``/``abort_all``/``pause(ABORT)``; partial tokens are kept


class PauseMode(str, enum.Enum):
    """What ``pause`` does to in-flight requests. See ``docs/pause-modes.md``."""

    ABORT = "abort"  #: in-flight requests end now with ``FinishReason.ABORT`` and their partial tokens
    RETRACT = "retract"  #: in-flight requests are parked, KV dropped, and recomputed after resume
    IN_PLACE = "in_place"  #: in-flight requests are frozen with their KV; the cache cannot be flushed


class WeightTransport(str, enum.Enum):
    """How new weights can reach an engine."""

    DISTRIBUTED = "distributed"  #: a torch.distributed group (NCCL on GPU, gloo on CPU), bucket broadcasts
    TENSOR = "tensor"  #: in-memory tensors handed over on the same host (CUDA IPC on GPU)
    DISK = "disk"  #: a checkpoint directory the engine reads


class RoutingKind(str, enum.Enum):
    """How generation requests are spread over workers."""

    SINGLE = "single"  #: one worker, no router
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    CACHE_AWARE = "cache_aware"  #: approximate prefix tree in the router (smg/sglang-router)
    KV = "kv"  #: KV-event-fed prefix tree plus load (Dynamo's KV router)
    OTHER = "other"


class VersionSource(str, enum.Enum):
    """Where a ``Generation.weight_version`` comes from (``Capabilities.version_source``), and where
    its ``version_spans`` come from (``Capabilities.version_spans``)."""

    RESPONSE = "response"  #: the engine reports it in each response
    STAMPED = "stamped"  #: the adapter stamps the version it last installed on the serving worker
    NONE = "none"  #: not known


class MemoryTag(str, enum.Enum):
    """What ``release_memory``/``resume_memory`` act on (SGLang's tags)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"


def _fail(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(field, message)


def _check_int(field: str, value: object) -> int:
    # bool is an int subclass; a True max_new_tokens is a bug, not a 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, f"must be an int, got {type(value).__name__}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise _fail(field, f"{value} does not fit a signed 64-bit integer")
    return value


def _check_float(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(field, f"must be a number, got {type(value).__name__}")
    f = float(value)
    if not math.isfinite(f):
        raise _fail(field, f"must be finite, got {value!r}")
    return f


def _token_ids(field: str, value: object) -> tuple[int, ...]:
    # Fast path (hot: every request): a list/tuple of plain non-negative ints, in two C-level
    # passes with no Python frame per token (``all(<genexpr>)`` here was most of a 128-token
    # prompt's ``GenerateRequest``: docs/benchmarks.md, "Figures behind the hot path"). Anything
    # else, bools included (``type(True) is bool``), takes the loop below, which names the index.
    if type(value) is tuple or type(value) is list:
        if not value:
            return ()
        if countOf(map(type, value), int) == len(value) and min(value) >= 0 and max(value) <= _INT64_MAX:
            return tuple(value)
    return _checked_token_ids(field, value)


def _integer_dtype(dtype: object) -> bool | None:
    """Whether a numpy or torch dtype holds integers (without importing either); ``None`` for
    anything that is not such a dtype. Booleans, floats and complex numbers are not token ids."""
    kind = getattr(dtype, "kind", None)  # numpy: 'i' signed, 'u' unsigned, 'b' bool, 'f' float, ...
    if isinstance(kind, str):
        return kind in ("i", "u")
    name = str(dtype)  # torch: "torch.int64", "torch.uint8", "torch.bool", "torch.bfloat16", ...
    if name.startswith("torch."):
        return name.removeprefix("torch.").startswith(("int", "uint"))
    return None


def _array_token_ids(field: str, value: Any) -> list[Any]:
    """A numpy array or torch tensor of token ids as Python ints, exactly (``tolist``); any other
    dtype, or more than one dimension (a batch), is refused naming ``field``."""
    if not _integer_dtype(value.dtype):
        raise _fail(field, f"must hold integer token ids, got dtype {value.dtype}")
    ndim = getattr(value, "ndim", 1)
    if ndim != 1:
        raise _fail(field, f"must be one-dimensional (one prompt), got {ndim} dimensions")
    ids: list[Any] = value.tolist()
    return ids


def _checked_token_ids(field: str, value: object) -> tuple[int, ...]:
    """The rule itself, one token at a time (``_token_ids`` must agree with it on every input).
    numpy arrays and torch tensors of an integer dtype, and their integer scalars, are taken exactly."""
    if getattr(value, "dtype", None) is not None and hasattr(value, "tolist"):
        value = _array_token_ids(field, value)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail(field, f"must be a sequence of ints, got {type(value).__name__}")
    out = []
    for i, t in enumerate(value):
        dtype = getattr(t, "dtype", None)
        if dtype is not None and _integer_dtype(dtype) and getattr(t, "ndim", 0) == 0:
            t = int(t)  # a numpy integer scalar or a 0-d integer tensor: exact
        if isinstance(t, bool) or not isinstance(t, int):
            raise _fail(f"{field}[{i}]", f"must be an int token id, got {type(t).__name__}")
        if t < 0:
            raise _fail(f"{field}[{i}]", f"token ids are >= 0, got {t}")
        if t > _INT64_MAX:
            raise _fail(f"{field}[{i}]", f"token id {t} does not fit a signed 64-bit integer")
        out.append(int(t))
    return tuple(out)


def _input_ids(value: object) -> tuple[int, ...]:
    return _token_ids("input_ids", value)


def _stop_token_ids(value: object) -> tuple[int, ...]:
    return _token_ids("sampling.stop_token_ids", value)


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    # A bare string is kept as is, for ``__attrs_post_init__`` to refuse it (not one stop per character).
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return value  # type: ignore[return-value]
    return tuple(value)


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    # A non-sequence is kept as is, for ``__attrs_post_init__`` to reject it naming the field.
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return value  # type: ignore[return-value]
    return tuple(value)


@attrs.frozen(slots=True, kw_only=True)
class SamplingParams:
    """Sampling parameters, engine-neutral. Every field is sent explicitly to the engine.

    ``temperature == 0`` means greedy. ``seed`` makes sampling reproducible on engines that
    declare ``Capabilities.seeded_sampling``.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  #: -1 = whole vocabulary
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_token_ids)
    ignore_eos: bool = False  #: also disables ``stop_token_ids`` (SGLang semantics)
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    #: ``k``: each output token also gets the ``k`` most likely tokens and their logprobs
    #: (``Generation.top_logprobs``), from the same distribution as ``Generation.logprobs``.
    #: ``0`` (none) to ``MAX_TOP_LOGPROBS``; needs ``Capabilities.top_logprobs``.
    top_logprobs: int = 0
    #: Stop strings (SGLang's semantics): the generation ends with ``FinishReason.STOP`` and
    #: ``matched_stop`` the string once the decoded output contains one; the token completing it
    #: is kept in ``output_ids`` (never trimmed); ``ignore_eos`` does not disable them. At most
    #: ``MAX_STOPS`` (32), each 1..512 characters; needs ``Capabilities.stop_strings``.
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    #: ``Generation.text`` keeps the matched stop string (SGLang's ``no_stop_trim``); text only.
    no_stop_trim: bool = False

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.stop, tuple):
            raise _fail("sampling.stop", f"must be a sequence of strings, got {type(self.stop).__name__}")
        if len(self.stop) > MAX_STOPS:
            raise _fail("sampling.stop", f"has {len(self.stop)} stop strings (at most {MAX_STOPS})")
        for i, st in enumerate(self.stop):
            if not isinstance(st, str):
                raise _fail(f"sampling.stop[{i}]", f"must be a string, got {type(st).__name__}")
            if not 1 <= len(st) <= MAX_STOP_CHARS:
                raise _fail(f"sampling.stop[{i}]", f"must be 1..{MAX_STOP_CHARS} characters, got {len(st)}")
        if not isinstance(self.no_stop_trim, bool):
            raise _fail("sampling.no_stop_trim", "must be a bool")
        tk = _check_int("sampling.top_logprobs", self.top_logprobs)
        if not 0 <= tk <= MAX_TOP_LOGPROBS:
            raise _fail("sampling.top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {tk}")
        m = _check_int("sampling.max_new_tokens", self.max_new_tokens)
        if m < 0:
            # 0 (re-score the prompt, generate nothing) only with GenerateRequest.prompt_logprobs_start.
            raise _fail("sampling.max_new_tokens", f"must be >= 1 (or 0 with prompt_logprobs_start), got {m}")
        t = _check_float("sampling.temperature", self.temperature)
        if t < 0:
            raise _fail("sampling.temperature", f"must be >= 0, got {t}")
        p = _check_float("sampling.top_p", self.top_p)
        if not 0.0 < p <= 1.0:
            raise _fail("sampling.top_p", f"must be in (0, 1], got {p}")
        k = _check_int("sampling.top_k", self.top_k)
        if k == 0 or k < -1:
            raise _fail("sampling.top_k", f"must be -1 (all) or >= 1, got {k}")
        mp = _check_float("sampling.min_p", self.min_p)
        if not 0.0 <= mp <= 1.0:
            raise _fail("sampling.min_p", f"must be in [0, 1], got {mp}")
        mn = _check_int("sampling.min_new_tokens", self.min_new_tokens)
        if mn < 0 or mn > m:
            raise _fail("sampling.min_new_tokens", f"must be in [0, max_new_tokens={m}], got {mn}")
        _token_ids("sampling.stop_token_ids", self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise _fail("sampling.ignore_eos", "must be a bool")
        if self.seed is not None:
            s = _check_int("sampling.seed", self.seed)
            if not 0 <= s <= _INT64_MAX:
                raise _fail("sampling.seed", f"must be in [0, 2**63-1], got {s}")
        rp = _check_float("sampling.repetition_penalty", self.repetition_penalty)
        if not 0.0 < rp <= 2.0:
            raise _fail("sampling.repetition_penalty", f"must be in (0, 2], got {rp}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = _check_float(f"sampling.{name}", getattr(self, name))
            if not -2.0 <= v <= 2.0:
                raise _fail(f"sampling.{name}", f"must be in [-2, 2], got {v}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        return attrs.evolve(self, **changes)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain mapping; an unknown key is an ``InvalidRequest`` naming it."""
        known = {a.name for a in attrs.fields(cls)}
        for key in data:
            if key not in known:
                raise _fail(f"sampling.{key}", f"unknown sampling parameter (known: {sorted(known)})")
        return cls(**data)


def _new_request_id() -> str:
    # 128 random bits, like uuid4().hex, at a fraction of its cost.
    return os.urandom(16).hex()


@attrs.frozen(slots=True, kw_only=True)
class GenerateRequest:
    """One token-in/token-out generation request (one sample; ``n`` samples are ``n`` requests)."""

    input_ids: tuple[int, ...] = attrs.field(converter=_input_ids)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    request_id: str = attrs.field(factory=_new_request_id)
    return_logprobs: bool = True
    #: Ask the backend to serve this on one worker (by its id); ``None`` lets the router choose.
    worker: str | None = None
    #: A key that routers may use to keep related requests (one group's samples) together.
    routing_key: str | None = None
    #: Serve only on a worker whose installed weight version is this label or one installed after
    #: it; "after" is the order of the fleet's history of installed labels (``VersionBook.history``);
    #: a decimal label the fleet never installed compares as a number with decimal labels.
    #: No such worker: ``NoCompatibleVersion`` (retryable). Needs ``Capabilities.version_constraints``.
    min_version: str | None = None
    #: Serve only on a worker whose installed weight version is exactly this label (else
    #: ``NoCompatibleVersion``). With ``min_version`` too, it must not precede it in the history.
    exact_version: str | None = None
    #: ``s``: also return the prompt's logprobs from position ``s`` on (``Generation.prompt_logprobs``;
    #: SGLang's ``logprob_start_len``), in ``[0, len(input_ids))``; needs ``return_logprobs`` and
    #: ``Capabilities.prompt_logprobs``. With ``sampling.max_new_tokens = 0`` it re-scores a sequence
    #: (prompt + an earlier output) without generating.
    prompt_logprobs_start: int | None = None

    def __attrs_post_init__(self) -> None:
        if not self.input_ids:
            raise _fail("input_ids", "must not be empty")
        if not isinstance(self.sampling, SamplingParams):
            raise _fail("sampling", f"must be SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise _fail("request_id", "must be a non-empty string")
        if not isinstance(self.return_logprobs, bool):
            raise _fail("return_logprobs", "must be a bool")
        if self.sampling.top_logprobs and not self.return_logprobs:
            raise _fail("sampling.top_logprobs", "needs return_logprobs=True (top logprobs come with the logprobs)")
        if self.worker is not None and not isinstance(self.worker, str):
            raise _fail("worker", f"must be a worker id (str) or None, got {type(self.worker).__name__}")
        if self.routing_key is not None and not isinstance(self.routing_key, str):
            raise _fail("routing_key", f"must be a str or None, got {type(self.routing_key).__name__}")
        for name in ("min_version", "exact_version"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _fail(name, f"must be a non-empty version label (str) or None, got {v!r}"[:200])
        start = self.prompt_logprobs_start
        if start is not None:
            _check_int("prompt_logprobs_start", start)
            if not 0 <= start < len(self.input_ids):
                n = len(self.input_ids)
                raise _fail("prompt_logprobs_start", f"must be in [0, len(input_ids)={n}), got {start}")
            if not self.return_logprobs:
                raise _fail("prompt_logprobs_start", "needs return_logprobs=True (they come with the logprobs)")
        elif self.sampling.max_new_tokens == 0:
            raise _fail("sampling.max_new_tokens", "0 generates nothing: it re-scores, with prompt_logprobs_start set")


def _check_spans(spans: tuple[tuple[int, str], ...], n: int) -> None:
    """``Generation.version_spans`` covers ``n`` output tokens exactly, else ``ContractViolation``."""
    if not n:
        if spans:
            raise ContractViolation(f"version_spans {spans!r} for no output tokens")
        return
    previous: tuple[int, str] | None = None
    for span in spans:
        if type(span) is not tuple or len(span) != 2 or type(span[0]) is not int or type(span[1]) is not str:
            raise ContractViolation(f"version_spans: {span!r} is not an (index, version) pair")
        if previous is None and span[0] != 0:
            raise ContractViolation(f"version_spans start at {span[0]}, not 0")
        if previous is not None and not (previous[0] < span[0] < n and previous[1] != span[1]):
            raise ContractViolation(f"version_spans: {span!r} after {previous!r} (of {n} tokens) is not a new run")
        previous = span
    if previous is None:
        raise ContractViolation(f"version_spans empty for {n} output tokens")


@attrs.frozen(slots=True, kw_only=True)
class Generation:
    """The result of one ``generate``.

    ``logprobs[i]`` is the log-probability of ``output_ids[i]`` from the same forward pass that
    chose it; both tuples have the same length (an adapter raises ``ContractViolation`` rather than
    pad). A matched stop/EOS token is included in ``output_ids``. The distribution is the one the
    token was drawn from: after the penalties, scaled by the temperature where sampled (greedy: the
    model's own), and unfiltered by ``top_k`` / ``top_p`` / ``min_p`` unless the backend declares
    ``Capabilities.filtered_logprobs`` (then renormalised over the tokens the filters kept).
    """

    request_id: str
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: FinishReason
    weight_version: str | None
    prompt_tokens: int
    cached_tokens: int = 0
    worker: str | None = None
    latency_s: float = 0.0
    #: The stop/EOS token, or the stop string, that ended the generation, when ``finish_reason`` is STOP.
    matched_stop: int | str | None = None
    #: With ``SamplingParams.top_logprobs = k``: for each output token, the ``k`` most likely
    #: ``(token_id, logprob)`` pairs, most likely first (``None`` when not asked for).
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    #: The version the serving worker had installed when the request reached it (``None``: not
    #: known). ``weight_version`` is the version at the end (``version_at_end``); a request that
    #: spanned a weight update shows both.
    version_at_start: str | None = None
    #: With ``GenerateRequest.prompt_logprobs_start = s``: for ``input_ids[s:]``, each token's logprob
    #: given the tokens before it; entry 0 is ``None``, as in SGLang (the logits start at ``s``: the
    #: logprob of ``input_ids[s]`` would need position ``s - 1``'s). Unscaled by the temperature.
    prompt_logprobs: tuple[float | None, ...] | None = None
    #: Which version produced which output tokens: runs of ``(first output index, version)``, the
    #: first at index 0, indices increasing, each run to the next one's index (the last to the
    #: end), adjacent runs of different versions; ``()`` for no tokens. A request in flight across
    #: an update has two runs or more. ``None``: not known (``Capabilities.version_spans``).
    version_spans: tuple[tuple[int, str], ...] | None = None
    #: The output as text, where the backend decodes (SGLang's ``text``: cut before a matched stop
    #: string unless ``no_stop_trim``, then after it); ``None`` where it does not.
    text: str | None = None

    def __attrs_post_init__(self) -> None:
        # An answer that cannot be one Generation is the engine's (or adapter's) breach of the
        # protocol, never the caller's input. A value type cannot name a worker; adapters check
        # first and raise ContractViolation naming it.
        if self.logprobs is not None and len(self.logprobs) != len(self.output_ids):
            raise ContractViolation(
                f"logprobs ({len(self.logprobs)}) and output_ids ({len(self.output_ids)}) differ in length"
            )
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.output_ids):
            raise ContractViolation(
                f"top_logprobs ({len(self.top_logprobs)}) and output_ids ({len(self.output_ids)}) differ in length"
            )
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) > self.prompt_tokens:
            raise ValueError(f"{len(self.prompt_logprobs)} prompt logprobs for {self.prompt_tokens} prompt tokens")
        if self.version_spans is not None:
            _check_spans(self.version_spans, len(self.output_ids))

    @property
    def aborted(self) -> bool:
        return self.finish_reason is FinishReason.ABORT

    @property
    def version_at_end(self) -> str | None:
        """The version that served the end of the request: ``weight_version``."""
        return self.weight_version


@attrs.frozen(slots=True, kw_only=True)
class TokenChunk:
    """The tokens a stream delivers at once (``RolloutBackend.stream``).

    ``output_ids`` are the *new* tokens only, at output positions ``index``, ``index + 1``, ...:
    a stream's chunks, in order, have contiguous indices from 0, so put together they are the
    generation's ``output_ids`` with none repeated or missing. ``logprobs`` / ``top_logprobs``
    are those tokens' (``None`` as in ``Generation``). The last chunk, and only it, carries
    ``final``: the whole ``Generation``, as ``generate`` would have returned it (its tokens end
    with this chunk's, which may be none: an engine can say it finished after its last token).
    """

    request_id: str
    index: int
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    final: Generation | None = None
    #: The version the engine reported with these tokens, where it reports one per chunk
    #: (``Capabilities.stream_version_spans``); ``None`` otherwise.
    weight_version: str | None = None

    def __attrs_post_init__(self) -> None:
        # Like Generation: a chunk that cannot be one is the engine's (or adapter's) breach.
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ContractViolation(f"chunk index {self.index!r} is not an int >= 0")
        n = len(self.output_ids)
        if self.logprobs is not None and len(self.logprobs) != n:
            raise ContractViolation(f"chunk logprobs ({len(self.logprobs)}) and output_ids ({n}) differ in length")
        if self.top_logprobs is not None and len(self.top_logprobs) != n:
            raise ContractViolation(
                f"chunk top_logprobs ({len(self.top_logprobs)}) and output_ids ({n}) differ in length"
            )
        f = self.final
        if f is not None and (
            f.request_id != self.request_id
            or len(f.output_ids) != self.index + n
            or f.output_ids[self.index :] != self.output_ids
        ):
            raise ContractViolation(
                f"the final chunk of {self.request_id!r} (tokens {self.index}..{self.index + n}) does not end "
                f"the Generation of {f.request_id!r} ({len(f.output_ids)} tokens)"
            )

    @classmethod
    def closing(cls, final: Generation, index: int) -> TokenChunk:
        """The last chunk of a stream that delivered ``final.output_ids[:index]`` already."""
        lps, tops = final.logprobs, final.top_logprobs
        return cls(
            request_id=final.request_id,
            index=index,
            output_ids=final.output_ids[index:],
            logprobs=lps[index:] if lps is not None else None,
            top_logprobs=tops[index:] if tops is not None else None,
            final=final,
            weight_version=final.weight_version,
        )

    @property
    def end(self) -> int:
        """The output position after this chunk's tokens (the next chunk's ``index``)."""
        return self.index + len(self.output_ids)


def _dtype_name(value: object) -> str:
    # Accept torch dtypes without importing torch: str(torch.bfloat16) == "torch.bfloat16".
    s = str(value)
    return s[len("torch.") :] if s.startswith("torch.") else s


@attrs.frozen(slots=True)
class TensorSpec:
    """Name, dtype (e.g. ``"bfloat16"``) and shape of one tensor in a weight bucket."""

    name: str
    dtype: str = attrs.field(converter=_dtype_name)
    shape: tuple[int, ...] = attrs.field(converter=_int_tuple)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise _fail("tensor.name", f"must be a non-empty string, got {self.name!r}")
        if not isinstance(self.shape, tuple):
            raise _fail(f"tensor[{self.name}].shape", f"must be a sequence of ints, got {type(self.shape).__name__}")
        for i, d in enumerate(self.shape):
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise _fail(f"tensor[{self.name}].shape[{i}]", f"must be an int >= 0, got {d!r}")


def _spec_tuple(value: Iterable[TensorSpec]) -> tuple[TensorSpec, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise _fail("bucket.tensors", f"must be a sequence of TensorSpec, got {type(value).__name__}")
    return tuple(value)


@attrs.frozen(slots=True)
class WeightBucket:
    """Metadata for one broadcast bucket: the tensors arrive over the group in this order."""

    tensors: tuple[TensorSpec, ...] = attrs.field(converter=_spec_tuple)

    def __attrs_post_init__(self) -> None:
        if not self.tensors:
            raise _fail("bucket.tensors", "must not be empty")
        seen: set[str] = set()
        for i, t in enumerate(self.tensors):
            if not isinstance(t, TensorSpec):
                raise _fail(f"bucket.tensors[{i}]", f"must be a TensorSpec, got {type(t).__name__}")
            if t.name in seen:
                raise _fail("bucket.tensors", f"duplicate tensor name {t.name!r}")
            seen.add(t.name)

    @classmethod
    def from_named_tensors(cls, named: Iterable[tuple[str, Any]]) -> WeightBucket:
        """Describe real tensors (anything with ``.dtype`` and ``.shape``)."""
        return cls(tuple(TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in named))

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    @property
    def dtypes(self) -> list[str]:
        return [t.dtype for t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for t in self.tensors]


@attrs.frozen(slots=True, kw_only=True)
class WeightGroup:
    """A torch.distributed group between a trainer (rank 0) and the engines' ranks."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    group_name: str = "weight_update_group"
    backend: str = "nccl"  #: "nccl" on GPU, "gloo" on CPU

    def __attrs_post_init__(self) -> None:
        if not self.master_address:
            raise _fail("group.master_address", "must not be empty")
        port = _check_int("group.master_port", self.master_port)
        if not 0 < port < 65536:
            raise _fail("group.master_port", f"must be in 1..65535, got {port}")
        ws = _check_int("group.world_size", self.world_size)
        if ws < 2:
            raise _fail("group.world_size", f"must be >= 2 (trainer + engine), got {ws}")
        ro = _check_int("group.rank_offset", self.rank_offset)
        if not 1 <= ro < ws:
            raise _fail("group.rank_offset", f"must be in [1, world_size), got {ro}")
        if self.backend not in ("nccl", "gloo"):
            raise _fail("group.backend", f"must be 'nccl' or 'gloo', got {self.backend!r}")


@attrs.frozen(slots=True, kw_only=True)
class WorkerHealth:
    """One worker's health, as seen by the client at ``checked_at`` (monotonic seconds)."""

    worker: str
    live: bool  #: the process answers
    ready: bool  #: it accepts generation (not starting, not paused)
    making_progress: bool | None  #: a probe generation completed (None: not probed)
    weight_version: str | None
    stale: bool  #: serves another version than the fleet's expected one
    error: str | None = None


@attrs.frozen(slots=True, kw_only=True)
class HealthReport:
    """Per-worker health plus a fleet summary."""

    workers: tuple[WorkerHealth, ...]
    expected_version: str | None = None
    #: The entry point (router/frontend) answers; None where there is none.
    router_live: bool | None = None

    @property
    def live(self) -> bool:
        return bool(self.workers) and all(w.live for w in self.workers) and self.router_live is not False

    @property
    def ready(self) -> bool:
        return bool(self.workers) and all(w.ready for w in self.workers) and self.router_live is not False

    @property
    def any_ready(self) -> bool:
        return any(w.ready for w in self.workers) and self.router_live is not False

    @property
    def stale_workers(self) -> tuple[str, ...]:
        return tuple(w.worker for w in self.workers if w.stale)

    @property
    def unhealthy_workers(self) -> tuple[str, ...]:
        return tuple(w.worker for w in self.workers if not (w.live and w.ready))

    def worker(self, worker_id: str) -> WorkerHealth:
        for w in self.workers:
            if w.worker == worker_id:
                return w
        raise KeyError(worker_id)


def _enum_set(field: str, kind: type[enum.Enum], values: Iterable[Any]) -> frozenset[Any]:
    out = set()
    for v in values:
        try:
            out.add(kind(v))
        except ValueError:
            raise _fail(field, f"unknown value {v!r} (known: {[m.value for m in kind]})") from None
    return frozenset(out)


def _pause_modes(values: Iterable[PauseMode | str]) -> frozenset[PauseMode]:
    return _enum_set("capabilities.pause_modes", PauseMode, values)


def _transports(values: Iterable[WeightTransport | str]) -> frozenset[WeightTransport]:
    return _enum_set("capabilities.weight_transports", WeightTransport, values)


@attrs.frozen(slots=True, kw_only=True)
class Capabilities:
    """What a backend can do. The conformance suite skips checks for what is not declared.

    A backend must not declare what it cannot do: a declared capability that fails is a
    conformance failure, an undeclared one is a skip. What each field promises, its default and
    the checks it turns on: the capability table in ``docs/adapters.md`` (a test holds it to these
    fields and defaults).

    Defaults: optional features are off, to be declared where they work. Three are on, because
    every RL backend is expected to keep them and the suite then checks them unless the adapter says
    otherwise (an engine without them fails loudly instead of skipping quietly): ``logprobs`` (RL
    needs them; ``GenerateRequest.return_logprobs`` defaults to True), ``abort`` (``abort`` and
    ``abort_all`` are on every backend; Miles aborts at every over-sampled step) and
    ``version_source=RESPONSE`` (versions asked of the engine; ``STAMPED`` where it cannot say).
    """

    pause_modes: frozenset[PauseMode] = attrs.field(factory=frozenset, converter=_pause_modes)
    weight_transports: frozenset[WeightTransport] = attrs.field(factory=frozenset, converter=_transports)
    memory_release: bool = False
    logprobs: bool = True
    streaming: bool = False
    routing: RoutingKind = RoutingKind.SINGLE
    lora: bool = False
    abort: bool = True
    seeded_sampling: bool = False
    begin_end_update: bool = False  #: the engine has begin/end weight-update sessions
    #: ``update_weights_from_tensors`` takes a ``FlatBucket`` (SGLang's
    #: ``load_format="flattened_bucket"``: one flat tensor per bucket, so one CUDA-IPC handle per
    #: bucket instead of one per tensor). ``WeightUpdateTransaction.update_from_tensors(...,
    #: buckets=)`` sends per-tensor payloads where it is not declared.
    flattened_buckets: bool = False
    version_source: VersionSource = VersionSource.RESPONSE
    #: ``Generation.cached_tokens`` is reported (else it is 0 whatever the cache did). Off unless
    #: declared: no check can tell a reported 0 from an unreported one.
    cached_tokens: bool = False
    worker_pinning: bool = False  #: ``GenerateRequest.worker`` is honoured
    #: ``health(probe=True)`` runs a generation on each worker and reports ``making_progress``. Off
    #: unless declared: the probe is a generation sent to one worker, which takes ``worker_pinning``
    #: (off by default too).
    progress_probe: bool = False
    #: The largest ``SamplingParams.top_logprobs`` honoured (``Generation.top_logprobs``); 0: none.
    top_logprobs: int = 0
    #: ``Generation.logprobs`` / ``top_logprobs`` of a sampled request are of the distribution it was
    #: drawn from *after* ``top_k`` / ``top_p`` / ``min_p`` filtering, renormalised over the tokens
    #: kept (vLLM's ``--logprobs-mode processed_logprobs``), instead of the temperature-scaled,
    #: unfiltered one (SGLang's). The two agree where no filter is asked (RL's usual).
    filtered_logprobs: bool = False
    #: ``GenerateRequest.min_version`` / ``exact_version`` are honoured: routed only to workers
    #: whose installed label satisfies them, else ``NoCompatibleVersion``. Undeclared: ``Unsupported``.
    version_constraints: bool = False
    #: ``GenerateRequest.prompt_logprobs_start`` is honoured (``Generation.prompt_logprobs``), and so
    #: are zero-budget re-scoring requests (``max_new_tokens = 0``).
    prompt_logprobs: bool = False
    #: Where ``Generation.version_spans`` come from: ``RESPONSE``, the engine (exact across
    #: updates, token by token); ``STAMPED``, the fleet, only where exact (a generation that no
    #: load or relabel of its worker overlapped: one run), else ``None``; ``NONE``: never known.
    version_spans: VersionSource = VersionSource.NONE
    #: A stream's chunks carry the version the engine reported with their tokens
    #: (``TokenChunk.weight_version``; SGLang stamps every event with the version it holds when the
    #: event is built), so a *streamed* generation's ``version_spans`` hold across an update even
    #: where ``version_spans`` is only ``STAMPED``.
    stream_version_spans: bool = False
    #: A ``RETRACT`` weight update completes while requests are parked (they continue on the new
    #: weights, their KV recomputed). SGLang 0.5.16 refuses the flush such an update takes while
    #: parked requests wait (``Timed out waiting for idle state``; sglang#32153): there an update
    #: with requests in flight must be ``IN_PLACE`` (or ``ABORT``).
    update_while_parked: bool = False
    #: The engine takes a weight load only while paused: ai-dynamo 1.4.2's ``dynamo.vllm`` weight
    #: routes answer "Worker must be paused via pause_generation() before updating weights"
    #: otherwise (``dynamo/vllm/handlers.py``, ``update_weights_from_disk``; H100 GPU tier of
    #: 2026-12-05). A load outside a weight-update transaction then pauses the workers the fleet
    #: has not paused itself (``RETRACT``, else ``IN_PLACE``: their requests wait and go on after
    #: it) and resumes them after it, also when it fails.
    load_needs_pause: bool = False
    #: A weight load that fails (a missing checkpoint) leaves the engine serving the weights it had.
    #: Not so for vLLM 0.26: a ``reload_weights`` from a missing path killed its engine core, and
    #: every later call answered HTTP 500 ``EngineDeadError``, the reload of the good checkpoint
    #: too (H100 capture of 2026-12-06 06:21); behind ``dynamo.vllm`` 1.4.2 the next completion
    #: answered HTTP 500. Undeclared, the checks that load a missing checkpoint skip.
    survives_failed_load: bool = True
    #: ``SamplingParams.stop`` (stop strings) is honoured, with ``Generation.text``.
    stop_strings: bool = False
    #: Greedy outputs do not depend on what else is batched (SGLang: deterministic inference).
    #: Without it, concurrent traffic can flip near-tied tokens (measured on the H200: 1 of 200).
    batch_invariant: bool = False
    #: Tokens come from a model: ``temperature == 0`` picks its most likely token (the same greedy
    #: request gives the same tokens), sampling draws from its distribution, and every output id is
    #: in ``vocab_size``. ``False`` for load simulators such as ``dynamo.mocker``, whose tokens are
    #: random (its ids are not even the model's): every check that compares tokens then skips.
    greedy_decoding: bool = True
    max_context: int | None = None
    vocab_size: int | None = None
    #: The checkpoint directory the workers loaded at start, where the backend knows it (the
    #: engine reports it, e.g. SGLang's ``/model_info``; a launcher's connect URL names it). The
    #: conformance suite derives other weights from it where it is readable on its host.
    model_path: str | None = None

    def supports_pause(self, mode: PauseMode) -> bool:
        return mode in self.pause_modes

    def supports_transport(self, transport: WeightTransport) -> bool:
        return transport in self.weight_transports


def ensure_tags(tags: Sequence[MemoryTag | str] | None) -> tuple[MemoryTag, ...] | None:
    """Validate memory tags; ``None`` means all."""
    if tags is None:
        return None
    if isinstance(tags, (str, bytes)) or not isinstance(tags, (list, tuple)):
        raise _fail("tags", f"must be a list of memory tags or None, got {type(tags).__name__}")
    out = []
    for i, t in enumerate(tags):
        try:
            out.append(MemoryTag(t))
        except (ValueError, TypeError):
            raise _fail(f"tags[{i}]", f"unknown memory tag {t!r} (known: {[m.value for m in MemoryTag]})") from None
    return tuple(out)
