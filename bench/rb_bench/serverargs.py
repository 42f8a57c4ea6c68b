"""Do two fleets run their engines with the same SGLang settings? Command lines and resolved args.

A routing comparison is only fair when every fleet's workers are the same engine with the same
settings: an SGLang server started by ``sglang.launch_server`` and one started inside
``dynamo.sglang`` differ in the flags each launcher adds. Two checks, both before anything is timed:

* :func:`flags_of` / :func:`compare`: the SGLang flags on each worker's command line, parsed
  (last occurrence wins, as in argparse), with what identifies a process rather than configures
  the engine left out (:data:`IDENTITY_FLAGS`: ports, hosts, paths, names) and the flags only the
  wrapper reads (:data:`WRAPPER_FLAGS`: Dynamo's runtime flags). Runs before any process starts.
* the same :func:`compare` over the *resolved* arguments each running engine reports (SGLang's
  ``/server_info``; our Dynamo shim's ``rollout/server_args``), with :data:`IDENTITY_KEYS` left out
  and :data:`WRAPPER_SET_KEYS` (what ``dynamo.sglang`` sets inside the process whatever the command
  line says) reported as such rather than refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "IDENTITY_FLAGS",
    "IDENTITY_KEYS",
    "WRAPPER_FLAGS",
    "WRAPPER_SET_KEYS",
    "Comparison",
    "compare",
    "flags_of",
    "resolved_of",
]

#: Flags that name or place a process, not configure its engine.
IDENTITY_FLAGS = frozenset(
    {
        "--host", "--port", "--nccl-port", "--model-path", "--tokenizer-path", "--served-model-name",
        "--base-gpu-id", "--weight-version", "--dist-init-addr", "--log-dir",
    }
)  # fmt: skip
#: ``dynamo.sglang`` flags that never reach SGLang's ``ServerArgs`` (``dynamo/sglang/args.py``
#: strips them with ``parse_known_args``).
WRAPPER_FLAGS = frozenset(
    {
        "--namespace", "--endpoint", "--enable-rl", "--discovery-backend", "--request-plane",
        "--event-plane", "--component", "--use-sglang-tokenizer", "--migration-limit",
    }
)  # fmt: skip
#: Flags that take no value.
SWITCHES = frozenset(
    {
        "--disable-cuda-graph", "--sleep-on-idle", "--enable-rl", "--disable-radix-cache",
        "--enable-memory-saver", "--enable-deterministic-inference", "--skip-tokenizer-init",
        "--trust-remote-code", "--enable-metrics", "--enable-cache-report", "--disable-overlap-schedule",
    }
)  # fmt: skip
#: ``--tp`` is ``--tp-size``'s alias; these values are SGLang's defaults, the same as leaving the flag out.
_ALIASES = {"--tp": "--tp-size"}
_DEFAULTS = {"--tp-size": "1"}

#: Resolved-argument keys that identify a process (or are per process by design) rather than
#: configure its engine: ports, hosts, paths, names, the random seed SGLang draws when none is
#: given, the served version label.
IDENTITY_KEYS = re.compile(
    r"(^|_)(port|ports|host|path|dir|addr|name|ipc|url|urls)($|_)|^random_seed$|^weight_version$|"
    r"^base_gpu_id$|^(api_key|admin_api_key)(_set)?$|(^|_)worker_id$"
)
#: What ``dynamo.sglang`` sets on ``ServerArgs`` inside its process whatever its command line says
#: (ai-dynamo 1.4.2 ``dynamo/sglang/args.py``: "Dynamo expects disjoint output_ids").
WRAPPER_SET_KEYS = frozenset({"incremental_streaming_output", "enable_forward_pass_metrics"})
#: Keys of SGLang's ``/server_info`` answer that are state, not arguments.
STATE_KEYS = frozenset({"internal_states", "version", "status", "startup_time", "max_req_input_len"})


def _kv_events(value: str) -> str:
    """``--kv-events-config`` without its endpoint (a port per worker)."""
    try:
        cfg = json.loads(value)
    except ValueError:
        return value
    if not isinstance(cfg, dict):
        return value
    cfg.pop("endpoint", None)
    return json.dumps(cfg, sort_keys=True)


def flags_of(argv: Sequence[str], module_marker: str | None = None) -> dict[str, str]:
    """The engine flags of one command line: ``{flag: value}`` (``""`` for a switch), last wins.

    Everything up to and including the token after ``-m`` (the module) is skipped; identity and
    wrapper flags are dropped; ``--tp`` is read as ``--tp-size``; a flag at its default is dropped.
    """
    args = list(argv)
    if "-m" in args:
        args = args[args.index("-m") + 2 :]
    if module_marker is not None and module_marker in args:
        args = args[args.index(module_marker) + 1 :]
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        tok = args[i]
        if not tok.startswith("--"):
            i += 1
            continue
        flag, eq, inline = tok.partition("=")
        value: str
        if eq:
            value = inline
            i += 1
        elif flag in SWITCHES or i + 1 >= len(args) or args[i + 1].startswith("--"):
            value = ""
            i += 1
        else:
            value = args[i + 1]
            i += 2
        flag = _ALIASES.get(flag, flag)
        if flag in IDENTITY_FLAGS or flag in WRAPPER_FLAGS:
            continue
        if flag == "--kv-events-config":
            value = _kv_events(value)
        out[flag] = value
    for flag, default in _DEFAULTS.items():
        if out.get(flag) == default:
            del out[flag]
    return out


def resolved_of(info: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """An engine's resolved arguments as comparable strings, identity and state keys left out.
    Nested objects become ``outer.inner`` keys (each judged by its own name)."""
    out: dict[str, str] = {}
    for key, value in info.items():
        if key in STATE_KEYS or IDENTITY_KEYS.search(key):
            continue
        if isinstance(value, Mapping):
            out.update(resolved_of(value, f"{prefix}{key}."))
            continue
        if key == "kv_events_config" and isinstance(value, str):
            value = _kv_events(value)
        out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True, default=str)
    return out


@attrs.frozen
class Comparison:
    """Settings of several workers, side by side (``columns``: one label per worker)."""

    columns: tuple[str, ...]
    #: setting -> one value per column (``None``: that worker does not report it)
    table: Mapping[str, tuple[str | None, ...]]
    #: settings whose values differ (reported by every worker), minus the allowed ones
    differing: tuple[str, ...]
    #: differing settings that the caller allowed (``--vary``) or the wrapper sets itself
    allowed: tuple[str, ...]
    #: settings only some workers report (not judged)
    partial: tuple[str, ...]

    @property
    def same(self) -> bool:
        return not self.differing

    def rows(self, every_setting: bool = False) -> list[list[str]]:
        """Table rows ``[setting, value per column...]``: the differing, allowed and partial
        settings (and, with ``every_setting``, the shared ones after them)."""
        keys = list(self.differing) + list(self.allowed) + list(self.partial)
        if every_setting:
            keys += [k for k in sorted(self.table) if k not in keys]
        return [[k, *("—" if v is None else v for v in self.table[k])] for k in keys]


def compare(
    columns: Sequence[str],
    settings: Sequence[Mapping[str, str] | None],
    *,
    allowed: Iterable[str] = (),
    absent: str | None = None,
) -> Comparison:
    """Compare per-worker settings (``None``: a worker that reports none is left out).

    ``allowed``: settings the run varies on purpose (the flag or key as written, e.g.
    ``--stream-interval`` / ``stream_interval``); :data:`WRAPPER_SET_KEYS` are always allowed.
    ``absent``: the value a setting has where a worker does not list it (command lines: a flag left
    out is the engine's default, so ``"(not set)"`` is compared like any value); ``None``: a
    setting some workers do not report is listed as partial and not judged (resolved arguments).
    """
    allow = set(allowed) | WRAPPER_SET_KEYS
    kept = [(c, s) for c, s in zip(columns, settings, strict=True) if s is not None]
    cols = tuple(c for c, _ in kept)
    keys = sorted({k for _, s in kept for k in s})
    table: dict[str, tuple[str | None, ...]] = {}
    differing: list[str] = []
    allowed_hit: list[str] = []
    partial: list[str] = []
    for k in keys:
        values = tuple(s.get(k, absent) for _, s in kept)
        table[k] = values
        if any(v is None for v in values):
            partial.append(k)
            continue
        if len(set(values)) > 1:
            (allowed_hit if k in allow else differing).append(k)
    return Comparison(cols, table, tuple(differing), tuple(allowed_hit), tuple(partial))
