"""RL fan-out routing: GRPO-shaped rollouts through every router we support, on the same workers.

Workloads (fixed by ``--seed``):

* ``gsm8k``: ``--prompts`` GSM8K-shaped math questions per step (synthetic, from templates, put in
  a shared chat template and tokenized with the model's tokenizer), ``--samples`` samples each,
  sent as one ``rollout_backends.generate_group`` per prompt (siblings share a routing key), every
  group of a step at once. Each sample's response length is drawn from a lognormal distribution
  (median ``--length-median``, capped at ``--max-new-tokens``) and enforced with ``max_new_tokens``
  + ``ignore_eos``, so every backend generates exactly the same number of tokens.
* ``agentic``: multi-turn: turn 1 as above, then each sample continues on its own for
  ``--turns - 1`` turns: its previous context + its previous response + a new user turn.

Backends (rows): SGLang workers behind ``smg --policy round_robin`` (the **baseline**, like Miles'
own router), the same workers behind ``smg --policy cache_aware``, and Dynamo (frontend + workers)
with ``--router-mode round-robin``, ``kv``, and ``kv`` + ``--router-predicted-ttl-secs``
(predict-on-route), the Dynamo rows also with the workers' ``--stream-interval 50``.
Fleets are started once, all at the same time, and reused: policies are switched by a second smg
router over the same workers, Dynamo router modes by restarting only the frontend. Every job
starts from an empty prefix cache (``flush_cache`` first, where the workers have one).

Plus *adapter vs direct*: on the SGLang round-robin fleet, the gsm8k steps through our adapter and
through raw aiohttp posting the same bodies to the same router, interleaved step by step.

Run: ``python -m rollout_backends._bench.fanout --engine sglang --model-size qwen2.5-0.5b
--workers 2 --gpus 0,1 --out DIR`` (GPU) or ``--engine mocker --smoke`` (CPU, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import attrs

from rollout_backends._bench import report
from rollout_backends._errors import RolloutBackendError, Unsupported
from rollout_backends._protocol import RolloutBackend
from rollout_backends._transaction import generate_group
from rollout_backends._types import GenerateRequest, Generation, RoutingKind, SamplingParams

__all__ = [
    "BACKENDS",
    "Job",
    "JobResult",
    "Workload",
    "main",
    "make_workload",
    "run",
]

KEY = "fanout"
BASELINE = "sglang rr"
#: Row names in table order.
BACKENDS = ("sglang rr", "smg cache_aware", "dynamo rr", "dynamo kv", "dynamo kv+predict")
WORKLOADS = ("gsm8k", "agentic")
ENGINES = ("sglang", "reference", "mocker")
TIMES = "\N{MULTIPLICATION SIGN}"
TARGET_DIRECT_RATIO = 1.01
PACKAGES = ("torch", "sglang", "ai-dynamo", "ai-dynamo-runtime", "smg", "transformers", "aiohttp", "orjson")

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
    """Sends a workload's requests. ``group``: turn 1 of a prompt's samples; ``one``: a later turn."""

    name = ""
    reports_cached = True

    async def group(self, g: Group, group_id: str, sampling: SamplingParams, seed: int) -> list[Result]:
        raise NotImplementedError

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        raise NotImplementedError

    async def flush(self) -> bool:
        """Empty the workers' prefix caches; False where the workers cannot."""
        return False

    async def abort_all(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def _result(gen: Generation) -> Result:
    return Result(gen.prompt_tokens, gen.cached_tokens, gen.output_ids, gen.latency_s, gen.worker or gen.weight_version)


class AdapterClient(Client):
    """Our adapter: ``generate_group`` for turn 1, ``backend.generate`` after."""

    name = "adapter"

    def __init__(self, backend: RolloutBackend, *, owned: bool = False, can_flush: bool = True) -> None:
        self.backend = backend
        self.owned = owned
        self.can_flush = can_flush
        self.reports_cached = backend.capabilities.cached_tokens

    async def group(self, g: Group, group_id: str, sampling: SamplingParams, seed: int) -> list[Result]:
        wrapped = cast(RolloutBackend, _PerSampleLengths(self.backend, g.lengths))
        gens = await generate_group(wrapped, g.prompt, g.samples, sampling, base_seed=seed, group_id=group_id)
        return [_result(x) for x in gens]

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        gen = await self.backend.generate(
            GenerateRequest(input_ids=input_ids, sampling=sampling, request_id=request_id, routing_key=key)
        )
        return _result(gen)

    async def flush(self) -> bool:
        if not self.can_flush:
            return False
        for _ in range(12):  # a worker refuses while requests are still draining
            try:
                await self.backend.flush_cache()
                return True
            except Unsupported:
                return False
            except RolloutBackendError:
                await asyncio.sleep(0.25)
        return False

    async def abort_all(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.backend.abort_all(), 10.0)

    async def aclose(self) -> None:
        if self.owned:
            await self.backend.aclose()


class RawAiohttpClient(Client):
    """Direct engine calls: aiohttp posts of the bodies our SGLang wire would send, to the same router."""

    name = "raw aiohttp"

    def __init__(self, url: str) -> None:
        import aiohttp

        from rollout_backends.adapters.sglang._wire import ROUTING_KEY_HEADER, sampling_params_body

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self.url = f"{url}/generate"
        self.header = ROUTING_KEY_HEADER
        self._body = sampling_params_body

    def _sampling(self, sampling: SamplingParams, length: int, seed: int | None) -> dict[str, Any]:
        sp = self._body(sampling)
        sp["max_new_tokens"] = length
        if seed is not None:
            sp["sampling_seed"] = seed
        return sp

    async def _post(self, body: dict[str, Any], key: str) -> Result:
        t0 = time.perf_counter()
        async with self.session.post(self.url, json=body, headers={self.header: key}) as resp:
            data = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {str(data)[:300]}")
        dt = time.perf_counter() - t0
        meta = data["meta_info"]
        return Result(
            int(meta.get("prompt_tokens", len(body["input_ids"]))),
            int(meta.get("cached_tokens") or 0),
            tuple(data["output_ids"]),
            dt,
            meta.get("weight_version"),
        )

    async def group(self, g: Group, group_id: str, sampling: SamplingParams, seed: int) -> list[Result]:
        prompt = list(g.prompt)
        bodies = [
            {
                "input_ids": prompt,
                "sampling_params": self._sampling(sampling, g.lengths[i], seed + i),
                "return_logprob": True,
                "rid": f"{group_id}-{i}",
            }
            for i in range(g.samples)
        ]
        return list(await asyncio.gather(*(self._post(b, group_id) for b in bodies)))

    async def one(self, input_ids: Sequence[int], sampling: SamplingParams, request_id: str, key: str) -> Result:
        body = {
            "input_ids": list(input_ids),
            "sampling_params": self._sampling(sampling, sampling.max_new_tokens, sampling.seed),
            "return_logprob": True,
            "rid": request_id,
        }
        return await self._post(body, key)

    async def aclose(self) -> None:
        await self.session.close()


# -- steps -----------------------------------------------------------------------------------------


@attrs.define
class StepStat:
    wall_s: float
    cpu_s: float
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    latencies: list[float] = attrs.field(factory=list)
    workers: dict[str, int] = attrs.field(factory=dict)

    def add(self, results: Sequence[Result]) -> None:
        for r in results:
            self.requests += 1
            self.prompt_tokens += r.prompt_tokens
            self.cached_tokens += r.cached_tokens
            self.output_tokens += len(r.output_ids)
            self.latencies.append(r.latency_s)
            if r.worker is not None:
                self.workers[r.worker] = self.workers.get(r.worker, 0) + 1


async def run_step(client: Client, workload: Workload, step: int, tag: str) -> StepStat:
    """Every group of one step at once; agentic samples continue turn by turn on their own."""
    groups = workload.steps[step]
    base = SamplingParams(max_new_tokens=workload.max_new_tokens, temperature=1.0, top_p=1.0, ignore_eos=True)
    collected: list[Result] = []

    async def conversation(g: Group) -> None:
        gid = f"{tag}-s{step}-g{g.index}"
        first = await client.group(g, gid, base, _group_seed(workload.seed, step, g.index))
        collected.extend(first)
        if workload.turns <= 1:
            return

        async def follow(i: int, r: Result) -> None:
            context = list(g.prompt) + [t % workload.vocab_size for t in r.output_ids]
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

    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(conversation(g) for g in groups))
    stat = StepStat(time.perf_counter() - t0, time.process_time() - c0)
    stat.add(collected)
    return stat


async def warm_up(client: Client, workload: Workload, n: int, tag: str) -> None:
    """``n`` short requests at once (not timed): first-request and first-batch costs stay out of the steps."""
    g = workload.steps[0][0]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, seed=0)
    await asyncio.gather(
        *(client.one(g.prompt[: 16 + i], sampling, f"{tag}-warm-{i}", f"{tag}-warm") for i in range(n))
    )


# -- fleets ----------------------------------------------------------------------------------------


@attrs.frozen
class Settings:
    """What the fleets are built from (from the command line)."""

    engine: str
    model_path: str
    workers: int
    gpus: tuple[str, ...]
    kv_tokens: int
    predicted_ttl_s: float
    mocker_speedup: float
    startup_timeout_s: float
    log_root: Path
    vocab_size: int


def _sglang_flags(s: Settings) -> list[str]:
    """SGLang server flags every GPU worker gets (SGLang fleet and Dynamo workers alike).

    Several workers share each GPU (the fleets run side by side), so the KV pool is capped by
    ``--max-total-tokens`` and ``--mem-fraction-static`` is high: SGLang sizes the pool from the
    memory free *now* minus ``(1 - fraction)`` of what was free when it started, which
    concurrent start-ups would otherwise drive below zero.
    """
    return [
        "--mem-fraction-static", "0.9", "--max-total-tokens", str(s.kv_tokens), "--sleep-on-idle",
    ]  # fmt: skip


class Fleet:
    """One set of workers and the routers in front of it."""

    key = ""

    async def start(self, progress: report.Progress) -> None:
        raise NotImplementedError

    async def client(self, backend: str, raw: bool = False) -> Client:
        raise NotImplementedError

    def log_dirs(self) -> list[Path]:
        return []

    async def aclose(self) -> None:
        raise NotImplementedError


def _ready_printer(progress: report.Progress, what: str) -> Callable[[Any], None]:
    last = [0.0]

    def show(p: Any) -> None:
        if time.monotonic() - last[0] >= 15.0 or all(p.ready.values()):
            last[0] = time.monotonic()
            progress(f"{what}: {p}")

    return show


class SGLangSide(Fleet):
    """SGLang (or reference) workers behind smg: a round_robin router, and a cache_aware one added."""

    key = "sglang"

    def __init__(self, s: Settings) -> None:
        from rollout_backends.adapters.sglang import SGLangFleetConfig

        gpu = s.engine == "sglang"
        self.settings = s
        self.config = SGLangFleetConfig(
            model_path=s.model_path,
            workers=s.workers,
            worker_kind="sglang" if gpu else "reference",
            router="smg",
            router_policy="round_robin",
            cuda_visible_devices=s.gpus if gpu else None,
            extra_server_args=_sglang_flags(s) if gpu else (),
            log_dir=str(s.log_root / "sglang"),
            startup_timeout_s=s.startup_timeout_s,
        )
        self.fleet: Any = None
        self.cache_aware_url: str | None = None
        self._clients: dict[tuple[str, bool], Client] = {}

    async def start(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.sglang import start_sglang_fleet

        self.fleet = await start_sglang_fleet(self.config, progress=_ready_printer(progress, "sglang fleet"))
        backend = self.fleet.backend
        # A label per worker: responses then say which worker served them (meta_info.weight_version).
        for i, w in enumerate(backend.workers):
            await backend.set_weight_version(f"w{i}", workers=[w])
        self.cache_aware_url = await self.fleet.add_router("cache_aware")

    async def client(self, backend: str, raw: bool = False) -> Client:
        from rollout_backends.adapters.sglang import connect

        if (backend, raw) in self._clients:
            return self._clients[(backend, raw)]
        if backend == "sglang rr":
            client: Client = RawAiohttpClient(self.fleet.router_url) if raw else AdapterClient(self.fleet.backend)
        elif backend == "smg cache_aware" and not raw:
            assert self.cache_aware_url is not None
            b = await connect(
                self.cache_aware_url,
                workers=list(self.fleet.worker_urls),
                routing=RoutingKind.CACHE_AWARE,
                vocab_size=self.settings.vocab_size,
            )
            client = AdapterClient(b, owned=True)
        else:
            raise ValueError(f"{self.key} has no backend {backend!r} (raw={raw})")
        self._clients[(backend, raw)] = client
        return client

    def log_dirs(self) -> list[Path]:
        return [self.settings.log_root / "sglang"]

    async def aclose(self) -> None:
        for c in self._clients.values():
            with contextlib.suppress(Exception):
                await c.aclose()
        if self.fleet is not None:
            await self.fleet.aclose()


_DYNAMO_MODES = {"dynamo rr": "round-robin", "dynamo kv": "kv", "dynamo kv+predict": "kv"}


class DynamoSide(Fleet):
    """Dynamo workers and one frontend; the router mode changes by restarting the frontend only."""

    def __init__(self, s: Settings, stream_interval: int | None) -> None:
        from rollout_backends.adapters.dynamo import DynamoFleet

        self.settings = s
        self.stream_interval = stream_interval
        self.key = "dynamo" if stream_interval is None else f"dynamo-si{stream_interval}"
        kind = {"sglang": "sglang", "reference": "reference", "mocker": "mocker"}[s.engine]
        base = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph"]
        self.config = DynamoFleet(
            model_path=s.model_path,
            workers=s.workers,
            worker_kind=kind,
            router_mode="round-robin",
            page_size=16,
            kv_events=kind != "reference",  # our reference worker publishes no KV events
            gpus=s.gpus if kind == "sglang" else (),
            stream_interval=stream_interval,
            sglang_args=[*base, *_sglang_flags(s)] if kind == "sglang" else [],
            mocker_speedup_ratio=s.mocker_speedup,
            ready_timeout=s.startup_timeout_s,
        )
        self.mode = "dynamo rr"
        self._cm: Any = None
        self.fleet: Any = None
        self._client: Client | None = None

    def supports(self, backend: str) -> str | None:
        """``None``, or why this fleet cannot serve ``backend``."""
        if backend == "dynamo kv+predict" and not self.config.kv_events:
            return "needs KV events; reference workers publish none"
        return None

    def _config_for(self, backend: str) -> Any:
        mode = _DYNAMO_MODES[backend]
        ttl = self.settings.predicted_ttl_s if backend == "dynamo kv+predict" else None
        return attrs.evolve(self.config, router_mode=mode, router_predicted_ttl_secs=ttl)

    async def start(self, progress: report.Progress) -> None:
        from rollout_backends.adapters.dynamo import launch_dynamo_fleet

        self._cm = launch_dynamo_fleet(
            self.config,
            log_dir=self.settings.log_root / self.key,
            progress=_ready_printer(progress, f"{self.key} fleet"),
        )
        self.fleet = await self._cm.__aenter__()

    async def _switch(self, backend: str) -> None:
        from rollout_backends._supervisor import port_in_use
        from rollout_backends.adapters.dynamo._launcher import frontend_argv

        cfg = self._config_for(backend)
        sup = self.fleet.supervisor
        spec = sup.process("frontend").spec
        port = int(self.fleet.frontend_url.rsplit(":", 1)[1])
        await sup.stop("frontend")
        deadline = time.monotonic() + 15.0
        while port_in_use(cfg.host, port) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await sup.start(attrs.evolve(spec, argv=frontend_argv(cfg, self.fleet.namespace, port)))
        await sup.wait_ready(["frontend"], timeout=120.0)
        self.mode = backend

    async def client(self, backend: str, raw: bool = False) -> Client:
        if raw or backend not in _DYNAMO_MODES:
            raise ValueError(f"{self.key} has no backend {backend!r} (raw={raw})")
        if self._client is not None and self.mode == backend:
            return self._client
        if self.mode != backend:
            await self._switch(backend)
        # A fresh client per frontend process: pooled connections to the old one are dead.
        backend_ = await self.fleet.connect(router_mode=self._config_for(backend).router_mode)
        self._client = AdapterClient(backend_, can_flush=self.config.worker_kind != "mocker")
        return self._client

    def log_dirs(self) -> list[Path]:
        return [self.settings.log_root / self.key]

    async def aclose(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            await cm.__aexit__(None, None, None)


# -- jobs ------------------------------------------------------------------------------------------


@attrs.frozen
class Job:
    backend: str
    fleet: str  #: Fleet.key
    workload: str
    stream_interval: int | None = None
    paired: bool = False  #: adapter vs raw aiohttp, interleaved (sglang rr only)

    @property
    def label(self) -> str:
        si = f", stream interval {self.stream_interval}" if self.stream_interval else ""
        return f"{self.backend}{si}"


@attrs.define
class JobResult:
    backend: str
    workload: str
    client: str
    stream_interval: int | None
    status: str = "ok"  #: ok | cut (budget) | skipped: ... | failed: ...
    steps: list[StepStat] = attrs.field(factory=list)
    flushed: bool = False
    reports_cached: bool = True
    switch_s: float = 0.0

    @property
    def label(self) -> str:
        si = f", stream interval {self.stream_interval}" if self.stream_interval else ""
        return f"{self.backend}{si}"

    @property
    def wall_s(self) -> float:
        return sum(s.wall_s for s in self.steps)

    @property
    def step_s(self) -> float:
        return self.wall_s / len(self.steps) if self.steps else float("nan")

    @property
    def output_tokens(self) -> int:
        return sum(s.output_tokens for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def prefix_hit(self) -> float | None:
        prompt = sum(s.prompt_tokens for s in self.steps)
        if not self.reports_cached or not prompt:
            return None
        return sum(s.cached_tokens for s in self.steps) / prompt

    @property
    def requests(self) -> int:
        return sum(s.requests for s in self.steps)

    def latency(self, q: float) -> float:
        lat = sorted(x for s in self.steps for x in s.latencies)
        if not lat:
            return float("nan")
        return lat[min(len(lat) - 1, max(0, math.ceil(q * len(lat)) - 1))]

    @property
    def cpu_us_per_request(self) -> float:
        n = self.requests
        return 1e6 * sum(s.cpu_s for s in self.steps) / n if n else float("nan")

    @property
    def busiest_share(self) -> float | None:
        counts: Counter[str] = Counter()
        for s in self.steps:
            counts.update(s.workers)
        total = sum(counts.values())
        return max(counts.values()) / total if total and len(counts) > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "workload": self.workload,
            "client": self.client,
            "stream_interval": self.stream_interval,
            "status": self.status,
            "flushed": self.flushed,
            "frontend_switch_s": round(self.switch_s, 2),
            "step_s": [round(s.wall_s, 4) for s in self.steps],
            "tokens_per_s": self.tokens_per_s if self.steps else None,
            "prefix_hit": self.prefix_hit,
            "p50_s": self.latency(0.5) if self.steps else None,
            "p99_s": self.latency(0.99) if self.steps else None,
            "requests": self.requests,
            "output_tokens": self.output_tokens,
            "client_cpu_us_per_request": self.cpu_us_per_request if self.steps else None,
            "workers": [dict(s.workers) for s in self.steps],
        }


class Budget:
    """The run's deadline, and a per-workload estimate of a step's length from what ran already."""

    def __init__(self, seconds: float, reserve_s: float) -> None:
        self.deadline = time.monotonic() + seconds - reserve_s
        self.step_s: dict[str, float] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def learn(self, workload: str, step_s: float) -> None:
        self.step_s[workload] = max(self.step_s.get(workload, 0.0), step_s)

    def fits(self, workload: str, steps: int, overhead_s: float = 5.0) -> bool:
        left = self.left()
        if left <= 0:
            return False
        known = self.step_s.get(workload)
        return known is None or steps * known * 1.15 + overhead_s <= left


async def _run_job(
    job: Job,
    fleet: Fleet,
    workload: Workload,
    steps: int,
    tag: str,
    budget: Budget,
    progress: report.Progress,
) -> list[JobResult]:
    """One job: its steps, each timed; a paired job interleaves adapter and raw aiohttp."""
    t_switch = time.monotonic()
    clients = [await fleet.client(job.backend)]
    if job.paired:
        clients.append(await fleet.client(job.backend, raw=True))
    switch_s = time.monotonic() - t_switch
    names = ["adapter (paired)", "raw aiohttp (paired)"] if job.paired else ["adapter"]
    results = [
        JobResult(job.backend, job.workload, n, job.stream_interval, reports_cached=c.reports_cached, switch_s=switch_s)
        for n, c in zip(names, clients, strict=True)
    ]
    for k, c in enumerate(clients):
        await asyncio.wait_for(warm_up(c, workload, 4, f"{tag}{k}"), max(1.0, budget.left()))
    if not job.paired:
        results[0].flushed = await clients[0].flush()
    try:
        for step in range(steps):
            order = list(range(len(clients)))
            if step % 2 == 1:
                order.reverse()
            for k in order:
                if job.paired:  # every paired step starts cold: the two clients see the same cache
                    results[k].flushed = await clients[0].flush()
                timeout = budget.left()
                if timeout <= 0:
                    raise asyncio.TimeoutError
                stat = await asyncio.wait_for(run_step(clients[k], workload, step, f"{tag}{k}"), timeout)
                results[k].steps.append(stat)
                budget.learn(job.workload, stat.wall_s)
                hit = results[k].prefix_hit
                progress(
                    f"{job.label} [{results[k].client}] {job.workload} step {step + 1}/{steps}: "
                    f"{stat.wall_s:.2f} s, {stat.output_tokens / stat.wall_s:,.0f} tok/s, "
                    f"prefix hit {'-' if hit is None else f'{hit:.1%}'}, "
                    f"p50 {statistics.median(stat.latencies):.2f} s, {stat.requests} requests"
                )
    except asyncio.TimeoutError:
        for r in results:
            r.status = "cut (budget)"
        await clients[0].abort_all()
        progress(f"{job.label} {job.workload}: cut by the time budget")
    return results


def plan(
    workloads: Sequence[str],
    backends: Sequence[str],
    stream_intervals: Sequence[int | None],
    direct_steps: int,
) -> list[Job]:
    """Jobs in priority order (a tight budget drops the tail), per workload (gsm8k first): the SGLang
    rows, then the Dynamo rows at each stream interval, a set one (Miles #1648's 50, the
    configuration of its headline numbers) before the default; adapter vs direct right after the
    first gsm8k Dynamo rows. SGLang rows have one stream interval: a non-streamed ``/generate``
    ignores ``--stream-interval``."""
    dynamo_sis = sorted(stream_intervals, key=lambda si: si is None)
    jobs: list[Job] = []
    for wl in workloads:
        jobs += [Job(b, "sglang", wl) for b in backends if not b.startswith("dynamo")]
        for i, si in enumerate(dynamo_sis):
            fleet = "dynamo" if si is None else f"dynamo-si{si}"
            jobs += [Job(b, fleet, wl, si) for b in backends if b.startswith("dynamo")]
            if i == 0 and wl == "gsm8k" and direct_steps > 0 and BASELINE in backends:
                jobs.append(Job(BASELINE, "sglang", wl, paired=True))
    return jobs


async def run(
    settings: Settings,
    workloads: dict[str, Workload],
    jobs: Sequence[Job],
    steps: dict[str, int],
    direct_steps: int,
    budget: Budget,
    progress: report.Progress,
) -> tuple[list[JobResult], dict[str, str]]:
    """Start the fleets the jobs need (all at once), run the jobs in order, stop every fleet."""
    fleets: dict[str, Fleet] = {}
    for job in jobs:
        if job.fleet not in fleets:
            fleets[job.fleet] = (
                SGLangSide(settings) if job.fleet == "sglang" else DynamoSide(settings, job.stream_interval)
            )
    errors: dict[str, str] = {}
    results: list[JobResult] = []
    started: dict[str, float] = {}

    async def start(f: Fleet) -> None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(f.start(progress), max(1.0, budget.left()))
            started[f.key] = time.monotonic() - t0
            progress(f"{f.key} fleet ready in {started[f.key]:.1f} s")
        except BaseException as exc:
            errors[f.key] = report.summarise_error(exc)
            progress(f"{f.key} fleet failed to start: {errors[f.key]}")
            if not isinstance(exc, Exception | asyncio.TimeoutError):
                raise

    try:
        progress(f"starting {len(fleets)} fleet(s) at once: {', '.join(fleets)}")
        await asyncio.gather(*(start(f) for f in fleets.values()))
        first = workloads[jobs[0].workload] if jobs else None
        for f in fleets.values():
            if f.key in errors or first is None:
                continue
            backend = next(j.backend for j in jobs if j.fleet == f.key)
            try:  # a burst through each fleet: kernels and pools are ready before anything is timed
                await asyncio.wait_for(
                    warm_up(await f.client(backend), first, 16, f"w{f.key}"), max(1.0, budget.left())
                )
            except Exception as exc:
                errors[f.key] = f"warm-up failed: {report.summarise_error(exc)}"
                progress(f"{f.key} fleet: {errors[f.key]}")
        for n, job in enumerate(jobs):
            fleet = fleets[job.fleet]
            n_steps = direct_steps if job.paired else steps[job.workload]
            names = ["adapter (paired)", "raw aiohttp (paired)"] if job.paired else ["adapter"]

            def skipped(status: str, job: Job = job, names: list[str] = names) -> list[JobResult]:
                return [JobResult(job.backend, job.workload, c, job.stream_interval, status=status) for c in names]

            if job.fleet in errors:
                results += skipped(f"failed: fleet did not start ({errors[job.fleet]})")
                continue
            why = fleet.supports(job.backend) if isinstance(fleet, DynamoSide) else None
            if why:
                results += skipped(f"n/a: {why}")
                continue
            if not budget.fits(job.workload, n_steps * len(names)):
                results += skipped("skipped: time budget")
                progress(f"{job.label} {job.workload}: skipped (time budget, {budget.left():.0f} s left)")
                continue
            try:
                results += await _run_job(job, fleet, workloads[job.workload], n_steps, f"j{n}", budget, progress)
            except Exception as exc:  # one broken backend must not lose the others' rows
                msg = report.summarise_error(exc)
                progress(f"{job.label} {job.workload}: failed: {msg}")
                results += skipped(f"failed: {msg}")
    finally:
        progress("stopping the fleets")
        await asyncio.gather(*(f.aclose() for f in fleets.values()), return_exceptions=True)
    for key, secs in started.items():
        errors.setdefault(f"{key} start-up", f"{secs:.1f} s")
    return results, errors


# -- reporting -------------------------------------------------------------------------------------


def _fmt(x: float | None, spec: str, none: str = "—") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def tables(results: Sequence[JobResult]) -> dict[str, str]:
    """One Markdown table per workload (ratios against ``sglang rr`` on it) and the adapter-vs-direct table."""
    out: dict[str, str] = {}
    for wl in WORKLOADS:
        rows_r = [r for r in results if r.workload == wl and r.client == "adapter"]
        if not rows_r:
            continue
        base = next((r for r in rows_r if r.backend == BASELINE and r.stream_interval is None and r.steps), None)
        rows = []
        for r in rows_r:
            if not r.steps:
                rows.append([r.label, "0", "—", "—", "—", "—", "—", "—", "—", "—", r.status])
                continue
            vs = f"{r.step_s / base.step_s:.2f}{TIMES}" if base else "—"
            tvs = f"{r.tokens_per_s / base.tokens_per_s:.2f}{TIMES}" if base else "—"
            note = [] if r.status == "ok" else [r.status]
            if not r.flushed:
                note.append("cache not flushed first")
            rows.append(
                [
                    r.label,
                    str(len(r.steps)),
                    f"{r.step_s:.2f}",
                    f"{r.tokens_per_s:,.0f}",
                    _fmt(r.prefix_hit, ".1%"),
                    f"{r.latency(0.5):.2f}",
                    f"{r.latency(0.99):.2f}",
                    _fmt(r.busiest_share, ".0%"),
                    vs,
                    tvs,
                    "; ".join(note),
                ]
            )
        out[wl] = report.md_table(
            [
                "backend",
                "steps",
                "wall s/step",
                "output tok/s",
                "prefix hit",
                "p50 latency s",
                "p99 latency s",
                "busiest worker",
                "step time vs baseline",
                "tok/s vs baseline",
                "note",
            ],
            rows,
            "lrrrrrrrrrl",
        )
    paired = [r for r in results if r.client.endswith("(paired)")]
    if paired:
        direct = next((r for r in paired if r.client.startswith("raw") and r.steps), None)
        rows = []
        for r in paired:
            if not r.steps:
                rows.append([r.client, "0", "—", "—", "—", "—", "—", "—", r.status])
                continue
            ratio = f"{r.wall_s / direct.wall_s:.3f}{TIMES}" if direct and len(direct.steps) == len(r.steps) else "—"
            rows.append(
                [
                    r.client,
                    str(len(r.steps)),
                    f"{r.step_s:.2f}",
                    f"{r.tokens_per_s:,.0f}",
                    f"{r.latency(0.5):.2f}",
                    f"{r.latency(0.99):.2f}",
                    f"{r.cpu_us_per_request:,.0f}",
                    ratio,
                    "" if r.status == "ok" else r.status,
                ]
            )
        out["direct"] = report.md_table(
            [
                "client (sglang rr fleet)",
                "steps",
                "wall s/step",
                "output tok/s",
                "p50 latency s",
                "p99 latency s",
                "client CPU µs/request",
                "wall vs raw aiohttp",
                "note",
            ],
            rows,
            "lrrrrrrrl",
        )
    return out


def direct_target(results: Sequence[JobResult]) -> tuple[bool, str] | None:
    ours = next((r for r in results if r.client == "adapter (paired)" and r.steps), None)
    raw = next((r for r in results if r.client == "raw aiohttp (paired)" and r.steps), None)
    if ours is None or raw is None or len(ours.steps) != len(raw.steps):
        return None
    ratio = ours.wall_s / raw.wall_s
    return ratio <= TARGET_DIRECT_RATIO, f"{ratio:.3f}{TIMES} ({ours.wall_s:.2f} s vs {raw.wall_s:.2f} s)"


def plot(results: Sequence[JobResult], path: str, title: str) -> bool:
    """Write the PNG; False (and no file) when nothing ran."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    shown = [r for r in results if r.client == "adapter" and r.steps]
    wls = [w for w in WORKLOADS if any(r.workload == w for r in shown)]
    if not wls:
        return False
    fig, axes = plt.subplots(len(wls), 3, figsize=(15, 3.2 + 2.2 * len(wls)), squeeze=False)
    for row, wl in enumerate(wls):
        rs = [r for r in shown if r.workload == wl]
        labels = [r.label.replace(", stream interval ", "\nsi ") for r in rs]
        xs = list(range(len(rs)))
        panels: list[tuple[str, list[float]]] = [
            (f"{wl}: wall-clock s per step (lower is better)", [r.step_s for r in rs]),
            (f"{wl}: prefix hit rate, cached / prompt tokens", [r.prefix_hit or 0.0 for r in rs]),
        ]
        for col, (name, ys) in enumerate(panels):
            ax = axes[row][col]
            ax.bar(xs, ys, color=["#777777" if r.backend == BASELINE else "#3b75af" for r in rs])
            ax.set_title(name, fontsize=9)
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
        ax = axes[row][2]
        ax.bar([x - 0.2 for x in xs], [r.latency(0.5) for r in rs], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [r.latency(0.99) for r in rs], 0.4, label="p99")
        ax.set_title(f"{wl}: request latency s", fontsize=9)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def markdown(
    meta: dict[str, Any], settings: dict[str, Any], results: Sequence[JobResult], notes: dict[str, str], png: str | None
) -> str:
    lines = ["## RL fan-out routing", ""]
    lines += report.meta_lines(meta)
    lines += [
        f"- **Workers:** {settings['workers']} x {settings['engine']} ({settings['model']}), GPUs {settings['gpus']}; "
        f"SGLang/Dynamo-worker flags {settings['worker_flags']}",
        f"- **Workloads:** {'; '.join(f'{k}: {v}' for k, v in settings['workloads'].items())}",
        "- **Fleets:** "
        + "; ".join(f"{k}: {v}" for k, v in notes.items())
        + ". All fleets start together and stay up; one job at a time; each job starts after a "
        "`flush_cache` (Dynamo: after the frontend restarts in the job's router mode).",
        "- SGLang rows have no stream-interval variant: SGLang sends a non-streamed `/generate` answer "
        "only when it finishes (and every `SGLANG_FORCE_STREAM_INTERVAL`=50 tokens internally), "
        "whatever `--stream-interval` says.",
        "",
    ]
    t = tables(results)
    for wl in WORKLOADS:
        if wl in t:
            lines += [f"### {wl}", "", t[wl], ""]
    if "direct" in t:
        lines += [
            "### Adapter vs direct engine calls (same fleet, same bodies, steps interleaved)",
            "",
            t["direct"],
            "",
        ]
        target = direct_target(results)
        if target is not None:
            met, detail = target
            lines += [
                f"- {'MET' if met else 'NOT MET'}: adapter ≤ {TARGET_DIRECT_RATIO:.2f}{TIMES} raw aiohttp "
                f"wall-clock: {detail}",
                "",
            ]
    lines += [
        "*wall s/step*: the step's wall-clock (every group sent at once, until the last sample ends); "
        "*output tok/s*: output tokens / wall; *prefix hit*: cached / prompt tokens as the workers report "
        "them (— where they do not); latencies are per request, as the client saw them; *busiest worker*: "
        "its share of the requests; ratios are against `sglang rr` on the same workload.",
        "",
    ]
    if png:
        lines += [f"![fan-out routing]({png})", ""]
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------------------


def _vocab_size(model_path: str) -> int:
    import json

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    return int(cfg["vocab_size"])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="rollout-backends bench fanout",
        description="RL fan-out routing: GRPO-shaped rollouts through smg and Dynamo routers on the same workers.",
    )
    p.add_argument("--engine", choices=ENGINES, default="reference", help="worker kind (sglang = real, on GPUs)")
    p.add_argument("--model-size", default=None, help="qwen2.5-0.5b (GPU default) or tiny (CPU default)")
    p.add_argument("--model-path", help="an existing model folder (default: make one with make_tiny_model)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--gpus", default="0,1", help="CUDA_VISIBLE_DEVICES of each worker, comma-separated")
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), metavar="BACKEND")
    p.add_argument("--stream-interval", type=int, default=None, help="the Dynamo variant (GPU default 50; 0: none)")
    p.add_argument(
        "--no-default-interval",
        action="store_true",
        help="Dynamo rows at --stream-interval only (no fleet at SGLang's default interval)",
    )
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--length-median", type=float, default=250.0)
    p.add_argument("--length-sigma", type=float, default=0.6)
    p.add_argument("--agentic-prompts", type=int, default=8)
    p.add_argument("--agentic-samples", type=int, default=8)
    p.add_argument("--agentic-steps", type=int, default=1)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--turn-median", type=float, default=100.0)
    p.add_argument("--turn-max-new-tokens", type=int, default=256)
    p.add_argument("--direct-steps", type=int, default=2, help="interleaved steps per client (0: no comparison)")
    p.add_argument("--predicted-ttl-s", type=float, default=5.0, help="--router-predicted-ttl-secs of kv+predict")
    p.add_argument("--kv-tokens", type=int, default=300_000, help="--max-total-tokens of each SGLang worker")
    p.add_argument("--mocker-speedup", type=float, default=10.0)
    p.add_argument("--startup-timeout-s", type=float, default=None)
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run, fleets' start-up included")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="output folder (benchmarks.md, results.json, fanout.png, fanout-logs.tar.gz)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, 2 prompts x 4 samples x 2 steps")
    args = p.parse_args(argv)
    gpu = args.engine == "sglang"
    if args.smoke:
        if gpu:
            p.error("--smoke is for --engine reference or mocker")
        args.prompts, args.samples, args.steps = 2, 4, 2
        args.max_new_tokens, args.length_median, args.turn_max_new_tokens, args.turn_median = 8, 5.0, 6, 4.0
        args.agentic_prompts, args.agentic_samples, args.agentic_steps, args.turns = 2, 2, 1, 2
        args.direct_steps = 1
        args.budget_s = min(args.budget_s, 90.0)
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

    with tempfile.TemporaryDirectory(prefix="rb-fanout-") as tmp:
        model_path = args.model_path
        if model_path is None:
            from rollout_backends.adapters.reference import make_tiny_model

            progress(f"making the {size} model")
            model_path = str(make_tiny_model(Path(tmp) / "model", seed=args.seed, size=size))
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        vocab = _vocab_size(model_path)
        workloads = {
            "gsm8k": make_workload(
                tokenizer,
                name="gsm8k",
                steps=args.steps,
                prompts=args.prompts,
                samples=args.samples,
                max_new_tokens=args.max_new_tokens,
                length_median=args.length_median,
                length_sigma=args.length_sigma,
                vocab_size=vocab,
                seed=args.seed,
                min_new_tokens=min(8, args.max_new_tokens),
            ),
            "agentic": make_workload(
                tokenizer,
                name="agentic",
                steps=args.agentic_steps,
                prompts=args.agentic_prompts,
                samples=args.agentic_samples,
                max_new_tokens=args.turn_max_new_tokens,
                length_median=args.turn_median,
                length_sigma=args.length_sigma,
                turns=args.turns,
                vocab_size=vocab,
                seed=args.seed,
                min_new_tokens=min(8, args.turn_max_new_tokens),
            ),
        }
        workloads = {k: v for k, v in workloads.items() if k in args.workloads}
        for w in workloads.values():
            progress(f"workload {w.name}: {w.describe()}")
        settings = Settings(
            engine=args.engine,
            model_path=model_path,
            workers=args.workers,
            gpus=gpus,
            kv_tokens=args.kv_tokens,
            predicted_ttl_s=args.predicted_ttl_s,
            mocker_speedup=args.mocker_speedup,
            startup_timeout_s=args.startup_timeout_s or (600.0 if gpu else 120.0),
            log_root=Path(tmp) / "logs",
            vocab_size=vocab,
        )
        sis: list[int | None] = [None]
        if stream_interval and args.engine == "sglang":
            sis = [stream_interval] if args.no_default_interval else [None, stream_interval]
        jobs = plan(list(workloads), args.backends, sis, args.direct_steps)
        steps = {k: len(w.steps) for k, w in workloads.items()}
        results, notes = asyncio.run(run(settings, workloads, jobs, steps, args.direct_steps, budget, progress))

        m = report.meta("python -m rollout_backends._bench.fanout", argv, PACKAGES, started)
        m["duration_s"] = round(time.time() - started, 1)
        s_info = {
            "engine": args.engine,
            "model": f"{size} ({model_path})" if args.model_path else size,
            "workers": args.workers,
            "gpus": ",".join(gpus) if gpu else "none",
            "worker_flags": " ".join(_sglang_flags(settings)) if gpu else "(CPU workers)",
            "workloads": {k: w.describe() for k, w in workloads.items()},
            "planned_output_tokens": {k: w.planned_output_tokens() for k, w in workloads.items()},
            "predicted_ttl_s": args.predicted_ttl_s,
            "seed": args.seed,
        }
        t = tables(results)
        print(f"\nRL fan-out routing, {m['date']}, {m['machine']}, GPU: {m['gpu']}")
        for k, text in t.items():
            print(f"\n{k}\n{text}")
        target = direct_target(results)
        if target is not None:
            verdict = "MET" if target[0] else "NOT MET"
            print(f"\n- {verdict}: adapter ≤ {TARGET_DIRECT_RATIO}{TIMES} raw aiohttp wall-clock: {target[1]}")
        print(f"\n({m['duration_s']} s)")
        if args.out:
            title = f"{m['gpu'] if m['gpu'] != 'none' else m['machine']}; {m['date']}"
            report.write_outputs(
                args.out,
                KEY,
                plot=lambda path: plot(results, path, title),
                markdown=lambda png: markdown(m, s_info, results, notes, png),
                data={"meta": m, "settings": s_info, "notes": notes, "results": [r.as_dict() for r in results]},
                log_dirs=[settings.log_root],
            )
            out = Path(args.out)
            progress(f"wrote {', '.join(sorted(x.name for x in out.iterdir()))} in {out}")
    ok = any(r.steps for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
