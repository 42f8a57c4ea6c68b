"""Miles' external-rollout version contract on the facade, in Stitch's words (pure functions).

Miles' ``docs/advanced/disaggregated-rollout.md`` (radixark/miles 31f1ca961a94, "External rollout
service contract") asks the service to route a request only to replicas that satisfy its version
requirement, to answer a retryable refusal when none does, and to report the version at generation
start and end. Stitch (modal-projects/stitch a250dc3), the reference implementation, fixes the wire:

* request: ``"weight_version": {"min_version": int | null, "exact_version": int | null}``
  (``src/stitch/types.py::VersionConstraint``), removed from the body before the engine sees it;
* refusal: HTTP 409 with ``{"type": "WeightVersionNotReady", "target_version", "applied",
  "message"}`` (``src/stitch/sync.py::AdmissionGate._rejection``, ``service.py``), no header;
* answers: on ``/generate`` ``meta_info.weight_version`` (the version served at admission, a
  string), ``meta_info.weight_version_start`` / ``_end`` (integers); on OpenAI-style routes the
  two at the top level (``src/stitch/engines/sglang.py::stamp_response``).

The routing itself is the library's (``GenerateRequest.min_version`` / ``exact_version``, the
fleet's ``VersionBook``, ``NoCompatibleVersion``); this module only reads and writes the wire. Per-token
spans, where the backend knows them, go in SGLang 0.5.23's own shape, ``meta_info.weight_versions``
``[{"version", "start", "end"}]`` (``sglang/srt/utils/weight_versions.py``, end exclusive).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from rollout_backends import GenerateRequest, Generation, InvalidRequest, NoCompatibleVersion
from rollout_backends.sglang_native import UnknownKeys

__all__ = [
    "WEIGHT_VERSION_KEY",
    "VersionConstraint",
    "parse_constraint",
    "refusal_body",
    "stamp_meta",
    "stamp_top_level",
    "wire_version",
]

#: The request key of the constraint (Stitch's ``VersionConstraint.from_payload``).
WEIGHT_VERSION_KEY = "weight_version"
_CONSTRAINT_KEYS = ("min_version", "exact_version")


@attrs.frozen(slots=True)
class VersionConstraint:
    """A request's version requirement as labels (``None``: none)."""

    min_version: str | None = None
    exact_version: str | None = None

    def apply(self, request: GenerateRequest) -> GenerateRequest:
        if self.min_version is None and self.exact_version is None:
            return request
        return attrs.evolve(request, min_version=self.min_version, exact_version=self.exact_version)


def _label(field: str, v: object) -> str | None:
    """A version as Stitch sends it (an integer >= 0) or as a label (a non-empty string)."""
    if v is None:
        return None
    if type(v) is int and v >= 0:
        return str(v)
    if type(v) is str and v:
        return v
    raise InvalidRequest(field, f"must be a version number (an integer >= 0), a version label or null, got {v!r}"[:200])


def parse_constraint(body: Mapping[str, Any], unknown_keys: UnknownKeys = UnknownKeys.REFUSE) -> VersionConstraint:
    """``body["weight_version"]`` -> the constraint (absent or null: none); ``InvalidRequest`` naming
    ``weight_version...`` as the caller wrote it. Unknown keys inside follow the facade's rule."""
    raw = body.get(WEIGHT_VERSION_KEY)
    if raw is None:
        return VersionConstraint()
    if type(raw) is not dict:
        raise InvalidRequest(
            WEIGHT_VERSION_KEY, f"must be an object {{min_version, exact_version}}, got {type(raw).__name__}"
        )
    for key in raw:
        if key not in _CONSTRAINT_KEYS and unknown_keys is UnknownKeys.REFUSE:
            raise InvalidRequest(f"{WEIGHT_VERSION_KEY}.{key}", "unknown field (known: min_version, exact_version)")
    least, exact = (_label(f"{WEIGHT_VERSION_KEY}.{k}", raw.get(k)) for k in _CONSTRAINT_KEYS)
    return VersionConstraint(min_version=least, exact_version=exact)


def wire_version(label: str) -> int | str:
    """A label as Stitch writes versions: a decimal label as the integer it is, any other as is."""
    return int(label) if label.isascii() and label.isdigit() and str(int(label)) == label else label


def refusal_body(exc: NoCompatibleVersion) -> dict[str, Any]:
    """Stitch's 409 body for a request no worker can serve (``applied``: the newest version any worker
    serves, by the fleet's history), and each worker's version (``served``; a fleet has several)."""
    target = exc.exact_version if exc.exact_version is not None else exc.min_version
    labels = [v for v in exc.served.values() if v is not None]
    rank = {v: i for i, v in enumerate(exc.history)}
    newest = max(labels, key=lambda v: rank.get(v, -1), default=None)
    return {
        "type": "WeightVersionNotReady",
        "target_version": None if target is None else wire_version(target),
        "applied": None if newest is None else wire_version(newest),
        "message": str(exc),
        "served": {w: None if v is None else wire_version(v) for w, v in exc.served.items()},
    }


def _spans(gen: Generation) -> list[dict[str, Any]] | None:
    """``gen.version_spans`` in SGLang 0.5.23's ``weight_versions`` shape (``None``: not known)."""
    runs = gen.version_spans
    if not runs:
        return None
    ends = [i for i, _ in runs[1:]] + [len(gen.output_ids)]
    return [{"version": v, "start": i, "end": e} for (i, v), e in zip(runs, ends, strict=True)]


def _served(gen: Generation) -> str | None:
    """The version to report as served: the start where known (Stitch's ``served``), else the end."""
    return gen.version_at_start if gen.version_at_start is not None else gen.weight_version


def _stamp_start_end(out: dict[str, Any], gen: Generation) -> None:
    # Each only where known: a start the fleet could not tell is never guessed from the end.
    if gen.version_at_start is not None:
        out["weight_version_start"] = wire_version(gen.version_at_start)
    if gen.weight_version is not None:
        out["weight_version_end"] = wire_version(gen.weight_version)


def stamp_meta(meta: dict[str, Any], gen: Generation) -> None:
    """``meta_info`` as Stitch stamps a ``/generate`` answer: ``weight_version`` the version at the
    start (what the request was admitted under: Miles appends it to ``Sample.weight_versions``, whose
    oldest bounds the sample's staleness), ``weight_version_start`` / ``_end``, and the spans."""
    served = _served(gen)
    if served is None:
        return  # nothing known: no version at all (a null would read as one to Miles)
    meta["weight_version"] = served
    _stamp_start_end(meta, gen)
    spans = _spans(gen)
    if spans is not None:
        meta["weight_versions"] = spans


def stamp_top_level(out: dict[str, Any], gen: Generation) -> None:
    """A chat answer's top level as Stitch stamps OpenAI-style routes (``weight_version_start`` /
    ``_end``), and SGLang 0.5.23's ``metadata`` (``weight_version``, ``weight_versions``)."""
    served = _served(gen)
    if served is None:
        return
    _stamp_start_end(out, gen)
    metadata: dict[str, Any] = {"weight_version": served}
    spans = _spans(gen)
    if spans is not None:
        metadata["weight_versions"] = spans
    out["metadata"] = metadata
