"""GRPO through rollout-backends, in one file: sample groups from an engine fleet, score them,
take a policy-gradient step, push the new weights, and check every sample's weight version.

    rollout-backends make-model /tmp/m --size tiny            # a seeded Qwen2.5-shaped model
    python examples/grpo/grpo.py --backend reference:///tmp/m --model /tmp/m --steps 12

``--backend`` is the one line that picks the engines: ``sglang://host:port`` (a server or an smg
router), ``dynamo://host:port`` (a Dynamo frontend), ``reference:///path`` (the in-process CPU
engine). The policy is the same model in torch (transformers), on ``--device``.

The reward is the fraction of sampled tokens whose id is a multiple of 8 (``TARGET_EVERY``). It is
learnable from random weights in a few tens of steps: it depends only on which tokens come out, so
raising the target rows' logits in every context (the tied output embedding and the final norm do
most of it) raises it, and with temperature-1 sampling the fraction varies from sample to sample,
so group-normalised advantages carry signal from the first step. Nothing is downloaded.

Placements (``--placement``):

* ``colocated``: trainer and engines share the device. Each step: rollout, then (where the engines
  declare ``memory_release``) pause and release their memory, train, take the memory back, and push
  the weights from memory inside the weight-update transaction (CUDA IPC on GPU, shared memory on
  CPU; flat buckets where the engines declare ``flattened_buckets``).
* ``disk``: the trainer writes a safetensors checkpoint each step; the engines load it.
* ``distributed``: the trainer is rank 0 of a ``torch.distributed`` group the engines join (gloo
  with the CPU reference engine; NCCL with SGLang, trainer and engines on different GPUs).

The trainer's starting weights are pushed first, as ``initial``; then every sample must carry the
version pushed before its step (``initial``, ``step-1``, ...): a sample from any other version stops
the run (``StaleSample``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

import rollout_backends as rb

#: The reward's target tokens: every id that is a multiple of this (1/8 of the vocabulary).
TARGET_EVERY = 8
INITIAL = "initial"
PLACEMENTS = ("colocated", "disk", "distributed")


@dataclasses.dataclass
class Config:
    backend: str  # the one line: sglang://..., dynamo://..., reference:///path
    model: str  # the model folder the engines started on (the policy starts from it too)
    placement: str = "colocated"
    steps: int = 12
    prompts: int = 4  # groups per step
    group: int = 8  # samples per prompt
    prompt_len: int = 8
    max_new_tokens: int = 16
    temperature: float = 1.0
    lr: float = 3e-2  # the tiny model's (0.125 -> 0.99 reward in 11 steps on CPU); a 0.5B one wants ~1e-4
    clip: float = 0.2  # PPO/GRPO ratio clip
    seed: int = 0
    device: str = "cpu"
    bucket_mib: float = 512.0  # colocated: flat bucket size (Miles' default buffer)
    ckpt_dir: str | None = None  # disk: where checkpoints go (default: a temporary folder)
    master_port: int = 0  # distributed: the group's port (0: a free one)


class StaleSample(RuntimeError):
    """A sample came back from weights other than the ones its step pushed."""


def reward(output_ids: Sequence[int]) -> float:
    """The fraction of sampled tokens in the target set."""
    return sum(1 for t in output_ids if t % TARGET_EVERY == 0) / max(1, len(output_ids))


@dataclasses.dataclass
class Sample:
    group: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    rollout_logprobs: tuple[float, ...]
    reward: float
    version: str | None
    latency_s: float = 0.0  # request sent -> answer, on the client (Generation.latency_s)


@dataclasses.dataclass
class StepRecord:
    step: int
    version: str  # the weights this step sampled from
    rewards: list[float]  # per sample, in request order
    rollout_s: float
    train_s: float
    sync_s: float  # the weight push: transaction (pause, flush, load, label, resume) + memory back
    memory_s: float  # releasing engine memory before training (colocated, where declared)
    loss: float
    logprob_gap: float  # mean |trainer - engine| logprob of the sampled tokens, before the update

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.memory_s + self.train_s + self.sync_s


# -- the policy: the engines' model in torch -------------------------------------------------------


class Policy:
    def __init__(self, model_path: str, device: str, lr: float) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.path = Path(model_path)
        self.device = torch.device(device)
        #: the dtype the engines hold, as the checkpoint's config says (bf16 for make-model's
        #: models): what gets pushed. Read before loading: the loaded config says float32.
        dtype = AutoConfig.from_pretrained(model_path).dtype or torch.bfloat16
        self.engine_dtype: torch.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)  # fp32 master weights
        self.model: Any = model.to(self.device).train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters under the checkpoint's names (tied weights once, as in the checkpoint)."""
        return [(n, p) for n, p in self.model.named_parameters()]

    def token_logprobs(self, samples: Sequence[Sample], micro: int = 16) -> list[torch.Tensor]:
        """Log-probabilities of each sample's sampled tokens under the current weights (with grad)."""
        out: list[torch.Tensor] = []
        for i in range(0, len(samples), micro):
            chunk = samples[i : i + micro]
            ids = torch.tensor([s.prompt + s.output for s in chunk], device=self.device)  # one length
            p = len(chunk[0].prompt)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
                logits = self.model(input_ids=ids).logits[:, p - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, p:, None]).squeeze(-1)
            out.extend(lp.unbind(0))
        return out

    def train_step(self, samples: Sequence[Sample], advantages: Sequence[float], clip: float) -> tuple[float, float]:
        """One GRPO step: clipped importance-weighted advantages, the ratio against the rollout's
        own logprobs (on-policy: about 1, up to engine/trainer numerics), token mean per sample,
        mean over samples, no KL term. Returns (loss, mean |trainer - engine| logprob)."""
        self.opt.zero_grad(set_to_none=True)
        new = self.token_logprobs(samples)
        losses, gaps = [], []
        for s, a, lp in zip(samples, advantages, new, strict=True):
            old = torch.tensor(s.rollout_logprobs, device=self.device)
            ratio = torch.exp(lp - old)
            surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip, 1 + clip) * a)
            losses.append(-surrogate.mean())
            gaps.append((lp.detach() - old).abs().mean())
        loss = torch.stack(losses).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        return float(loss.detach()), float(torch.stack(gaps).mean())

    def save(self, folder: Path) -> None:
        """A model folder the engines load: the starting folder's config and tokenizer files, and
        the weights as safetensors in the engines' dtype."""
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        for f in self.path.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy(f, folder / f.name)
        tensors = {n: t.detach().to(self.engine_dtype).contiguous().cpu() for n, t in self.named_weights()}
        save_file(tensors, str(folder / "model.safetensors.tmp"))
        (folder / "model.safetensors.tmp").replace(folder / "model.safetensors")


def advantages(samples: Sequence[Sample]) -> list[float]:
    """Each reward against its group's: (r - mean) / (std + eps); 0 where a group is all equal."""
    by_group: dict[int, list[float]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s.reward)
    stats = {g: (sum(r) / len(r), _std(r)) for g, r in by_group.items()}
    return [(s.reward - stats[s.group][0]) / (stats[s.group][1] + 1e-6) for s in samples]


def _std(xs: Sequence[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


# -- weight pushes: one per placement ----------------------------------------------------------------


class Colocated:
    """Weights from memory, in flat buckets reused every step (``rb.TensorBuckets``)."""

    def __init__(self, policy: Policy, bucket_mib: float) -> None:
        self.policy = policy
        self.buckets = rb.TensorBuckets(int(bucket_mib * 2**20), dtype=policy.engine_dtype)
        if policy.device.type == "cuda":
            # CUDA-IPC handles name their GPU by index, which the engines (seeing only their own
            # GPUs) may number differently; SGLang's patch names it by UUID, which its engines map
            # back (they apply the same patch before loading). SGLang's own trainer helper does this.
            with contextlib.suppress(ImportError):
                from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

                monkey_patch_torch_reductions()

    async def push(self, tx: rb.WeightUpdateTransaction) -> None:
        await tx.update_from_tensors(self.policy.named_weights(), buckets=self.buckets)

    async def close(self) -> None:
        self.buckets.release()


class Disk:
    """A checkpoint per step in ``folder`` (the one before it is removed once the next loads)."""

    def __init__(self, policy: Policy, folder: str | None) -> None:
        self.policy = policy
        self._tmp = None if folder else tempfile.TemporaryDirectory(prefix="grpo-ckpt-")
        self.folder = Path(folder or self._tmp.name)  # type: ignore[union-attr]
        self.last: Path | None = None
        self.n = 0

    async def push(self, tx: rb.WeightUpdateTransaction) -> None:
        self.n += 1
        path = self.folder / f"ckpt-{self.n}"
        await asyncio.to_thread(self.policy.save, path)
        await tx.update_from_disk(str(path))
        if self.last is not None:
            shutil.rmtree(self.last, ignore_errors=True)
        self.last = path

    async def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()


class Distributed:
    """Rank 0 of a ``torch.distributed`` group the engines join; a broadcast per push."""

    def __init__(self, policy: Policy, backend: rb.RolloutBackend, port: int) -> None:
        self.policy, self.backend = policy, backend
        self.port = port or _free_port()
        self.gpu = policy.device.type == "cuda"
        self.group = rb.WeightGroup(
            master_address="127.0.0.1",
            master_port=self.port,
            world_size=1 + len(backend.workers),
            group_name="grpo",
            backend="nccl" if self.gpu else "gloo",
        )
        self.sender: Any = None

    async def open(self) -> None:
        if self.gpu:
            self.sender = NcclSender(self.group)
        else:  # the CPU reference engine's gloo group
            from rollout_backends.adapters.reference import WeightSender

            self.sender = WeightSender("127.0.0.1", self.port, self.group.world_size, self.group.group_name)
        await asyncio.gather(asyncio.to_thread(self.sender.connect), self.backend.init_weight_group(self.group))

    async def push(self, tx: rb.WeightUpdateTransaction) -> None:
        named = [(n, t.detach().to(self.policy.engine_dtype)) for n, t in self.policy.named_weights()]
        bucket = rb.WeightBucket.from_named_tensors(named)
        await asyncio.gather(
            asyncio.to_thread(self.sender.broadcast, named), tx.update_from_distributed(bucket, group_name="grpo")
        )

    async def close(self) -> None:
        if self.sender is not None:
            with contextlib.suppress(rb.RolloutBackendError):
                await self.backend.destroy_weight_group("grpo")
            self.sender.close()


class NcclSender:
    """The trainer's end of SGLang's ``init_weights_update_group`` on GPU: a ``tcp://`` rendezvous
    with rank 0 hosting the store, the store prefixed with the group name, no default process group
    (as SGLang's ``init_custom_process_group``). Needs its own GPU: NCCL refuses two ranks on one."""

    def __init__(self, group: rb.WeightGroup) -> None:
        self.group = group
        self.pg: Any = None

    def connect(self) -> None:
        import datetime

        import torch.distributed.distributed_c10d as c10d

        c: Any = c10d  # private helpers, untyped
        g, timeout = self.group, datetime.timedelta(seconds=300)
        store, rank, world = next(c.rendezvous(f"tcp://{g.master_address}:{g.master_port}", 0, g.world_size))
        store.set_timeout(timeout)
        store = c.PrefixStore(g.group_name, store)
        self.pg, _ = c._new_process_group_helper(
            world, rank, [], c.Backend("nccl"), store, group_name=g.group_name, backend_options=None, timeout=timeout
        )
        c._world.pg_group_ranks[self.pg] = {i: i for i in range(world)}

    def broadcast(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        works = [torch.distributed.broadcast(t, src=0, group=self.pg, async_op=True) for _, t in named]
        for w in works:
            w.wait()
        torch.cuda.synchronize()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            torch.distributed.destroy_process_group(self.pg)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- the loop -------------------------------------------------------------------------------------------


class GRPO:
    """The loop over one backend; ``step()`` runs one GRPO step (the benchmark interleaves them)."""

    def __init__(self, backend: rb.RolloutBackend, cfg: Config, policy: Policy | None = None) -> None:
        if cfg.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {cfg.placement!r}")
        self.backend, self.cfg = backend, cfg
        self.policy = policy or Policy(cfg.model, cfg.device, cfg.lr)
        self.sync: Colocated | Disk | Distributed
        if cfg.placement == "colocated":
            self.sync = Colocated(self.policy, cfg.bucket_mib)
        elif cfg.placement == "disk":
            self.sync = Disk(self.policy, cfg.ckpt_dir)
        else:
            self.sync = Distributed(self.policy, backend, cfg.master_port)
        self.version = INITIAL
        self.k = 0
        self.samples: list[Sample] = []  # the last step's

    async def setup(self) -> None:
        """Join the group, then push the policy's starting weights as ``initial``: from here on the
        engines serve exactly the trainer's weights, and every sample of step 0 carries ``initial``."""
        if isinstance(self.sync, Distributed):
            await self.sync.open()
        await self.push(INITIAL)

    def prompts(self) -> list[tuple[int, ...]]:
        """This step's prompts: the same for every backend given the seed."""
        rng = random.Random(self.cfg.seed * 100_003 + self.k)
        vocab = self.policy.model.config.vocab_size
        return [tuple(rng.randrange(3, vocab) for _ in range(self.cfg.prompt_len)) for _ in range(self.cfg.prompts)]

    async def rollout(self) -> list[Sample]:
        """Every group at once through ``rb.as_completed``; rewards scored as samples arrive."""
        sampling = rb.SamplingParams(
            max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature, ignore_eos=True
        )
        requests: list[rb.GenerateRequest] = []
        group_of: dict[str, int] = {}
        for g, prompt in enumerate(self.prompts()):
            seed = (self.cfg.seed * 1_000_003 + self.k * 1009 + g) * 64  # distinct per sample, step, prompt
            group = rb.group_requests(prompt, self.cfg.group, sampling, base_seed=seed, group_id=f"s{self.k}-g{g}")
            group_of.update((r.request_id, g) for r in group)
            requests += group
        done: dict[str, rb.Generation] = {}
        async with rb.as_completed(self.backend, requests) as results:
            async for gen in results:
                if gen.weight_version != self.version:
                    msg = f"{gen.request_id}: served by {gen.weight_version!r}, step {self.k} pushed {self.version!r}"
                    raise StaleSample(msg)
                done[gen.request_id] = gen
        return [
            Sample(
                group_of[r.request_id],
                r.input_ids,
                done[r.request_id].output_ids,
                done[r.request_id].logprobs or (),
                reward(done[r.request_id].output_ids),
                done[r.request_id].weight_version,
                done[r.request_id].latency_s,
            )
            for r in requests
        ]

    async def push(self, version: str) -> None:
        """The weights, through the transaction: pause, flush, load, label ``version``, resume."""
        async with self.backend.weight_update(version) as tx:
            await self.sync.push(tx)

    async def step(self) -> StepRecord:
        t0 = time.perf_counter()
        samples = self.samples = await self.rollout()
        t1 = time.perf_counter()
        release = isinstance(self.sync, Colocated) and self.backend.capabilities.memory_release
        if release:  # colocated: give the engines' memory to the trainer while it trains
            await self.backend.pause()
            await self.backend.release_memory()
        t2 = time.perf_counter()
        loss, gap = await asyncio.to_thread(self.policy.train_step, samples, advantages(samples), self.cfg.clip)
        if self.policy.device.type == "cuda":
            torch.cuda.synchronize(self.policy.device)
        t3 = time.perf_counter()
        if release:
            await self.backend.resume_memory()  # weights back (to be overwritten), KV cache back
        version = f"step-{self.k + 1}"
        await self.push(version)
        t4 = time.perf_counter()
        record = StepRecord(
            self.k, self.version, [s.reward for s in samples], t1 - t0, t3 - t2, t4 - t3, t2 - t1, loss, gap
        )
        self.version, self.k = version, self.k + 1
        return record

    async def close(self) -> None:
        await self.sync.close()


@contextlib.asynccontextmanager
async def opened(cfg: Config) -> AsyncIterator[GRPO]:
    """The backend from its URL, the loop over it, both closed on the way out."""
    backend = await rb.open_backend(cfg.backend)
    try:
        await backend.wait_ready(120)
        loop = GRPO(backend, cfg)
        await loop.setup()
        try:
            yield loop
        finally:
            await loop.close()
    finally:
        await backend.aclose()


async def run(cfg: Config) -> list[StepRecord]:
    torch.manual_seed(cfg.seed)
    records: list[StepRecord] = []
    async with opened(cfg) as loop:
        for _ in range(cfg.steps):
            r = await loop.step()
            records.append(r)
            print(
                f"step {r.step:3d}  reward {r.mean_reward:.3f}  loss {r.loss:+.4f}  gap {r.logprob_gap:.4f}  "
                f"rollout {r.rollout_s:.2f}s  train {r.train_s:.2f}s  sync {r.sync_s:.3f}s  ({r.version})",
                flush=True,
            )
    return records


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.default is dataclasses.MISSING:
            p.add_argument(flag, required=True)
        else:
            kind = {int: int, float: float}.get(type(f.default), str)
            p.add_argument(flag, type=kind, default=f.default, choices=PLACEMENTS if f.name == "placement" else None)
    cfg = Config(**vars(p.parse_args(argv)))
    records = asyncio.run(run(cfg))
    first, last = records[0].mean_reward, records[-1].mean_reward
    print(f"reward {first:.3f} -> {last:.3f} over {len(records)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
