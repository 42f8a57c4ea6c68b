"""RL fan-out routing: GRPO-shaped rollouts through SGLang, smg and Dynamo on the same kind of workers.

What it answers: for the same RL step (same prompts, same per-sample response lengths), how long
does each router/backend take, relative to a baseline, with a 95 % interval — and where the time
goes (CPU of every process: client, router/frontend, each worker's main process, scheduler and
detokenizer).

**Rows** (``--rows``, or a ``--preset``): a row is a fleet, an entry into it and a client:

* fleets: ``sglang`` (SGLang workers behind smg; a second smg router added for cache_aware) and
  ``dynamo`` (``dynamo.sglang`` workers through our shim behind ``dynamo.frontend``; one frontend per
  router mode, all over the same workers, so modes switch without a restart); for the layer table
  also ``dynamo-stock`` (stock ``dynamo.sglang``), ``dynamo-notext`` (shim, worker-side text off),
  ``dynamo-sidefault`` (SGLang's default stream interval) and ``sglang-nokv`` (no KV events);
  and another engine: ``vllm`` (vLLM 0.26 OpenAI servers with ``VLLM_SERVER_DEV_MODE=1``, no
  router: the library's ``vllm://`` fleet sends each unpinned request to the next server, client
  side) and ``dynamo-vllm`` (``dynamo.vllm`` workers behind a round-robin ``dynamo.frontend``);
* clients: ``adapter`` (this library: ``generate_group`` for a prompt's samples, ``generate`` after)
  or ``raw`` (aiohttp posting the same bodies: SGLang's ``/generate``, Dynamo's ``/v1/completions``).

**Method.** Every fleet is started first, all at once, and stays up (their KV pools capped by
``--max-total-tokens``, schedulers asleep when idle: ``--sleep-on-idle``; what idle fleets spend
is measured and reported). Every fleet's workers must run the same SGLang arguments: the command
lines are compared before anything starts and the resolved arguments each engine reports after,
and the run refuses to go on when they differ (ports, hosts, paths aside; ``--vary`` names what a
run varies on purpose). Then, per workload, *blocks*: each block is one RL step of the workload,
run once by every row in a seeded random order; block 0 is a warm-up and is discarded. Before
each row's step its fleet's prefix caches are flushed, and every row's prompts start with a
token of its own, so no row ever hits another row's cache. A row's ratio to the baseline is the
ratio of their wall-clock over the blocks both finished, with a t interval over blocks
(``stats.py``); a target is met or missed only when its interval lies on one side of the bound.

**vLLM rows** (``--preset vllm``: ``sglang rr``, ``vllm rr``, ``dynamo-vllm rr``) run another
engine, so the argument checks above cover the SGLang fleets only: the vLLM fleets' ratio to
``sglang rr`` is engine + router, not the router alone (the report says so); ``dynamo-vllm rr``
against ``vllm rr`` is the router alone (their vLLM flags are compared with each other, as the
SGLang ones are). Memory, when every fleet shares one GPU: each SGLang worker's KV pool is capped
by ``--max-total-tokens`` (``--kv-tokens``); each vLLM server (direct or under ``dynamo.vllm``)
gets a KV cache of the same number of tokens as a fixed size (``--kv-cache-memory-bytes`` =
``--kv-tokens`` x the model's KV bytes per token: no memory profiling, which would count the other
engines starting beside it against its own budget) and ``--gpu-memory-utilization``
:data:`VLLM_MEMORY_UTILIZATION` (a fraction of the GPU's *total* memory that must be free when it
starts; it sizes nothing else once the KV size is given). Weights and activations come on top of
each. On CPU (``--engine mocker`` / ``reference``) the vLLM servers are the fake vLLM server of
``tests/vllm/fake_vllm.py`` run as processes under the same command lines (a checkout only: the
fleet fails to start, saying so, without it), and ``dynamo.vllm`` is ``dynamo.mocker
--engine-type vllm`` (``--engine mocker``) or our reference worker (``--engine reference``).

Workloads (fixed by ``--seed``):

* ``gsm8k``: ``--prompts`` GSM8K-shaped questions per step (synthetic, in the model's chat
  template), ``--samples`` samples each, one ``generate_group`` per prompt, every group at once.
  Each sample's response length is drawn from a lognormal (median ``--length-median``, capped at
  ``--max-new-tokens``) and enforced with ``max_new_tokens`` + ``ignore_eos``.
* ``agentic``: turn 1 as above, then each sample continues on its own for ``--turns - 1`` turns
  (its context + its response + a new user turn).

Run: ``python -m rb_bench.fanout --engine sglang --gpus 0,0 --preset main --out DIR`` (GPU) or
``--engine mocker --smoke`` (CPU, seconds: the same code path). ``--engine sglang`` means the real
engines on GPUs: SGLang for the SGLang fleets, vLLM for the vLLM ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs

from rollout_backends import (
    GenerateRequest,
    Generation,
    RolloutBackend,
    RolloutBackendError,
    RoutingKind,
    SamplingParams,
    Unsupported,
    generate_group,
)

from . import report
from .proc import CpuSampler
from .serverargs import Comparison, compare, flags_of, resolved_of
from .stats import Interval, Verdict, judge, paired_ratio

__all__ = [
    "FLEETS",
    "PRESETS",
    "ROWS",
    "TARGETS",
    "Row",
    "RowResult",
    "Workload",
    "main",
    "make_workload",
    "run",
]

KEY = "fanout"
WORKLOADS = ("gsm8k", "agentic")
ENGINES = ("sglang", "reference", "mocker")
TIMES = "\N{MULTIPLICATION SIGN}"
PACKAGES = (
    "torch", "sglang", "vllm", "ai-dynamo", "ai-dynamo-runtime", "smg", "transformers", "aiohttp", "orjson",
)  # fmt: skip

# -- the workload ----------------------------------------------------------------------------------

_SYSTEM = "You are a helpful assistant."
_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina", "Randy", "Joy")
_ITEMS = ("pencils", "apples", "notebooks", "stickers", "marbles", "cupcakes", "tickets", "plants")
_TEMPLATES = (
    "{name} sold clips to {a} of her friends in April, and then she sold half as many clips in May. "
    "How many clips did {name} sell altogether in April and May?",
    "{name} earns ${a} an hour for babysitting. Yesterday, she just did {b} minutes of babysitting. "
    "How much did she earn?",
    "{name} is saving money for a new wallet which costs ${c}. {name} has only half of the money she needs. "
    "Her parents decided to give her ${a} for that purpose, and her grandparents twice as much as her parents. "
    "How much more money does {name} need to buy the wallet?",
    "{name} is reading a {c}-page book. Yesterday, she was able to read {a} pages and today, she read twice as "
    "many pages as yesterday. If she wants to read half of the remaining pages tomorrow, how many pages should "
    "she read?",
    "{name} writes a {a}-page letter to {b} different friends twice a week. How many pages does he write a year?",
    "{name} made a garden with flowers of three different colors. {a} of them are yellow, and there are {b}% "
    "more of those in purple. There are only 25% as many green flowers as there are yellow and purple flowers. "
    "How many flowers does {name} have in the garden?",
    "A store sells {item} for ${a} each. {name} buys {b} of them and pays with a ${c} bill. "
    "How much change does {name} get back?",
    "{name} runs {a} miles every weekday and {b} miles on each weekend day. How many miles does {name} run in "
    "{c} weeks?",
)
_TOOL_TURN = (
    "<|im_end|>\n<|im_start|>user\nThe calculator returned {x}. Check this against your last step, "
    "fix any mistake, and continue.<|im_end|>\n<|im_start|>assistant\n"
)


@attrs.frozen
class Group:
    """One prompt and its samples' planned response lengths (and, for agentic, later turns)."""

    index: int
    prompt: tuple[int, ...]
    lengths: tuple[int, ...]  #: turn 1, per sample
    later_lengths: tuple[tuple[int, ...], ...] = ()  #: [sample][turn - 2]
    user_turns: tuple[tuple[tuple[int, ...], ...], ...] = ()  #: [sample][turn - 2]: tokens appended first

    @property
    def samples(self) -> int:
        return len(self.lengths)


@attrs.frozen
class Workload:
    name: str
    steps: tuple[tuple[Group, ...], ...]
    turns: int
    max_new_tokens: int
    vocab_size: int
    seed: int

    def planned_output_tokens(self) -> int:
        total = 0
        for step in self.steps:
            for g in step:
                total += sum(g.lengths) + sum(sum(x) for x in g.later_lengths)
        return total

    def describe(self) -> str:
        g0 = self.steps[0][0]
        prompt_lens = [len(g.prompt) for step in self.steps for g in step]
        text = (
            f"{len(self.steps)} steps x {len(self.steps[0])} prompts x {g0.samples} samples"
            f"{f' x {self.turns} turns' if self.turns > 1 else ''}; prompts {min(prompt_lens)}-{max(prompt_lens)} "
            f"tokens; {self.planned_output_tokens():,} output tokens planned (max_new_tokens {self.max_new_tokens})"
        )
        return text


def _question(rng: random.Random) -> str:
    template = rng.choice(_TEMPLATES)
    return template.format(
        name=rng.choice(_NAMES),
        item=rng.choice(_ITEMS),
        a=rng.randint(2, 60),
        b=rng.randint(2, 90),
        c=rng.randint(60, 600),
    )


def _length(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return max(low, min(high, round(rng.lognormvariate(math.log(median), sigma))))


def make_workload(
    tokenizer: Any,
    *,
    name: str,
    steps: int,
    prompts: int,
    samples: int,
    max_new_tokens: int,
    length_median: float,
    length_sigma: float = 0.6,
    min_new_tokens: int = 8,
    turns: int = 1,
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    """Token ids and per-sample lengths, fixed by ``seed`` (and the tokenizer)."""
    rng = random.Random(f"{name}-{seed}")

    def encode(text: str) -> tuple[int, ...]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return tuple(int(t) % vocab_size for t in ids)

    out_steps = []
    for _ in range(steps):
        groups = []
        for gi in range(prompts):
            messages = [
                {"role": "system", "content": _SYSTEM},
                {"role": "user", "content": f"{_question(rng)}\n{_INSTRUCTION}"},
            ]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            lengths = tuple(
                _length(rng, length_median, length_sigma, min_new_tokens, max_new_tokens) for _ in range(samples)
            )
            later: list[tuple[int, ...]] = []
            users: list[tuple[tuple[int, ...], ...]] = []
            for _ in range(samples):
                later.append(
                    tuple(
                        _length(rng, length_median, length_sigma, min_new_tokens, max_new_tokens)
                        for _ in range(turns - 1)
                    )
                )
                users.append(tuple(encode(_TOOL_TURN.format(x=rng.randint(1, 9999))) for _ in range(turns - 1)))
            groups.append(
                Group(
                    gi, encode(str(text)), lengths, tuple(later) if turns > 1 else (), tuple(users) if turns > 1 else ()
                )
            )
        out_steps.append(tuple(groups))
    return Workload(name, tuple(out_steps), turns, max_new_tokens, vocab_size, seed)


# -- clients ---------------------------------------------------------------------------------------


@attrs.frozen
class Result:
    prompt_tokens: int
    cached_tokens: int
    output_ids: tuple[int, ...]
    latency_s: float
    worker: str | None


def _group_seed(seed: int, step: int, group: int, turn: int = 0) -> int:
    return (seed * 1_000_003 + step * 10_007 + group * 101 + turn * 7) % (2**31 - 1)


class _PerSampleLengths:
    """What ``generate_group`` calls: the backend, with each sample's own ``max_new_tokens``.

    ``generate_group`` gives all samples one ``SamplingParams``; sample ``i``'s request id ends in
    ``-i``, which picks its length here. Everything else is passed through.
    """

    def __init__(self, backend: RolloutBackend, lengths: Sequence[int]) -> None:
        self._backend = backend
        self._lengths = lengths

    async def generate(self, request: GenerateRequest) -> Generation:
        i = int(request.request_id.rsplit("-", 1)[1])
        sampling = request.sampling.replace(max_new_tokens=self._lengths[i])
        return await self._backend.generate(attrs.evolve(request, sampling=sampling))

    async def abort(self, request_id: str) -> None:
        await self._backend.abort(request_id)


class Client:
    """Sends a workload's requests. ``group``: turn 1 of a prompt's samples; ``one``: one request."""

    name = ""
    reports_cached = True

    async def group(
        self, prompt: Sequence[int], lengths: Sequence[int], group_id: str, sampling: SamplingParams, seed: int
    ) -> list[Result]:
        raise NotImplementedError

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        raise NotImplementedError

    async def abort_all(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _result(gen: Generation) -> Result:
    return Result(gen.prompt_tokens, gen.cached_tokens, gen.output_ids, gen.latency_s, gen.worker or gen.weight_version)


class AdapterClient(Client):
    """Our adapter: ``generate_group`` for turn 1, ``backend.generate`` after."""

    name = "adapter"

    def __init__(self, backend: RolloutBackend, *, owned: bool = False) -> None:
        self.backend = backend
        self.owned = owned
        self.reports_cached = backend.capabilities.cached_tokens

    async def group(
        self, prompt: Sequence[int], lengths: Sequence[int], group_id: str, sampling: SamplingParams, seed: int
    ) -> list[Result]:
        wrapped = cast(RolloutBackend, _PerSampleLengths(self.backend, lengths))
        gens = await generate_group(wrapped, prompt, len(lengths), sampling, base_seed=seed, group_id=group_id)
        return [_result(x) for x in gens]

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        gen = await self.backend.generate(
            GenerateRequest(input_ids=input_ids, sampling=sampling, request_id=request_id, routing_key=key)
        )
        return _result(gen)

    async def abort_all(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.backend.abort_all(), 10.0)

    async def aclose(self) -> None:
        if self.owned:
            await self.backend.aclose()


class _RawClient(Client):
    """aiohttp with no library around it: one session, ``post(json=)``, ``resp.json()``."""

    name = "raw aiohttp"

    def __init__(self, url: str) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.url = url

    async def _post(self, body: dict[str, Any], headers: Mapping[str, str] | None = None) -> tuple[Any, float]:
        t0 = time.perf_counter()
        async with self.session.post(self.url, json=body, headers=headers) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {str(data)[:300]}")
        return data, time.perf_counter() - t0

    async def group(
        self, prompt: Sequence[int], lengths: Sequence[int], group_id: str, sampling: SamplingParams, seed: int
    ) -> list[Result]:
        return list(
            await asyncio.gather(
                *(
                    self.one(prompt, sampling.replace(max_new_tokens=n, seed=seed + i), f"{group_id}-{i}", group_id)
                    for i, n in enumerate(lengths)
                )
            )
        )

    async def aclose(self) -> None:
        await self.session.close()


class RawSGLangClient(_RawClient):
    """``POST /generate`` with the body our SGLang wire builds, to the same router."""

    def __init__(self, url: str) -> None:
        from rollout_backends.sglang_native import ROUTING_KEY_HEADER, sampling_params_body

        super().__init__(f"{url}/generate")
        self._header = ROUTING_KEY_HEADER
        self._sampling = sampling_params_body

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": self._sampling(sampling),
            "return_logprob": True,
            "rid": request_id,
        }
        data, dt = await self._post(body, {self._header: key})
        meta = data["meta_info"]
        return Result(
            int(meta.get("prompt_tokens", len(input_ids))),
            int(meta.get("cached_tokens") or 0),
            tuple(data["output_ids"]),
            dt,
            meta.get("weight_version"),
        )


class RawCompletionsClient(_RawClient):
    """``POST /v1/completions`` to a Dynamo frontend with the body our Dynamo wire builds."""

    def __init__(self, url: str, model: str, *, logprobs: bool) -> None:
        from rollout_backends.adapters.dynamo import completion_body

        super().__init__(f"{url}/v1/completions")
        self._model = model
        self._logprobs = logprobs
        self._body = completion_body

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        request = GenerateRequest(input_ids=input_ids, sampling=sampling, request_id=request_id)
        data, dt = await self._post(self._body(request, self._model, logprobs=self._logprobs))
        nvext = data.get("nvext") or {}
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        ids = nvext.get("completion_token_ids")
        if not isinstance(ids, list):
            raise RuntimeError(f"answer without nvext.completion_token_ids: {str(data)[:300]}")
        return Result(
            int(usage.get("prompt_tokens") or len(input_ids)),
            int(details.get("cached_tokens") or 0),
            tuple(ids),
            dt,
            None if nvext.get("worker_id") is None else str(nvext.get("worker_id")),
        )


# -- rows: a fleet, an entry into it, a client -------------------------------------------------------


@attrs.frozen
class Row:
    name: str
    fleet: str  #: a key of FLEETS
    entry: str  #: rr | cache_aware (smg) | rr | kv | kv+predict (Dynamo frontends)
    client: str  #: adapter | raw


def _rows(*rows: Row) -> dict[str, Row]:
    return {r.name: r for r in rows}


ROWS: Mapping[str, Row] = _rows(
    Row("sglang rr", "sglang", "rr", "adapter"),
    Row("sglang rr raw", "sglang", "rr", "raw"),
    Row("smg cache_aware", "sglang", "cache_aware", "adapter"),
    Row("sglang rr raw, no kv events", "sglang-nokv", "rr", "raw"),
    Row("dynamo rr", "dynamo", "rr", "adapter"),
    Row("dynamo rr raw", "dynamo", "rr", "raw"),
    Row("dynamo kv", "dynamo", "kv", "adapter"),
    Row("dynamo kv+predict", "dynamo", "kv+predict", "adapter"),
    Row("dynamo rr raw, stock worker", "dynamo-stock", "rr", "raw"),
    Row("dynamo rr raw, no worker text", "dynamo-notext", "rr", "raw"),
    Row("dynamo rr raw, default stream interval", "dynamo-sidefault", "rr", "raw"),
    Row("vllm rr", "vllm", "rr", "adapter"),
    Row("dynamo-vllm rr", "dynamo-vllm", "rr", "adapter"),
)
#: Row sets, each with its baseline first.
PRESETS: Mapping[str, tuple[str, ...]] = {
    # the routing comparison (targets 1 and 2)
    "main": ("sglang rr", "smg cache_aware", "dynamo rr", "dynamo kv", "dynamo kv+predict"),
    # our adapter against raw aiohttp on the same fleets (target 3)
    "client": ("sglang rr raw", "sglang rr", "dynamo rr raw", "dynamo rr"),
    # where the Dynamo path's time goes, one layer at a time, against SGLang direct with no library
    "layers": (
        "sglang rr raw",
        "sglang rr",
        "sglang rr raw, no kv events",
        "dynamo rr raw",
        "dynamo rr",
        "dynamo rr raw, stock worker",
        "dynamo rr raw, no worker text",
        "dynamo rr raw, default stream interval",
    ),
    # vLLM direct and behind Dynamo against SGLang direct: engine + router (another engine)
    "vllm": ("sglang rr", "vllm rr", "dynamo-vllm rr"),
}


@attrs.frozen
class Target:
    """``row / against ≤ bound`` on every workload both rows ran."""

    row: str
    against: str
    bound: float
    what: str

    @property
    def goal(self) -> str:
        return f"{self.row} ≤ {self.bound:.2f}{TIMES} {self.against} ({self.what})"


TARGETS: tuple[Target, ...] = (
    Target("dynamo rr", "sglang rr", 1.03, "same policy, same workers"),
    Target("dynamo kv", "smg cache_aware", 1.00, "KV-aware routers"),
    Target("sglang rr", "sglang rr raw", 1.02, "our adapter vs raw aiohttp, same fleet"),
    Target("dynamo rr", "dynamo rr raw", 1.02, "our adapter vs raw aiohttp, same fleet"),
)


# -- fleets ----------------------------------------------------------------------------------------


@attrs.frozen
class FleetVariant:
    """How one fleet differs from the others (``dynamo*``: the worker; ``sglang*``: KV events)."""

    kind: str  #: sglang (smg in front) | dynamo (frontends in front) | vllm (no router)
    what: str
    engine: str = "sglang"  #: the workers' engine on GPUs: sglang | vllm
    shim: bool = True  #: dynamo: our shim around dynamo.sglang (False: stock)
    worker_text: bool = True  #: dynamo: worker-side text (ROLLOUT_DYN_WORKER_TEXT)
    default_interval: bool = False  #: SGLang's default --stream-interval instead of the run's
    kv_events: bool = True  #: workers publish KV events (the KV router reads them)


FLEETS: Mapping[str, FleetVariant] = {
    "sglang": FleetVariant("sglang", "SGLang workers behind smg (round_robin; cache_aware added)"),
    "sglang-nokv": FleetVariant("sglang", "SGLang workers behind smg, no KV events", kv_events=False),
    "dynamo": FleetVariant("dynamo", "dynamo.sglang through our shim behind dynamo.frontend"),
    "dynamo-stock": FleetVariant("dynamo", "stock dynamo.sglang behind dynamo.frontend", shim=False),
    "dynamo-notext": FleetVariant("dynamo", "our shim, worker-side text off", worker_text=False),
    "dynamo-sidefault": FleetVariant("dynamo", "our shim, SGLang's default stream interval", default_interval=True),
    "vllm": FleetVariant(
        "vllm", "vLLM servers, no router (vllm://: client-side round robin)", engine="vllm", kv_events=False
    ),
    "dynamo-vllm": FleetVariant("dynamo", "dynamo.vllm workers behind dynamo.frontend", engine="vllm", kv_events=False),
}
_DYNAMO_MODES = {"rr": "round-robin", "kv": "kv", "kv+predict": "kv"}
_ENTRY_ORDER = ("rr", "cache_aware", "kv", "kv+predict")


@attrs.frozen
class Settings:
    """What the fleets are built from (from the command line)."""

    engine: str
    model_path: str
    workers: int
    gpus: tuple[str, ...]
    kv_tokens: int
    stream_interval: int | None
    predicted_ttl_s: float
    mocker_speedup: float
    startup_timeout_s: float
    log_root: Path
    vocab_size: int
    #: ``PYTHONPATH`` of the vLLM servers and ``dynamo.vllm`` workers (``None``: this process's)
    vllm_pythonpath: str | None = None

    @property
    def gpu(self) -> bool:
        return self.engine == "sglang"


#: The recipe proven on the H200 (``SGLangServerCommand``'s defaults), which the Dynamo workers get
#: as flags since ``dynamo.sglang`` passes SGLang's flags through.
RECIPE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph")


def engine_flags(s: Settings) -> list[str]:
    """SGLang flags every GPU worker of every fleet gets, on top of the recipe and the page size.

    Several fleets share each GPU, so each KV pool is capped by ``--max-total-tokens`` and
    ``--mem-fraction-static`` is high: SGLang sizes the pool from the memory free *now* minus
    ``(1 - fraction)`` of what was free when it started, which concurrent start-ups would otherwise
    drive below zero. ``--sleep-on-idle``: an idle scheduler waits on its socket instead of polling.
    The run's ``--stream-interval`` is given to every fleet (SGLang sends stream-less requests'
    output every ``SGLANG_FORCE_STREAM_INTERVAL`` = 50 tokens whatever it says) so that their
    arguments are the same.
    """
    return ["--max-total-tokens", str(s.kv_tokens), "--sleep-on-idle"]


#: ``--mem-fraction-static`` of every GPU worker (see :func:`engine_flags`).
MEM_FRACTION = 0.9

#: ``--gpu-memory-utilization`` of every vLLM server: a fraction of the GPU's total memory that must
#: be free when it starts (vLLM 0.26 ``v1/worker/utils.py`` ``request_memory``); with the KV cache
#: size given (:func:`vllm_flags`) it sizes nothing else.
VLLM_MEMORY_UTILIZATION = 0.1
#: vLLM flags of every vLLM server beyond the adapter's own (``VllmServerCommand``: eager, logprobs
#: mode, ``--max-logprobs``, sleep mode): those the H100 ran on 2026-12-05
#: (``tools/gpu/newer-engines.sh``, stage ``vllm``), the seed, and SGLang's page size as block size.
VLLM_RECIPE_FLAGS = (
    "--dtype", "bfloat16", "--seed", "0", "--max-model-len", "4096", "--attention-backend", "FLASH_ATTN",
    "--block-size", "16",
)  # fmt: skip
#: Command-line flags only one way of serving vLLM takes (``vllm serve``'s API server reports cached
#: tokens with it; ``dynamo.vllm`` always does): not an engine difference.
VLLM_SERVING_FLAGS = ("--enable-prompt-tokens-details",)


def kv_bytes_per_token(model_path: str) -> int:
    """KV cache bytes of one token (bf16 K and V of every layer), from the model's ``config.json``."""
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 2 * int(cfg["num_hidden_layers"]) * int(cfg["num_key_value_heads"]) * int(head_dim)


def vllm_flags(kv_tokens: int, model_path: str) -> list[str]:
    """vLLM flags every vLLM server of every fleet gets after the adapter's own (the last of a
    repeated flag wins): the recipe, and a KV cache of ``kv_tokens`` tokens, as SGLang's pools."""
    kv_bytes = kv_tokens * kv_bytes_per_token(model_path)
    return [*VLLM_RECIPE_FLAGS, "--kv-cache-memory-bytes", str(kv_bytes)]


class Fleet:
    """One set of workers and the entries (routers, frontends) in front of it."""

    def __init__(self, key: str, variant: FleetVariant, entries: set[str], s: Settings) -> None:
        self.key = key
        self.variant = variant
        self.entries = sorted(entries, key=_ENTRY_ORDER.index)
        self.settings = s
        self.urls: dict[str, str] = {}
        self._clients: dict[tuple[str, str], Client] = {}

    @property
    def stream_interval(self) -> int | None:
        return None if self.variant.default_interval else self.settings.stream_interval

    async def start(self, progress: report.Progress) -> None:
        raise NotImplementedError

    async def client(self, entry: str, kind: str) -> Client:
        if (entry, kind) not in self._clients:
            self._clients[(entry, kind)] = await self._client(entry, kind)
        return self._clients[(entry, kind)]

    async def _client(self, entry: str, kind: str) -> Client:
        raise NotImplementedError

    def command_lines(self) -> list[list[str]] | None:
        """Each GPU worker's command line (built, not started); ``None`` for CPU workers."""
        return None

    async def resolved_args(self) -> list[Mapping[str, Any] | None]:
        """Each worker's resolved engine arguments as it reports them (``None``: it reports none)."""
        return [None] * self.settings.workers

    def pids(self) -> dict[str, list[int]]:
        return {}

    def placement(self) -> list[str]:
        s = self.settings
        if not s.gpu:
            return [f"worker-{i}: CPU" for i in range(s.workers)]
        return [f"worker-{i}: CUDA_VISIBLE_DEVICES={s.gpus[i]}" for i in range(s.workers)]

    async def flush(self) -> str | None:
        """Empty the workers' prefix caches: ``None``, or why they were not emptied."""
        return "the workers cannot flush"

    async def aclose(self) -> None:
        for c in self._clients.values():
            with contextlib.suppress(Exception):
                await c.aclose()


async def _flush(backend: RolloutBackend) -> str | None:
    """Empty the workers' prefix caches: ``None``, or why they were not emptied."""
    last = "unknown"
    for _ in range(12):  # a worker refuses while requests are still draining
        try:
            await backend.flush_cache()
            return None
        except Unsupported:
            return "the workers cannot flush"
        except RolloutBackendError as exc:
            last = report.summarise_error(exc, 200)
            await asyncio.sleep(0.25)
    return last


def _ready_printer(progress: report.Progress, what: str) -> Callable[[Any], None]:
    last = [0.0]

    def show(p: Any) -> None:
        if time.monotonic() - last[0] >= 15.0 or all(p.ready.values()):
            last[0] = time.monotonic()
            progress(f"{what}: {p}")

    return show


class SGLangSide(Fleet):
    """SGLang (or reference) workers behind smg round_robin; cache_aware as a second smg router."""

    def __init__(self, key: str, variant: FleetVariant, entries: set[str], s: Settings) -> None:
        from rollout_backends.adapters.sglang import SGLangFleetConfig

        super().__init__(key, variant, entries, s)
        si = self.stream_interval
        self.config = SGLangFleetConfig(
            model_path=s.model_path,
            workers=s.workers,
            worker_kind="sglang" if s.gpu else "reference",
            router="smg",
            router_policy="round_robin",
            cuda_visible_devices=s.gpus if s.gpu else None,
            mem_fraction_static=MEM_FRACTION if s.gpu else None,
            kv_events=variant.kv_events and s.gpu,
            extra_server_args=[*engine_flags(s), *(["--stream-interval", str(si)] if si else [])] if s.gpu else (),
            log_dir=str(s.log_root / key),
            startup_timeout_s=s.startup_timeout_s,
        )
        self.fleet: Any = None

    async def start(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.sglang import start_sglang_fleet

        self.fleet = await start_sglang_fleet(self.config, progress=_ready_printer(progress, f"{self.key} fleet"))
        backend = self.fleet.backend
        # A label per worker: responses then say which worker served them (meta_info.weight_version).
        for i, w in enumerate(backend.workers):
            await backend.set_weight_version(f"w{i}", workers=[w])
        self.urls["rr"] = self.fleet.router_url
        if "cache_aware" in self.entries:
            self.urls["cache_aware"] = await self.fleet.add_router("cache_aware")

    async def _client(self, entry: str, kind: str) -> Client:
        from rollout_backends.adapters.sglang import connect

        if kind == "raw":
            return RawSGLangClient(self.urls[entry])
        if entry == "rr":
            return AdapterClient(self.fleet.backend)
        b = await connect(
            self.urls[entry],
            workers=list(self.fleet.worker_urls),
            routing=RoutingKind.CACHE_AWARE,
            vocab_size=self.settings.vocab_size,
        )
        return AdapterClient(b, owned=True)

    def command_lines(self) -> list[list[str]] | None:
        from rollout_backends.adapters.sglang._launcher import worker_argv

        if not self.settings.gpu:
            return None
        return [worker_argv(self.config, i, 30000 + i) for i in range(self.settings.workers)]

    async def resolved_args(self) -> list[Mapping[str, Any] | None]:
        from rollout_backends.kit import get_json

        out: list[Mapping[str, Any] | None] = []
        for url in self.fleet.worker_urls:
            status, info = await get_json(f"{url}/server_info", timeout=10.0)
            out.append(info if status == 200 and isinstance(info, dict) else None)
        return out

    def pids(self) -> dict[str, list[int]]:
        return dict(self.fleet.pids()) if self.fleet is not None else {}

    async def flush(self) -> str | None:
        return await _flush(self.fleet.backend)

    async def aclose(self) -> None:
        await super().aclose()
        if self.fleet is not None:
            await self.fleet.aclose()


def _worker_env(variant: FleetVariant, s: Settings, kind: str) -> dict[str, str]:
    """Environment of a Dynamo fleet's workers beyond the launcher's."""
    env = {} if variant.worker_text else {"ROLLOUT_DYN_WORKER_TEXT": "0"}
    if kind == "vllm" and s.vllm_pythonpath:
        env["PYTHONPATH"] = s.vllm_pythonpath
    return env


class _LaunchedFleet(Fleet):
    """A fleet a launcher's context manager started (``launch_dynamo_fleet``, ``launch_vllm_fleet``):
    the process groups of its supervisor, all stopped on ``aclose``."""

    _cm: Any = None
    fleet: Any = None

    async def _enter(self, cm: Any) -> None:
        self._cm = cm
        self.fleet = await cm.__aenter__()

    def pids(self) -> dict[str, list[int]]:
        if self.fleet is None:
            return {}
        sup = self.fleet.supervisor
        return {n: sup.group_pids(n) for n in sup.names}

    async def aclose(self) -> None:
        await super().aclose()
        if self._cm is not None:
            cm, self._cm = self._cm, None
            await cm.__aexit__(None, None, None)


class DynamoSide(_LaunchedFleet):
    """Dynamo workers and one frontend per router mode, all over the same workers."""

    def __init__(self, key: str, variant: FleetVariant, entries: set[str], s: Settings) -> None:
        from rollout_backends.adapters.dynamo import DynamoFleetConfig

        kind = variant.engine if s.gpu else s.engine  # sglang | vllm on GPUs; reference | mocker on CPU
        kv_events = variant.kv_events and kind != "reference"  # our reference worker publishes none
        self.unsupported = {} if kv_events else {"kv+predict": "needs KV events; reference workers publish none"}
        super().__init__(key, variant, {e for e in entries if e not in self.unsupported} or {"rr"}, s)
        self.kind = kind
        first = self.entries[0]
        self.config = DynamoFleetConfig(
            model_path=s.model_path,
            workers=s.workers,
            worker_kind=kind,
            router_mode=_DYNAMO_MODES[first],
            router_predicted_ttl_secs=s.predicted_ttl_s if first == "kv+predict" else None,
            page_size=16,
            kv_events=kv_events,
            gpus=s.gpus if s.gpu else (),
            stream_interval=self.stream_interval if kind == "sglang" else None,
            sglang_args=[*RECIPE_FLAGS, "--mem-fraction-static", str(MEM_FRACTION), *engine_flags(s)]
            if kind == "sglang"
            else [],
            sglang_shim=variant.shim,
            gpu_memory_utilization=VLLM_MEMORY_UTILIZATION if kind == "vllm" else None,
            vllm_args=vllm_flags(s.kv_tokens, s.model_path) if kind == "vllm" else [],
            worker_env=_worker_env(variant, s, kind),
            mocker_speedup_ratio=s.mocker_speedup,
            mocker_engine_type=variant.engine,
            ready_timeout=s.startup_timeout_s,
        )

    def supports(self, entry: str) -> str | None:
        """``None``, or why this fleet cannot serve ``entry``."""
        return self.unsupported.get(entry)

    async def start(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.dynamo import launch_dynamo_fleet

        await self._enter(
            launch_dynamo_fleet(
                self.config, log_dir=self.settings.log_root / self.key, progress=_ready_printer(progress, f"{self.key}")
            )
        )
        self.urls[self.entries[0]] = self.fleet.frontend_url
        for entry in self.entries[1:]:
            ttl = self.settings.predicted_ttl_s if entry == "kv+predict" else None
            self.urls[entry] = await self.fleet.add_frontend(
                _DYNAMO_MODES[entry], router_predicted_ttl_secs=ttl, name=f"frontend-{entry}"
            )

    async def _client(self, entry: str, kind: str) -> Client:
        if kind == "raw":
            return RawCompletionsClient(self.urls[entry], self.config.model_name, logprobs=self.kind != "mocker")
        backend = await self.fleet.connect(frontend_url=self.urls[entry], router_mode=_DYNAMO_MODES[entry])
        return AdapterClient(backend)

    def command_lines(self) -> list[list[str]] | None:
        from rollout_backends.adapters.dynamo._launcher import _WorkerPorts, worker_argv

        if self.kind not in ("sglang", "vllm"):
            return None
        ports = _WorkerPorts(system=21000, rpc=21001, kv_events=21002, sglang=21003, nccl=21004)
        return [worker_argv(self.config, i, "ns", ports) for i in range(self.settings.workers)]

    async def resolved_args(self) -> list[Mapping[str, Any] | None]:
        from rollout_backends.kit import HttpClient, HttpRequest

        out: list[Mapping[str, Any] | None] = []
        if self.kind != "sglang":  # the route is our shim's around dynamo.sglang
            return [None] * self.settings.workers
        client = HttpClient(control_timeout=10.0)
        try:
            for url in self.fleet.worker_urls:
                try:
                    resp = await client.send(
                        HttpRequest("POST", f"{url}/engine/rollout/server_args", json={}, timeout=10.0)
                    )
                    data = resp.json() if resp.ok else None
                except (RolloutBackendError, ValueError):
                    data = None
                out.append(data if isinstance(data, dict) and data else None)
        finally:
            await client.aclose()
        return out

    async def flush(self) -> str | None:
        if self.kind == "mocker":
            return "dynamo.mocker has no flush"
        client = await self.client(self.entries[0], "adapter")
        assert isinstance(client, AdapterClient)
        return await _flush(client.backend)


#: The fake vLLM server (a checkout's tests) that stands in for ``vllm serve`` on CPU.
FAKE_VLLM_MODULE = "tests.vllm.fake_vllm"
_CHECKOUT = Path(__file__).resolve().parents[2]


def fake_vllm_root() -> Path:
    """The checkout whose ``tests/vllm/fake_vllm.py`` serves as vLLM on CPU (``FileNotFoundError``
    saying so where there is none: the ``vllm`` fleets then run on GPUs only)."""
    if not (_CHECKOUT / "tests" / "vllm" / "fake_vllm.py").is_file():
        raise FileNotFoundError(
            f"no vLLM on CPU: the fake vLLM server ({FAKE_VLLM_MODULE}) is not in {_CHECKOUT}; "
            "the vllm fleets run with --engine sglang (GPUs) only outside a checkout"
        )
    return _CHECKOUT


@attrs.frozen
class FakeVllmCommand:
    """``VllmServerCommand``'s process with the fake vLLM server in place of ``vllm serve``: the same
    command line (the fake reads the flags it models and ignores the rest), environment, ready check
    and ``connect``."""

    server: Any  #: a ``VllmServerCommand``
    root: Path

    @property
    def grace(self) -> float:
        return float(self.server.grace)

    def build(self, ctx: Any) -> Any:
        import os

        launch = self.server.build(ctx)
        argv = [FAKE_VLLM_MODULE if a == "vllm.entrypoints.openai.api_server" else a for a in launch.spec.argv]
        path = os.pathsep.join(x for x in (str(self.root), os.environ.get("PYTHONPATH", "")) if x)
        spec = attrs.evolve(launch.spec, argv=argv, env={**launch.spec.env, "PYTHONPATH": path})
        return attrs.evolve(launch, spec=spec)

    async def connect(self, entry_url: str | None, engines: Sequence[Any], **kwargs: Any) -> Any:
        return await self.server.connect(entry_url, engines, **kwargs)


def vllm_server(config: Any, index: int) -> Any:
    """Server ``index``'s ``VllmServerCommand``, as ``launch_vllm_fleet`` builds it (the config's
    fields carried over, its memory share for that server)."""
    from rollout_backends.adapters.vllm import VllmServerCommand
    from rollout_backends.launch import carry

    return carry(VllmServerCommand, config, gpu_memory_utilization=config.memory_share(index))


@contextlib.asynccontextmanager
async def fake_vllm_fleet(config: Any, progress: Callable[[Any], None] | None = None) -> Any:
    """``launch_vllm_fleet`` with fake vLLM servers (CPU): the same launcher underneath
    (``launch_fleet``, the library's ``RunningVllmFleet``), without its check that vLLM is installed."""
    from rollout_backends.adapters.vllm import RunningVllmFleet
    from rollout_backends.launch import Local, launch_fleet

    root = fake_vllm_root()
    commands = [FakeVllmCommand(vllm_server(config, i), root) for i in range(config.workers)]
    fleet = await launch_fleet(
        commands, config.workers, None, Local(host=config.host), log_dir=config.log_dir,
        ready_timeout=config.startup_timeout_s, progress=progress,
    )  # fmt: skip
    try:
        backend = await fleet.connect(initial_version=config.weight_version)
        yield RunningVllmFleet(config=config, fleet=fleet, backend=backend)
    finally:
        await fleet.aclose()


class VllmSide(_LaunchedFleet):
    """vLLM servers with no router: the library's ``vllm://`` fleet hands each unpinned request to
    the next server (``launch_vllm_fleet``; on CPU, fake vLLM servers under the same command lines)."""

    def __init__(self, key: str, variant: FleetVariant, entries: set[str], s: Settings) -> None:
        from rollout_backends.adapters.vllm import VllmFleetConfig

        super().__init__(key, variant, entries, s)
        self.config = VllmFleetConfig(
            model_path=s.model_path,
            workers=s.workers,
            gpus=s.gpus if s.gpu else (),
            attention_backend=None,  # in vllm_flags
            gpu_memory_utilization=VLLM_MEMORY_UTILIZATION,
            sleep_mode=True,  # as dynamo.vllm workers run (DynamoWorkerCommand): the same engine
            extra_args=vllm_flags(s.kv_tokens, s.model_path),
            env={"PYTHONPATH": s.vllm_pythonpath} if s.vllm_pythonpath else {},
            log_dir=str(s.log_root / key),
            startup_timeout_s=s.startup_timeout_s,
        )

    async def start(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.vllm import launch_vllm_fleet

        show = _ready_printer(progress, f"{self.key} fleet")
        launch = launch_vllm_fleet if self.settings.gpu else fake_vllm_fleet
        await self._enter(launch(self.config, progress=show))
        self.urls["rr"] = self.fleet.connect_url()

    async def _client(self, entry: str, kind: str) -> Client:
        if kind != "adapter":
            raise ValueError(f"{self.key}: only the adapter client (no raw client for vLLM)")
        return AdapterClient(self.fleet.backend)

    def command_lines(self) -> list[list[str]] | None:
        from rollout_backends.launch import NodeContext

        if not self.settings.gpu:
            return None
        out = []
        for i in range(self.settings.workers):
            ctx = NodeContext.on(i, "127.0.0.1", "", gpu_ids=(self.settings.gpus[i],), fixed={"http": 8100 + i})
            out.append(list(vllm_server(self.config, i).build(ctx).spec.argv))
        return out

    async def flush(self) -> str | None:
        return await _flush(self.fleet.backend)


def make_fleet(key: str, entries: set[str], s: Settings) -> Fleet:
    variant = FLEETS[key]
    side = {"sglang": SGLangSide, "dynamo": DynamoSide, "vllm": VllmSide}[variant.kind]
    return side(key, variant, entries, s)


# -- steps -----------------------------------------------------------------------------------------

#: A token ahead of every prompt of row ``k``: ``_SALT + k`` (mod the vocabulary). Rows sharing a
#: fleet then never hit each other's prefix cache (nor a KV router's memory of it: SGLang 0.5.16's
#: ``flush_cache`` sends no "all blocks cleared" KV event), while every row does the same work.
_SALT = 1000


@attrs.define
class StepStat:
    wall_s: float
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    latencies: list[float] = attrs.field(factory=list)
    workers: dict[str, int] = attrs.field(factory=dict)
    #: CPU seconds during the step by ``fleet/process/role`` (``client/client/client``: this process)
    cpu: dict[str, float] = attrs.field(factory=dict)
    #: ``None``: the fleet's prefix caches were flushed before the step; else why not
    not_flushed: str | None = None

    def add(self, results: Sequence[Result]) -> None:
        for r in results:
            self.requests += 1
            self.prompt_tokens += r.prompt_tokens
            self.cached_tokens += r.cached_tokens
            self.output_tokens += len(r.output_ids)
            self.latencies.append(r.latency_s)
            if r.worker is not None:
                self.workers[r.worker] = self.workers.get(r.worker, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 4),
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "p50_s": round(statistics.median(self.latencies), 4) if self.latencies else None,
            "latencies_s": [round(x, 4) for x in self.latencies],
            "workers": dict(self.workers),
            "cpu_s": {k: round(v, 3) for k, v in sorted(self.cpu.items())},
            "not_flushed": self.not_flushed,
        }


async def run_step(client: Client, workload: Workload, step: int, tag: str, salt: int) -> tuple[list[Result], float]:
    """Every group of one step at once; agentic samples continue turn by turn on their own."""
    groups = workload.steps[step]
    base = SamplingParams(max_new_tokens=workload.max_new_tokens, temperature=1.0, top_p=1.0, ignore_eos=True)
    head = ((_SALT + salt) % workload.vocab_size,)
    collected: list[Result] = []

    async def conversation(g: Group) -> None:
        gid = f"{tag}-s{step}-g{g.index}"
        prompt = head + g.prompt
        first = await client.group(prompt, g.lengths, gid, base, _group_seed(workload.seed, step, g.index))
        collected.extend(first)
        if workload.turns <= 1:
            return

        async def follow(i: int, r: Result) -> None:
            context = list(prompt) + [t % workload.vocab_size for t in r.output_ids]
            for turn in range(workload.turns - 1):
                context += g.user_turns[i][turn]
                sampling = base.replace(
                    max_new_tokens=g.later_lengths[i][turn],
                    seed=_group_seed(workload.seed, step, g.index, turn + 1) + i,
                )
                nxt = await client.one(context, sampling, f"{gid}-{i}-t{turn + 2}", f"{gid}-{i}")
                collected.append(nxt)
                context += [t % workload.vocab_size for t in nxt.output_ids]

        await asyncio.gather(*(follow(i, r) for i, r in enumerate(first)))

    t0 = time.perf_counter()
    await asyncio.gather(*(conversation(g) for g in groups))
    return collected, time.perf_counter() - t0


async def warm_up(client: Client, workload: Workload, n: int, tag: str) -> None:
    """``n`` short requests at once (not timed): connections and first-request costs stay out of the steps."""
    g = workload.steps[0][0]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=0)
    await asyncio.gather(
        *(client.one(g.prompt[: 16 + i], sampling, f"{tag}-warm-{i}", f"{tag}-warm") for i in range(n))
    )


# -- the run ---------------------------------------------------------------------------------------


@attrs.define
class RowResult:
    row: Row
    workload: str
    #: measured steps by block index (1, 2, ...); block 0 is the discarded warm-up
    steps: dict[int, StepStat] = attrs.field(factory=dict)
    warm: StepStat | None = None
    status: str = "ok"  #: ok | n/a: ... | failed: ...
    reports_cached: bool = True

    def blocks(self) -> list[int]:
        return sorted(self.steps)

    def wall(self, blocks: Sequence[int]) -> list[float]:
        return [self.steps[b].wall_s for b in blocks]

    @property
    def step_s(self) -> float:
        return statistics.fmean(s.wall_s for s in self.steps.values()) if self.steps else math.nan

    @property
    def step_spread(self) -> float:
        """Coefficient of variation of the step times (across blocks: different prompts and lengths)."""
        w = [s.wall_s for s in self.steps.values()]
        return statistics.pstdev(w) / statistics.fmean(w) if len(w) >= 2 else math.nan

    def _sum(self, field: str) -> int:
        return sum(int(getattr(s, field)) for s in self.steps.values())

    @property
    def tokens_per_s(self) -> float:
        wall = sum(s.wall_s for s in self.steps.values())
        return self._sum("output_tokens") / wall if wall > 0 else math.nan

    @property
    def prefix_hit(self) -> float | None:
        prompt = self._sum("prompt_tokens")
        if not self.reports_cached or not prompt:
            return None
        return self._sum("cached_tokens") / prompt

    def latency(self, q: float) -> float:
        lat = sorted(x for s in self.steps.values() for x in s.latencies)
        if not lat:
            return math.nan
        return lat[min(len(lat) - 1, max(0, math.ceil(q * len(lat)) - 1))]

    @property
    def busiest_share(self) -> float | None:
        counts: Counter[str] = Counter()
        for s in self.steps.values():
            counts.update(s.workers)
        total = sum(counts.values())
        return max(counts.values()) / total if total else None

    def cpu_per_step(self) -> dict[str, float]:
        """Mean CPU seconds per step by ``fleet/process/role``."""
        if not self.steps:
            return {}
        keys = {k for s in self.steps.values() for k in s.cpu}
        n = len(self.steps)
        return {k: sum(s.cpu.get(k, 0.0) for s in self.steps.values()) / n for k in sorted(keys)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "row": self.row.name,
            "fleet": self.row.fleet,
            "entry": self.row.entry,
            "client": self.row.client,
            "workload": self.workload,
            "status": self.status,
            "blocks": self.blocks(),
            "step_s": [round(self.steps[b].wall_s, 4) for b in self.blocks()],
            "warm_up_s": None if self.warm is None else round(self.warm.wall_s, 4),
            "tokens_per_s": None if not self.steps else self.tokens_per_s,
            "prefix_hit": self.prefix_hit,
            "p50_s": None if not self.steps else self.latency(0.5),
            "p99_s": None if not self.steps else self.latency(0.99),
            "busiest_worker": self.busiest_share,
            "cpu_s_per_step": {k: round(v, 3) for k, v in self.cpu_per_step().items()},
            "steps": {str(b): self.steps[b].as_dict() for b in self.blocks()},
        }


@attrs.define
class RunResult:
    rows: list[RowResult] = attrs.field(factory=list)
    #: fleet key -> what happened at start-up (seconds, or the error)
    fleets: dict[str, str] = attrs.field(factory=dict)
    placement: dict[str, list[str]] = attrs.field(factory=dict)
    gpu_memory: list[str] = attrs.field(factory=list)
    command_args: Comparison | None = None
    #: the vLLM fleets' vLLM flags, compared with each other (never with SGLang's)
    vllm_args: Comparison | None = None
    resolved_args: Comparison | None = None
    refused: str | None = None
    #: fleet key -> the frontend's /metrics lines worth keeping (Dynamo)
    metrics: dict[str, list[str]] = attrs.field(factory=dict)
    profiles: dict[str, Any] = attrs.field(factory=dict)
    notes: list[str] = attrs.field(factory=list)
    #: workload -> the rows' order in each block (block 0 first)
    orders: dict[str, list[list[str]]] = attrs.field(factory=dict)

    def by(self, row: str, workload: str) -> RowResult | None:
        return next((r for r in self.rows if r.row.name == row and r.workload == workload), None)


class Budget:
    """The run's deadline, shared out between workloads as they come."""

    def __init__(self, seconds: float, reserve_s: float) -> None:
        self.deadline = time.monotonic() + seconds - reserve_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _columns(fleets: Mapping[str, Fleet]) -> list[str]:
    return [f"{k} w{i}" for k, f in fleets.items() for i in range(f.settings.workers)]


def check_command_lines(fleets: Mapping[str, Fleet], vary: Sequence[str], engine: str = "sglang") -> Comparison | None:
    """The ``engine`` flags of every GPU worker of every fleet of that engine, compared (``None`` on
    CPU workers, or without such fleets). Fleets of different engines are never compared."""
    lines = {k: f.command_lines() for k, f in fleets.items() if f.variant.engine == engine}
    if all(v is None for v in lines.values()):
        return None
    if engine == "vllm":
        vary = [*vary, *VLLM_SERVING_FLAGS]
    cols: list[str] = []
    flags: list[Mapping[str, str] | None] = []
    for k, argvs in lines.items():
        for i, argv in enumerate(argvs or []):
            cols.append(f"{k} w{i}")
            flags.append(flags_of(argv))
    return compare(cols, flags, allowed=vary, absent="(not set)")


async def check_resolved(fleets: Mapping[str, Fleet], vary: Sequence[str]) -> Comparison:
    """The SGLang fleets' resolved arguments, compared (another engine's are not SGLang's)."""
    fleets = {k: f for k, f in fleets.items() if f.variant.engine == "sglang"}
    cols = _columns(fleets)
    got: list[Mapping[str, str] | None] = []
    for f in fleets.values():
        for info in await f.resolved_args():
            got.append(None if info is None else resolved_of(info))
    keys = [v.lstrip("-").replace("-", "_") for v in vary]
    return compare(cols, got, allowed=keys)


def gpu_memory() -> list[str]:
    """Per-process GPU memory (``nvidia-smi``), and each GPU's total; empty without a GPU."""
    try:
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used,memory.total,utilization.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    if apps.returncode != 0:
        return []
    return [f"gpu {line.strip()}" for line in gpus.stdout.splitlines() if line.strip()] + [
        f"pid {line.strip()}" for line in apps.stdout.splitlines() if line.strip()
    ]


def _pid_owner(fleets: Mapping[str, Fleet]) -> dict[int, str]:
    out: dict[int, str] = {}
    for k, f in fleets.items():
        for name, pids in f.pids().items():
            for p in pids:
                out[p] = f"{k}/{name}"
    return out


async def _frontend_metrics(fleet: Fleet) -> list[str]:
    """The Dynamo frontends' request counters and duration sums (``/metrics``), one line each."""
    from rollout_backends.kit import HttpClient, HttpRequest

    if not isinstance(fleet, DynamoSide):
        return []
    keep: list[str] = []
    client = HttpClient(control_timeout=10.0)
    try:
        for entry, url in fleet.urls.items():
            try:
                resp = await client.send(HttpRequest("GET", f"{url}/metrics", timeout=10.0, idempotent=True))
            except RolloutBackendError:
                continue
            for line in resp.text.splitlines():
                if line.startswith("#") or not ("_sum" in line or "_count" in line or "_total" in line):
                    continue
                keep.append(f"{entry}: {line}")
    finally:
        await client.aclose()
    return keep[:400]


class Profiler:
    """``py-spy record`` of the hottest processes of a row's fleet during one measured step."""

    def __init__(self, rows: Sequence[str], out_dir: Path, seconds: float, top: int = 2) -> None:
        self.rows = set(rows)
        self.out_dir = out_dir
        self.seconds = seconds
        self.top = top
        self.done: set[str] = set()
        self.results: dict[str, Any] = {}

    def wants(self, row: str, block: int) -> bool:
        return row in self.rows and row not in self.done and block >= 1

    def start(self, row: str, hot: Sequence[tuple[str, int]]) -> list[tuple[str, subprocess.Popen[bytes], Path]]:
        import shutil

        spy = shutil.which("py-spy")
        self.done.add(row)
        if spy is None:
            self.results[row] = "py-spy is not installed"
            return []
        procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        for label, pid in hot[: self.top]:
            path = self.out_dir / f"pyspy-{len(self.results)}-{len(procs)}.txt"
            cmd = [spy, "record", "--pid", str(pid), "--duration", str(int(self.seconds)), "--rate", "200",
                   "--format", "raw", "--output", str(path), "--nonblocking"]  # fmt: skip
            procs.append((label, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), path))
        return procs

    def finish(self, row: str, procs: Sequence[tuple[str, subprocess.Popen[bytes], Path]]) -> None:
        summary: dict[str, Any] = {}
        for label, proc, path in procs:
            try:
                _, err = proc.communicate(timeout=self.seconds + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                err = b"timed out"
            summary[label] = summarize_stacks(path) if path.exists() else f"no profile: {err.decode()[-300:]}"
        self.results[row] = summary


def summarize_stacks(path: Path, top: int = 25) -> dict[str, Any]:
    """The most-sampled functions of a ``py-spy --format raw`` file: self and inclusive shares."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    if not total:
        return {"samples": 0}
    return {
        "samples": total,
        "self": [[f, round(c / total, 4)] for f, c in own.most_common(top)],
        "inclusive": [[f, round(c / total, 4)] for f, c in incl.most_common(top)],
    }


async def run(
    settings: Settings,
    rows: Sequence[Row],
    workloads: Mapping[str, Workload],
    *,
    blocks: int,
    shares: Mapping[str, float],
    budget: Budget,
    progress: report.Progress,
    seed: int = 0,
    vary: Sequence[str] = (),
    refuse_on_differ: bool = True,
    profiler: Profiler | None = None,
) -> RunResult:
    """Start every fleet the rows need (all at once), check their arguments, run the blocks, stop."""
    result = RunResult()
    entries: dict[str, set[str]] = {}
    for r in rows:
        entries.setdefault(r.fleet, set()).add(r.entry)
    fleets = {k: make_fleet(k, e, settings) for k, e in entries.items()}
    result.placement = {k: f.placement() for k, f in fleets.items()}
    result.command_args = check_command_lines(fleets, vary)
    result.vllm_args = check_command_lines(fleets, vary, "vllm")
    for cmp, what in ((result.command_args, "SGLang"), (result.vllm_args, "vLLM")):
        if cmp is not None and not cmp.same:
            why = f"the fleets' {what} command lines differ: " + ", ".join(cmp.differing)
            if _refused(result, why, refuse_on_differ, progress):
                return result
    errors: dict[str, str] = {}
    sampler = CpuSampler(lambda: {k: f.pids() for k, f in fleets.items() if k not in errors})
    try:
        progress(f"starting {len(fleets)} fleet(s) at once: {', '.join(fleets)}")
        await asyncio.gather(*(_start_fleet(f, result, errors, budget, progress) for f in fleets.values()))
        live = {k: f for k, f in fleets.items() if k not in errors}
        if not await _check_live(live, result, vary, refuse_on_differ, progress):
            return result
        await _warm_up_rows(rows, fleets, errors, next(iter(workloads.values())), progress)
        names = list(workloads)
        for wi, wl in enumerate(names):
            share = shares[wl] / sum(shares[n] for n in names[wi:])
            wl_deadline = time.monotonic() + budget.left() * share
            await _run_workload(
                rows, fleets, errors, workloads[wl], result, sampler, blocks, wl_deadline, budget, progress, seed,
                profiler,
            )  # fmt: skip
        for k, f in live.items():
            with contextlib.suppress(Exception):
                result.metrics[k] = await _frontend_metrics(f)
    finally:
        progress("stopping the fleets")
        await asyncio.gather(*(f.aclose() for f in fleets.values()), return_exceptions=True)
        if profiler is not None:
            result.profiles = profiler.results
    return result


def _refused(result: RunResult, why: str, refuse_on_differ: bool, progress: report.Progress) -> bool:
    """The fleets' arguments differ: refuse the run (True), or note that it ran anyway."""
    if refuse_on_differ:
        result.refused = why
        progress(f"refusing to run: {why}")
        return True
    result.notes.append(f"ran although {why} (--args-differ warn)")
    return False


async def _start_fleet(
    f: Fleet, result: RunResult, errors: dict[str, str], budget: Budget, progress: report.Progress
) -> None:
    """Start one fleet within the budget; a failure is recorded in ``errors`` (and re-raised only
    when it is not an ``Exception``: a cancellation)."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(f.start(progress), max(1.0, budget.left()))
        result.fleets[f.key] = f"ready in {time.monotonic() - t0:.1f} s"
        progress(f"{f.key} fleet {result.fleets[f.key]}")
    except BaseException as exc:
        errors[f.key] = report.summarise_error(exc)
        result.fleets[f.key] = f"failed: {errors[f.key]}"
        progress(f"{f.key} fleet failed to start: {errors[f.key]}")
        if not isinstance(exc, Exception | asyncio.TimeoutError):
            raise


async def _check_live(
    live: Mapping[str, Fleet],
    result: RunResult,
    vary: Sequence[str],
    refuse_on_differ: bool,
    progress: report.Progress,
) -> bool:
    """Compare the started engines' resolved arguments (False: they differ and the run is refused),
    then record each GPU process's memory with the fleet that owns it."""
    result.resolved_args = await check_resolved(live, vary)
    if not result.resolved_args.same:
        why = "the engines' resolved arguments differ: " + ", ".join(result.resolved_args.differing)
        if _refused(result, why, refuse_on_differ, progress):
            return False
        progress(f"WARNING: {why}")
    for k, f in live.items():
        if f.variant.engine != "sglang":
            result.notes.append(
                f"{k}: {f.variant.engine} workers, a different engine from SGLang: their arguments are not "
                "compared with SGLang's, and the ratio of its rows to an SGLang row is engine + router, "
                "not the router alone"
            )
        elif not any(c.startswith(f"{k} w") for c in result.resolved_args.columns):
            result.notes.append(f"{k}: its workers report no engine arguments (not compared)")
    owners = _pid_owner(live)
    for line in gpu_memory():
        if line.startswith("pid "):
            pid = line[4:].split(",")[0].strip()
            line = f"{line} ({owners.get(int(pid), '?') if pid.isdigit() else '?'})"
        result.gpu_memory.append(line)
    return True


async def _warm_up_rows(
    rows: Sequence[Row],
    fleets: Mapping[str, Fleet],
    errors: dict[str, str],
    first: Workload,
    progress: report.Progress,
) -> None:
    """A burst through every row's client: connections and kernels ready first (a failure is
    recorded in ``errors`` under ``fleet:entry:client``)."""
    for r in rows:
        f = fleets[r.fleet]
        if r.fleet in errors or (isinstance(f, DynamoSide) and f.supports(r.entry)):
            continue
        try:
            c = await f.client(r.entry, r.client)
            await asyncio.wait_for(warm_up(c, first, 16, f"w{r.fleet}-{r.entry}-{r.client}"), 120.0)
        except Exception as exc:
            errors[f"{r.fleet}:{r.entry}:{r.client}"] = f"warm-up failed: {report.summarise_error(exc)}"
            progress(f"{r.name}: warm-up failed: {report.summarise_error(exc)}")


async def _run_workload(
    rows: Sequence[Row],
    fleets: Mapping[str, Fleet],
    errors: Mapping[str, str],
    workload: Workload,
    result: RunResult,
    sampler: CpuSampler,
    max_blocks: int,
    deadline: float,
    budget: Budget,
    progress: report.Progress,
    seed: int,
    profiler: Profiler | None,
) -> None:
    """The workload's blocks (block 0 the warm-up), each row once per block in a seeded order,
    until the blocks, the workload's deadline or the rows run out."""
    results, active = await _admit_rows(rows, fleets, errors, workload, result)
    block_s: float | None = None
    n_steps = len(workload.steps)
    for block in range(min(max_blocks + 1, n_steps)):
        left = min(deadline, budget.deadline) - time.monotonic()
        if block > 0 and block_s is not None and block_s * 1.15 > left:
            progress(f"{workload.name}: stopping after {block - 1} measured blocks ({left:.0f} s left)")
            break
        order = list(active)
        random.Random(f"{seed}-{workload.name}-{block}").shuffle(order)
        result.orders.setdefault(workload.name, []).append([r.name for _, r in order])
        t_block = time.monotonic()
        for k, r in order:
            if results[r.name].status.startswith("ok"):
                await _run_row_block(
                    k, r, results[r.name], fleets[r.fleet], workload, block, sampler, budget, progress, profiler
                )
        block_s = time.monotonic() - t_block
        if all(not results[r.name].status.startswith("ok") for _, r in active):
            break


async def _admit_rows(
    rows: Sequence[Row],
    fleets: Mapping[str, Fleet],
    errors: Mapping[str, str],
    workload: Workload,
    result: RunResult,
) -> tuple[dict[str, RowResult], list[tuple[int, Row]]]:
    """Each row's result for this workload (added to ``result``), and the rows that can run: not
    failed at start-up or warm-up, and served by their fleet."""
    results: dict[str, RowResult] = {}
    active: list[tuple[int, Row]] = []
    for k, r in enumerate(rows):
        rr = RowResult(r, workload.name)
        result.rows.append(rr)
        results[r.name] = rr
        fleet = fleets[r.fleet]
        why = fleet.supports(r.entry) if isinstance(fleet, DynamoSide) else None
        if r.fleet in errors:
            rr.status = f"failed: fleet did not start ({errors[r.fleet]})"
        elif f"{r.fleet}:{r.entry}:{r.client}" in errors:
            rr.status = f"failed: {errors[f'{r.fleet}:{r.entry}:{r.client}']}"
        elif why:
            rr.status = f"n/a: {why}"
        else:
            rr.reports_cached = (await fleet.client(r.entry, r.client)).reports_cached
            active.append((k, r))
    return results, active


async def _run_row_block(
    k: int,
    r: Row,
    rr: RowResult,
    fleet: Fleet,
    workload: Workload,
    block: int,
    sampler: CpuSampler,
    budget: Budget,
    progress: report.Progress,
    profiler: Profiler | None,
) -> None:
    """One row's step of one block: flush, (profile,) run, and record its wall time, tokens and CPU
    per process in ``rr`` (a failure marks the row failed and aborts what it left running)."""
    client = await fleet.client(r.entry, r.client)
    not_flushed = await fleet.flush()
    spy: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    if profiler is not None and profiler.wants(r.name, block) and rr.warm is not None:
        own = {key: v for key, v in rr.warm.cpu.items() if key.startswith(f"{r.fleet}/")}
        hot = sorted(own, key=lambda key: -own[key])
        pids = fleet.pids()
        spy = profiler.start(r.name, [(key, p) for key in hot for p in _pids_of_role(pids, key)])
    before = sampler.sample()
    try:
        out, wall = await asyncio.wait_for(
            run_step(client, workload, block, f"b{block}r{k}", salt=k), max(1.0, budget.left())
        )
    except Exception as exc:
        rr.status = f"failed: {report.summarise_error(exc)}"
        progress(f"{r.name} {workload.name} block {block}: {rr.status}")
        await client.abort_all()
        return
    finally:
        if spy and profiler is not None:
            await asyncio.to_thread(profiler.finish, r.name, spy)
    after = sampler.sample()
    stat = StepStat(wall, not_flushed=not_flushed)
    stat.add(out)
    stat.cpu = {"/".join(key): v for key, v in CpuSampler.delta(before, after).items() if v > 0}
    if block == 0:
        rr.warm = stat
    else:
        rr.steps[block] = stat
    hit = stat.cached_tokens / stat.prompt_tokens if stat.prompt_tokens and rr.reports_cached else None
    progress(
        f"{workload.name} block {block}{' (warm-up)' if block == 0 else ''} {r.name}: {wall:.2f} s, "
        f"{stat.output_tokens / wall:,.0f} tok/s, prefix hit {'-' if hit is None else f'{hit:.1%}'}, "
        f"{stat.requests} requests"
    )


def _pids_of_role(pids: Mapping[str, list[int]], key: str) -> list[int]:
    """The pids behind a ``fleet/process/role`` CPU key (the first one is profiled)."""
    from .proc import role_of

    _, process, role = key.split("/", 2)
    return [p for p in pids.get(process, []) if role_of(p) == role][:1]


# -- reporting -------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str, none: str = "—") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def ratio(result: RunResult, row: str, against: str, workload: str) -> Interval | None:
    """``row / against`` on ``workload`` over the blocks both finished (``None``: one did not run)."""
    a, b = result.by(row, workload), result.by(against, workload)
    if a is None or b is None or not a.steps or not b.steps:
        return None
    common = sorted(set(a.steps) & set(b.steps))
    return paired_ratio(a.wall(common), b.wall(common))


def own_cpu(rr: RowResult, block: int, role: str | None) -> float:
    """CPU seconds of a row's own fleet in one block: its workers' ``role`` (``None``: every
    process of the fleet and the client)."""
    total = 0.0
    for key, secs in rr.steps[block].cpu.items():
        fleet, _, r = key.split("/", 2)
        if role is None:
            total += secs if fleet in ("client", rr.row.fleet) else 0.0
        elif fleet == rr.row.fleet and r == role:
            total += secs
    return total


def cpu_ratio(result: RunResult, row: str, against: str, workload: str, role: str | None) -> Interval | None:
    """Like :func:`ratio`, over CPU seconds: the engines' work (``role="scheduler"``) is far less
    noisy than wall-clock, which round-robin placement of the longest samples dominates."""
    a, b = result.by(row, workload), result.by(against, workload)
    if a is None or b is None or not a.steps or not b.steps:
        return None
    common = sorted(set(a.steps) & set(b.steps))
    x = [own_cpu(a, k, role) for k in common]
    y = [own_cpu(b, k, role) for k in common]
    if any(v <= 0 for v in y):
        return None
    return paired_ratio(x, y)


def verdicts(result: RunResult) -> list[tuple[str, Verdict]]:
    out = []
    for t in TARGETS:
        for wl in WORKLOADS:
            iv = ratio(result, t.row, t.against, wl)
            if iv is not None:
                out.append((wl, judge(t.goal, iv, t.bound)))
    return out


#: CPU roles in table order: where a worker's time goes.
ROLES = ("main", "scheduler", "detokenizer")


def cpu_columns(rr: RowResult) -> tuple[float, float, dict[str, float], float]:
    """Client, router/frontend, per-role worker CPU seconds per step of a row's own fleet, and what
    every *other* fleet (idle during this row's steps) spent."""
    client = entry = idle = 0.0
    roles = dict.fromkeys(ROLES, 0.0)
    for key, secs in rr.cpu_per_step().items():
        fleet, process, role = key.split("/", 2)
        if fleet == "client":
            client += secs
        elif fleet != rr.row.fleet:
            idle += secs
        elif process.startswith(("worker", "dynamo")) and not process.startswith("dynamo-frontend"):
            roles[role] = roles.get(role, 0.0) + secs
        else:
            entry += secs
    return client, entry, roles, idle


def tables(result: RunResult, baseline: str) -> dict[str, str]:
    """One Markdown table per workload: time with its interval against ``baseline``, and CPU per step."""
    out: dict[str, str] = {}
    for wl in WORKLOADS:
        rs = [r for r in result.rows if r.workload == wl]
        if not rs:
            continue
        rows = []
        for r in rs:
            if not r.steps:
                rows.append([r.row.name, "0", *["—"] * 13, r.status])
                continue
            iv = ratio(result, r.row.name, baseline, wl)
            sched = cpu_ratio(result, r.row.name, baseline, wl, "scheduler")
            every = cpu_ratio(result, r.row.name, baseline, wl, None)
            client, entry, roles, idle = cpu_columns(r)
            note = [] if r.status == "ok" else [r.status]
            why = sorted({s.not_flushed for s in r.steps.values() if s.not_flushed})
            if why:
                note.append(f"caches not flushed: {'; '.join(why)}")
            rows.append(
                [
                    r.row.name,
                    str(len(r.steps)),
                    f"{r.step_s:.2f}",
                    "baseline" if r.row.name == baseline else (iv.format() if iv else "—"),
                    "baseline" if r.row.name == baseline else (sched.format(2) if sched else "—"),
                    "baseline" if r.row.name == baseline else (every.format(2) if every else "—"),
                    f"{r.tokens_per_s:,.0f}",
                    _fmt(r.prefix_hit, ".1%"),
                    f"{r.latency(0.5):.2f} / {r.latency(0.99):.2f}",
                    _fmt(r.busiest_share, ".0%"),
                    f"{client:.2f}",
                    f"{entry:.2f}",
                    " / ".join(f"{roles[k]:.2f}" for k in ROLES),
                    f"{idle:.2f}",
                    _fmt(r.step_spread, ".0%"),
                    "; ".join(note),
                ]
            )
        out[wl] = report.md_table(
            [
                "row",
                "blocks",
                "s/step",
                f"vs {baseline} [95% CI]",
                "scheduler CPU vs baseline",
                "all CPU vs baseline",
                "output tok/s",
                "prefix hit",
                "p50 / p99 latency s",
                "busiest worker",
                "client CPU s/step",
                "router CPU s/step",
                "workers CPU s/step main / scheduler / detok",
                "idle fleets CPU s/step",
                "step spread",
                "note",
            ],
            rows,
            "lrrrrrrrrrrrrrrl",
        )
    return out


def args_table(cmp: Comparison, title: str) -> list[str]:
    lines = [f"**{title}** ({len(cmp.table)} settings compared)"]
    if cmp.same and not cmp.allowed and not cmp.partial:
        return [*lines, "", "Identical on every worker of every fleet.", ""]
    lines += ["", report.md_table(["setting", *cmp.columns], cmp.rows(), "l" * (1 + len(cmp.columns))), ""]
    if cmp.differing:
        lines.append(f"Differing: {', '.join(cmp.differing)}.")
    if cmp.allowed:
        lines.append(f"Differing on purpose (`--vary`) or set by the engine's wrapper: {', '.join(cmp.allowed)}.")
    if cmp.partial:
        lines.append(f"Reported by some workers only (not judged): {', '.join(cmp.partial)}.")
    return [*lines, ""]


def plot(result: RunResult, baseline: str, path: str, title: str) -> bool:
    """Ratio with its interval per row, every step's time per block, CPU per role per row."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    wls = [w for w in WORKLOADS if any(r.workload == w and r.steps for r in result.rows)]
    if not wls:
        return False
    fig, axes = plt.subplots(len(wls), 3, figsize=(17, 3.6 + 2.6 * len(wls)), squeeze=False)
    for row_i, wl in enumerate(wls):
        rs = [r for r in result.rows if r.workload == wl and r.steps]
        labels = [r.row.name.replace(", ", ",\n") for r in rs]
        xs = list(range(len(rs)))
        ax = axes[row_i][0]
        for x, r in zip(xs, rs, strict=True):
            iv = ratio(result, r.row.name, baseline, wl)
            if iv is None:
                continue
            lo = iv.estimate - iv.low if math.isfinite(iv.low) else 0.0
            hi = iv.high - iv.estimate if math.isfinite(iv.high) else 0.0
            ax.errorbar(
                [x],
                [iv.estimate],
                yerr=[[lo], [hi]],
                fmt="o",
                capsize=4,
                color="#777777" if r.row.name == baseline else "#3b75af",
            )
        ax.axhline(1.0, color="#999999", lw=0.8, ls="--")
        ax.set_title(f"{wl}: step time vs {baseline}, 95% CI (lower is better)", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=6, rotation=35, ha="right")
        ax = axes[row_i][1]
        for r in rs:
            ax.plot(r.blocks(), r.wall(r.blocks()), marker=".", lw=0.8, label=r.row.name)
        ax.set_title(f"{wl}: s per step, by block (same block = same work)", fontsize=9)
        ax.set_xlabel("block", fontsize=8)
        ax.legend(fontsize=6)
        ax = axes[row_i][2]
        bottom = [0.0] * len(rs)
        parts: list[tuple[str, list[float]]] = []
        cols = [cpu_columns(r) for r in rs]
        parts.append(("client", [c[0] for c in cols]))
        parts.append(("router/frontend", [c[1] for c in cols]))
        for role in ROLES:
            parts.append((f"workers: {role}", [c[2][role] for c in cols]))
        for name, ys in parts:
            ax.bar(xs, ys, bottom=bottom, label=name)
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        ax.set_title(f"{wl}: CPU s per step by process", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=6, rotation=35, ha="right")
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown(meta: dict[str, Any], info: dict[str, Any], result: RunResult, baseline: str, png: str | None) -> str:
    lines = [f"## RL fan-out routing ({info['preset']})", ""]
    lines += report.meta_lines(meta)
    lines += [
        f"- **Workers:** {info['workers']} x {info['engine']} per fleet ({info['model']}); "
        f"SGLang flags of every GPU worker: `{info['worker_flags']}`"
        + (f"; vLLM flags of every vLLM server: `{info['vllm_flags']}`" if info.get("vllm_flags") else ""),
        "- **Placement:** "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in result.placement.items())
        + ". All fleets start together and stay up; one row runs at a time.",
        f"- **Workloads:** {'; '.join(f'{k}: {v}' for k, v in info['workloads'].items())}",
        "- **Fleets:** " + "; ".join(f"{k} ({FLEETS[k].what}): {v}" for k, v in result.fleets.items()),
        f"- **Blocks:** one RL step each, every row once in a seeded random order (seed {info['seed']}); "
        "block 0 is a warm-up, discarded; every row's step starts after its fleet's `flush_cache` "
        "with prompts of its own (a leading token per row). Ratios: total wall-clock over the blocks "
        "both rows finished, 95 % interval over blocks (ratio estimator, Student's t).",
    ]
    if result.gpu_memory:
        lines.append("- **GPU memory after start-up:** " + "; ".join(result.gpu_memory))
    lines.append("")
    if result.refused:
        lines += [f"**REFUSED:** {result.refused}", ""]
    if result.notes:
        lines += [f"- {n}" for n in result.notes] + [""]
    if info["engine"] != "sglang":
        lines += [
            f"*CPU run ({info['engine']} workers): this exercises the benchmark's code; its ratios say nothing "
            "about GPU engines.*",
            "",
        ]
    for cmp, title in (
        (result.command_args, "SGLang flags on the command lines"),
        (result.vllm_args, "vLLM flags on the command lines (the vLLM fleets with each other)"),
        (result.resolved_args, "Resolved engine arguments, as each worker reports them"),
    ):
        if cmp is not None:
            lines += args_table(cmp, title)
    t = tables(result, baseline)
    for wl in WORKLOADS:
        if wl in t:
            lines += [f"### {wl}", "", t[wl], ""]
    vs = verdicts(result)
    if vs:
        lines += ["### Targets", ""] + [f"- {wl}: {v.format()}" for wl, v in vs] + [""]
    lines += [
        "*s/step*: mean wall-clock of a step (every group sent at once, until the last sample ends); "
        "*step spread*: variation of a row's step times across blocks (different prompts and lengths: "
        "the ratios pair blocks, so this spread does not enter them); *prefix hit*: cached / prompt "
        "tokens as the workers report them; *CPU s/step*: user + system seconds of the processes "
        "(from /proc), per step: the client (this process), the row's router or frontend, its "
        "workers by role (main = HTTP server or Dynamo handler with SGLang's tokenizer manager), and "
        "every other fleet together (idle while this row ran); *scheduler CPU* / *all CPU vs baseline*: "
        "the same paired ratio over the CPU seconds of the row's SGLang schedulers (the engines' "
        "own work) and of every process of its fleet plus the client.",
        "",
    ]
    if png:
        lines += [f"![fan-out routing]({png})", ""]
    return "\n".join(lines)


# -- reading a run back ----------------------------------------------------------------------------


def load_result(path: str | Path) -> tuple[RunResult, str]:
    """A run's rows and baseline from its ``results.json`` (what ``--reanalyze`` reads)."""
    data = json.loads(Path(path).read_text())[KEY]
    result = RunResult(refused=data.get("refused"), notes=list(data.get("notes") or []))
    for r in data["results"]:
        row = ROWS.get(r["row"]) or Row(r["row"], r["fleet"], r["entry"], r["client"])
        rr = RowResult(row, r["workload"], status=r["status"], reports_cached=r.get("prefix_hit") is not None)
        for b, st in (r.get("steps") or {}).items():
            rr.steps[int(b)] = StepStat(
                wall_s=float(st["wall_s"]),
                requests=int(st["requests"]),
                prompt_tokens=int(st["prompt_tokens"]),
                cached_tokens=int(st["cached_tokens"]),
                output_tokens=int(st["output_tokens"]),
                latencies=[float(x) for x in st.get("latencies_s") or ([st["p50_s"]] if st.get("p50_s") else [])],
                workers={str(k): int(v) for k, v in (st.get("workers") or {}).items()},
                cpu={str(k): float(v) for k, v in (st.get("cpu_s") or {}).items()},
                not_flushed=st.get("not_flushed"),
            )
        result.rows.append(rr)
    return result, str(data["settings"]["baseline"])


def pool(results: Sequence[RunResult]) -> RunResult:
    """Several runs as one: a row's blocks from run ``k`` are numbered ``k * 1000 + block``, so pairs
    stay within their run (runs of the same workload and engine settings only)."""
    out = RunResult()
    for k, res in enumerate(results):
        for rr in res.rows:
            mine = out.by(rr.row.name, rr.workload)
            if mine is None:
                mine = RowResult(rr.row, rr.workload, status=rr.status, reports_cached=rr.reports_cached)
                out.rows.append(mine)
            for b, st in rr.steps.items():
                mine.steps[k * 1000 + b] = st
    return out


def reanalyze(paths: Sequence[str], baseline: str | None = None) -> int:
    """Print the tables and verdicts of saved runs (pooled when several are given), against
    ``baseline`` (default: the runs' own baseline where they agree, else ``sglang rr``)."""
    loaded = [load_result(p) for p in paths]
    baselines = {b for _, b in loaded}
    if baseline is None:
        baseline = loaded[0][1] if len(baselines) == 1 else "sglang rr"
    result = loaded[0][0] if len(loaded) == 1 else pool([r for r, _ in loaded])
    print(f"{len(paths)} run(s){' pooled' if len(paths) > 1 else ''}; baseline {baseline}")
    for wl, text in tables(result, baseline).items():
        print(f"\n{wl}\n{text}")
    for wl, v in verdicts(result):
        print(f"- {wl}: {v.format()}")
    return 0


# -- main ------------------------------------------------------------------------------------------


def _vocab_size(model_path: str) -> int:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg["vocab_size"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rb_bench.fanout",
        description="RL fan-out routing: GRPO-shaped rollouts through smg and Dynamo routers, interleaved, "
        "with intervals.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--engine", choices=ENGINES, default="reference", help="worker kind (sglang = real, on GPUs)")
    p.add_argument("--model-size", default=None, help="qwen2.5-0.5b (GPU default) or tiny (CPU default)")
    p.add_argument("--model-path", help="an existing model folder (default: make one with make_tiny_model)")
    p.add_argument("--workers", type=int, default=2, help="workers per fleet")
    p.add_argument("--gpus", default="0,1", help="CUDA_VISIBLE_DEVICES of each worker of every fleet")
    p.add_argument("--preset", choices=sorted(PRESETS), default="main", help="a set of rows, baseline first")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), metavar="ROW", help="rows instead of a preset")
    p.add_argument("--baseline", choices=list(ROWS), help="default: the first row")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--shares", type=float, nargs="+", help="budget share of each workload (default 0.6 0.4)")
    p.add_argument("--blocks", type=int, default=30, help="most measured blocks per workload (the budget decides)")
    p.add_argument("--stream-interval", type=int, default=None, help="every worker's (GPU default 50; 0: leave out)")
    p.add_argument(
        "--vary",
        nargs="*",
        default=None,
        help="settings that may differ between fleets (layers: --stream-interval --kv-events-config)",
    )
    p.add_argument(
        "--args-differ",
        choices=("refuse", "warn"),
        default="refuse",
        help="when the fleets' SGLang arguments differ: refuse to run, or run and say so in the report",
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--length-median", type=float, default=250.0)
    p.add_argument("--length-sigma", type=float, default=0.6)
    p.add_argument("--agentic-prompts", type=int, default=8)
    p.add_argument("--agentic-samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-median", type=float, default=100.0)
    p.add_argument("--turn-max-new-tokens", type=int, default=256)
    p.add_argument("--predicted-ttl-s", type=float, default=5.0, help="--router-predicted-ttl-secs of kv+predict")
    p.add_argument(
        "--kv-tokens", type=int, default=300_000,
        help="--max-total-tokens of each SGLang worker; each vLLM server's KV cache holds as many tokens",
    )  # fmt: skip
    p.add_argument(
        "--vllm-pythonpath", default=None,
        help="PYTHONPATH of the vLLM servers and dynamo.vllm workers (default: this process's)",
    )  # fmt: skip
    p.add_argument("--mocker-speedup", type=float, default=10.0)
    p.add_argument("--startup-timeout-s", type=float, default=None)
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run, fleets' start-up included")
    p.add_argument("--profile", nargs="*", default=(), metavar="ROW", help="py-spy the hottest processes of ROW")
    p.add_argument("--profile-s", type=float, default=8.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (benchmarks.md, results.json, fanout.png, fanout-logs.tar.gz)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, 2 prompts x 4 samples, 3 blocks")
    p.add_argument(
        "--reanalyze",
        nargs="+",
        metavar="RESULTS_JSON",
        help="print the tables of saved runs (several: pooled, blocks paired within each run); runs nothing",
    )
    return p


def _shrink_to_smoke(args: argparse.Namespace) -> None:
    """``--smoke``: 2 prompts x 4 samples, 3 blocks, a few tokens each, at most 150 s."""
    args.prompts, args.samples, args.blocks = 2, 4, 3
    args.max_new_tokens, args.length_median, args.turn_max_new_tokens, args.turn_median = 8, 5.0, 6, 4.0
    args.agentic_prompts, args.agentic_samples, args.turns = 2, 2, 2
    args.budget_s = min(args.budget_s, 150.0)


def _workloads(args: argparse.Namespace, tokenizer: Any, vocab: int) -> dict[str, Workload]:
    """The workloads asked for, one step per block plus the warm-up block 0."""
    steps = args.blocks + 1  # block 0 is the warm-up
    makers = {
        "gsm8k": lambda: make_workload(
            tokenizer, name="gsm8k", steps=steps, prompts=args.prompts, samples=args.samples,
            max_new_tokens=args.max_new_tokens, length_median=args.length_median,
            length_sigma=args.length_sigma, vocab_size=vocab, seed=args.seed,
            min_new_tokens=min(8, args.max_new_tokens),
        ),
        "agentic": lambda: make_workload(
            tokenizer, name="agentic", steps=steps, prompts=args.agentic_prompts,
            samples=args.agentic_samples, max_new_tokens=args.turn_max_new_tokens,
            length_median=args.turn_median, length_sigma=args.length_sigma, turns=args.turns,
            vocab_size=vocab, seed=args.seed, min_new_tokens=min(8, args.turn_max_new_tokens),
        ),
    }  # fmt: skip
    return {k: makers[k]() for k in args.workloads}


def _vllm_flags_text(args: argparse.Namespace, model_path: str, gpu: bool) -> str | None:
    """The vLLM flags of every vLLM server, as the report gives them (``None``: no vLLM fleet)."""
    names = args.rows or PRESETS[args.preset]
    if all(FLEETS[ROWS[n].fleet].engine != "vllm" for n in names):
        return None
    if not gpu:
        return "(CPU: fake vLLM servers; dynamo.mocker --engine-type vllm or reference workers)"
    own = "--enforce-eager --logprobs-mode processed_logprobs --max-logprobs 21 --enable-sleep-mode"
    mem = f"--gpu-memory-utilization {VLLM_MEMORY_UTILIZATION}"
    return f"{own} {mem} {' '.join(vllm_flags(args.kv_tokens, model_path))}"


def _settings_info(
    args: argparse.Namespace,
    size: str,
    model_path: str,
    gpus: tuple[str, ...],
    flags: list[str],
    workloads: dict[str, Workload],
    baseline: str,
    vary: list[str],
) -> dict[str, Any]:
    """The run's settings as the report and ``results.json`` give them."""
    gpu = args.engine == "sglang"
    return {
        "preset": args.preset if not args.rows else "rows",
        "engine": args.engine,
        "model": f"{size} ({model_path})" if args.model_path else size,
        "workers": args.workers,
        "gpus": ",".join(gpus) if gpu else "none",
        "worker_flags": " ".join(flags) + " --kv-events-config <zmq, a port each>" if gpu else "(CPU workers)",
        "vllm_flags": _vllm_flags_text(args, model_path, gpu),
        "workloads": {k: w.describe() for k, w in workloads.items()},
        "planned_output_tokens": {k: w.planned_output_tokens() for k, w in workloads.items()},
        "seed": args.seed,
        "baseline": baseline,
        "vary": vary,
    }


def _print_results(result: RunResult, baseline: str, m: dict[str, Any]) -> None:
    """The run's tables, notes and verdicts on stdout."""
    t = tables(result, baseline)
    print(f"\nRL fan-out routing, {m['date']}, {m['machine']}, GPU: {m['gpu']}")
    if result.refused:
        print(f"\nREFUSED: {result.refused}")
    for n in result.notes:
        print(f"- {n}")
    for cmp, title in (
        (result.command_args, "command lines"),
        (result.vllm_args, "vLLM command lines"),
        (result.resolved_args, "resolved arguments"),
    ):
        if cmp is not None and (cmp.differing or cmp.allowed):
            print("\n".join(args_table(cmp, title)))
    for k, text in t.items():
        print(f"\n{k}\n{text}")
    for wl, v in verdicts(result):
        print(f"- {wl}: {v.format()}")
    print(f"\n({m['duration_s']} s)")


def _cmp(c: Comparison | None) -> Any:
    return (
        None
        if c is None
        else {"columns": c.columns, "table": dict(c.table), "differing": c.differing, "allowed": c.allowed}
    )


def _results_data(m: dict[str, Any], info: dict[str, Any], result: RunResult, baseline: str) -> dict[str, Any]:
    """Everything ``results.json`` holds: meta, settings, fleets, rows, ratios, verdicts, profiles."""
    return {
        "meta": m,
        "settings": info,
        "fleets": result.fleets,
        "placement": result.placement,
        "gpu_memory": result.gpu_memory,
        "command_args": _cmp(result.command_args),
        "vllm_command_args": _cmp(result.vllm_args),
        "resolved_args": _cmp(result.resolved_args),
        "refused": result.refused,
        "results": [r.as_dict() for r in result.rows],
        "ratios": {
            f"{r.row.name} / {baseline} / {r.workload}": attrs.asdict(iv)
            for r in result.rows
            if (iv := ratio(result, r.row.name, baseline, r.workload)) is not None
        },
        "cpu_ratios": {
            f"{r.row.name} / {baseline} / {r.workload} / {role or 'all'}": attrs.asdict(iv)
            for r in result.rows
            for role in ("scheduler", None)
            if (iv := cpu_ratio(result, r.row.name, baseline, r.workload, role)) is not None
        },
        "targets": [
            {
                "workload": wl,
                "goal": v.goal,
                "state": v.state,
                "more_blocks": v.more_blocks,
                "interval": attrs.asdict(v.interval),
            }
            for wl, v in verdicts(result)
        ],
        "orders": result.orders,
        "notes": result.notes,
        "frontend_metrics": result.metrics,
        "profiles": result.profiles,
    }


def _settings(
    args: argparse.Namespace,
    model_path: str,
    gpus: tuple[str, ...],
    stream_interval: int,
    vocab: int,
    log_root: Path,
) -> Settings:
    """The fleets' settings from the command line (``stream_interval`` 0: SGLang's default).

    ``--vllm-pythonpath`` is also searched by this process, last: the launchers check that vLLM is
    installed here before they start it (``VllmFleetConfig.preflight``), while the other fleets'
    processes keep this process's ``PYTHONPATH`` (the GPU machine's vLLM site pins other web
    packages than SGLang's: ``tools/gpu/vllm-session.sh``)."""
    gpu = args.engine == "sglang"
    for entry in (args.vllm_pythonpath or "").split(":"):
        if entry and entry not in sys.path:
            sys.path.append(entry)
    return Settings(
        engine=args.engine,
        model_path=model_path,
        workers=args.workers,
        gpus=gpus,
        kv_tokens=args.kv_tokens,
        stream_interval=stream_interval or None,
        predicted_ttl_s=args.predicted_ttl_s,
        mocker_speedup=args.mocker_speedup,
        startup_timeout_s=args.startup_timeout_s or (600.0 if gpu else 120.0),
        log_root=log_root,
        vocab_size=vocab,
        vllm_pythonpath=args.vllm_pythonpath,
    )


def _write_outputs(
    out: str, m: dict[str, Any], info: dict[str, Any], result: RunResult, baseline: str, log_root: Path
) -> None:
    """benchmarks.md, results.json, fanout.png and the fleets' logs into ``out``."""
    title = f"{m['gpu'] if m['gpu'] != 'none' else m['machine']}; {m['date']}"
    report.write_outputs(
        out,
        KEY,
        plot=lambda path: plot(result, baseline, path, title),
        markdown=lambda png: markdown(m, info, result, baseline, png),
        data=_results_data(m, info, result, baseline),
        log_dirs=[log_root],
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.reanalyze:
        return reanalyze(args.reanalyze, args.baseline)
    gpu = args.engine == "sglang"
    row_names = list(args.rows or PRESETS[args.preset])
    baseline = args.baseline or row_names[0]
    if baseline not in row_names:
        row_names.insert(0, baseline)
    if args.smoke:
        if gpu:
            p.error("--smoke is for --engine reference or mocker")
        _shrink_to_smoke(args)
    layer_vary = ["--stream-interval", "--kv-events-config"]
    vary = list(args.vary) if args.vary is not None else (layer_vary if args.preset == "layers" else [])
    size = args.model_size or ("qwen2.5-0.5b" if gpu else "tiny")
    stream_interval = args.stream_interval if args.stream_interval is not None else (50 if gpu else 0)
    if gpu:
        report.safe_multicast_env()
    progress = report.Progress("fanout: ")
    started = time.time()
    budget = Budget(args.budget_s, reserve_s=25.0 if gpu else 8.0)
    gpus = tuple(x.strip() for x in args.gpus.split(",") if x.strip())
    if gpu and len(gpus) != args.workers:
        p.error(f"--gpus names {len(gpus)} GPUs for {args.workers} workers")
    shares_in = args.shares or ([0.6, 0.4] if len(args.workloads) == 2 else [1.0] * len(args.workloads))
    if len(shares_in) != len(args.workloads) or any(x <= 0 for x in shares_in):
        p.error("--shares: one positive number per workload")
    shares = dict(zip(args.workloads, shares_in, strict=True))

    with tempfile.TemporaryDirectory(prefix="rb-fanout-") as tmp:
        model_path = args.model_path
        if model_path is None:
            from rollout_backends.adapters.reference import make_tiny_model

            progress(f"making the {size} model")
            model_path = str(make_tiny_model(Path(tmp) / "model", seed=args.seed, size=size))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        vocab = _vocab_size(model_path)
        workloads = _workloads(args, tokenizer, vocab)
        for w in workloads.values():
            progress(f"workload {w.name}: {w.describe()} (block 0 is the warm-up)")
        settings = _settings(args, model_path, gpus, stream_interval, vocab, Path(tmp) / "logs")
        out_dir = Path(args.out) if args.out else Path(tmp)
        out_dir.mkdir(parents=True, exist_ok=True)
        profiler = Profiler(args.profile, Path(tmp), args.profile_s) if args.profile else None
        rows = [ROWS[n] for n in row_names]
        result = asyncio.run(
            run(
                settings,
                rows,
                workloads,
                blocks=args.blocks,
                shares=shares,
                budget=budget,
                progress=progress,
                seed=args.seed,
                vary=vary,
                profiler=profiler,
            )
        )

        m = report.meta("python -m rb_bench.fanout", argv, PACKAGES, started)
        m["duration_s"] = round(time.time() - started, 1)
        flags = [*RECIPE_FLAGS, "--page-size", "16", *engine_flags(settings)]
        if stream_interval:
            flags += ["--stream-interval", str(stream_interval)]
        info = _settings_info(args, size, model_path, gpus, flags, workloads, baseline, vary)
        _print_results(result, baseline, m)
        if args.out:
            _write_outputs(args.out, m, info, result, baseline, settings.log_root)
            progress(f"wrote {', '.join(sorted(x.name for x in out_dir.iterdir()))} in {out_dir}")
    if result.refused:
        return 2
    return 0 if any(r.steps for r in result.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
