"""The benchmarks run end to end (tiny counts); no timing is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rb_bench import fanout, overhead, report, weightsync, with_bench_path
from rollout_backends.adapters.reference import cached_tiny_model

RAW = ("raw aiohttp", "raw httpx", "miles httpx")


@pytest.mark.parametrize("server", overhead.SERVERS)
def test_smoke_produces_a_table_with_every_client(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if server not in overhead.available_servers():
        pytest.skip(f"{server} needs ai-dynamo")
    out = tmp_path / "cells.json"
    assert overhead.main(["--smoke", "--servers", server, "--json", str(out), "--log-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith(f"| {server} |")]
    for client in (*RAW, "ours", "ours: HttpClient"):
        for conc in (1, 8):
            assert any(f"| {conc} | {client} " in r or f"| {conc} | {client} (" in r for r in rows), (client, printed)
    assert "baseline: raw aiohttp" in printed
    data = json.loads(out.read_text())
    cells = data["cells"]
    assert {c["server"] for c in cells} == {server}
    assert {c["client"] for c in cells} == set(overhead.CLIENTS)
    # errors counts answers without the 8 output tokens: every client's body worked on this server.
    assert all(c["requests"] > 0 and c["errors"] == 0 for c in cells)
    assert all(c["cpu_us"] > 0 and c["server_cpu_us"] >= 0 for c in cells)
    assert data["meta"]["versions"]["aiohttp"] and server in data["meta"]["servers"]
    # Ours against raw aiohttp on the same server: a ratio exists at every concurrency and is not
    # absurd (a smoke run is far too short to judge the 1.05x target; this catches e.g. a client
    # that measured nothing, or one that pays a second request per call).
    ratios = overhead.ratios([overhead.Cell(**{k: c[k] for k in _CELL_FIELDS}) for c in cells])
    assert set(ratios) == {(server, 1), (server, 8)}
    assert all(0.2 < r < 3.0 for r in ratios.values()), ratios


_CELL_FIELDS = ("client", "concurrency", "requests", "wall_s", "cpu_s", "server_cpu_s", "errors", "capped", "server")


async def test_every_raw_client_posts_what_our_wire_builds(tmp_path: Path) -> None:
    """The identical request: the target's URL and body are our adapter's, as plain JSON."""
    from rollout_backends import GenerateRequest

    async with overhead.reference_server(log_dir=tmp_path) as target:
        backend = await target.connect()
        try:
            req = GenerateRequest(input_ids=target.prompt, sampling=target.sampling, request_id="0" * 32)
            ours = backend.wire.generate(req, None)
        finally:
            await backend.aclose()
        assert target.url == ours.url and target.url.endswith("/generate")
        assert target.payload == json.loads(json.dumps(ours.json))
        assert isinstance(target.payload["input_ids"], list) and len(target.payload["input_ids"]) == 128


def _cell(server: str, client: str, conc: int, cpu_us: float, rps: float) -> overhead.Cell:
    return overhead.Cell(client, conc, 1000, 1000 / rps, cpu_us * 1000 / 1e6, 0.01, server=server)


def test_targets_judge_cpu_per_server_and_rps_on_loopback_only() -> None:
    cells = [
        _cell("loopback", "raw aiohttp", 64, 100, 9000),
        _cell("loopback", "ours", 64, 104, 9000),
        _cell("dynamo", "raw aiohttp", 64, 200, 800),
        _cell("dynamo", "ours", 64, 230, 800),
    ]
    X = overhead.TIMES
    got = {name: met for name, met, _ in overhead.targets(overhead.summarise(cells))}
    assert got[f"loopback: ours ≤ 1.05{X} raw aiohttp CPU/request at 64"] is True
    assert got[f"dynamo: ours ≤ 1.05{X} raw aiohttp CPU/request at 64"] is False
    assert got["loopback: ours ≥ 5,000 req/s at 64"] is True
    assert got["dynamo: ours ≥ 5,000 req/s at 64"] is None  # reported, not judged
    table = overhead.table(overhead.summarise(cells))
    assert f"| dynamo | 64 | ours | 1000 | 800 | 230 | 1.15{X} |" in table


# -- RL fan-out routing and weight sync (issue 7 parts 2-4) -------------------------------------


class _Tok:
    """A stand-in tokenizer: one id per byte, and a chat template that only concatenates."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _workload(**kw: object) -> fanout.Workload:
    args: dict[str, object] = dict(
        name="gsm8k", steps=2, prompts=3, samples=5, max_new_tokens=64, length_median=30.0, vocab_size=200, seed=0
    )
    args.update(kw)
    return fanout.make_workload(_Tok(), **args)  # type: ignore[arg-type]


def test_workload_is_fixed_by_its_seed_and_lengths_stay_in_range() -> None:
    a, b, c = _workload(), _workload(), _workload(seed=1)
    assert a == b
    assert a != c
    groups = [g for step in a.steps for g in step]
    assert len(a.steps) == 2 and len(groups) == 6 and all(g.samples == 5 for g in groups)
    lengths = [n for g in groups for n in g.lengths]
    assert all(8 <= n <= 64 for n in lengths) and len(set(lengths)) > 3  # drawn, not constant
    # Every prompt of a step shares the chat template and the system prompt (the prefix routers can use).
    assert len({g.prompt[:30] for g in groups}) == 1
    assert all(t < 200 for g in groups for t in g.prompt)
    assert a.planned_output_tokens() == sum(lengths)


def test_agentic_workload_plans_every_later_turn() -> None:
    w = _workload(name="agentic", turns=3, steps=1)
    for g in w.steps[0]:
        assert len(g.later_lengths) == g.samples and all(len(x) == 2 for x in g.later_lengths)
        assert len(g.user_turns) == g.samples and all(len(x) == 2 and all(x) for x in g.user_turns)
    assert w.planned_output_tokens() == sum(sum(g.lengths) + sum(map(sum, g.later_lengths)) for g in w.steps[0])


def test_weight_buckets_respect_the_limit_and_keep_the_order() -> None:
    import torch

    named = [(f"t{i}", torch.zeros(n, dtype=torch.bfloat16)) for i, n in enumerate([10, 30, 25, 100, 5, 5])]
    got = weightsync.buckets(named, limit_bytes=80)  # bf16: 2 bytes per element
    assert [[n for n, _ in b] for b in got] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert weightsync.nbytes(named) == 350


def test_markdown_section_is_replaced_in_place(tmp_path: Path) -> None:
    report.update_markdown(tmp_path, "fanout", "first")
    report.update_markdown(tmp_path, "weightsync", "ws")
    report.update_markdown(tmp_path, "fanout", "second")
    text = (tmp_path / "benchmarks.md").read_text()
    assert "first" not in text and text.index("second") < text.index("ws")
    assert text.count("<!-- begin fanout -->") == 1
    report.update_json(tmp_path, "a", {"x": 1})
    report.update_json(tmp_path, "b", 2)
    assert json.loads((tmp_path / "results.json").read_text()) == {"a": {"x": 1}, "b": 2}
    with pytest.raises(ValueError):
        report.check_name("a b.png")


def _smoke(tmp_path: Path, *extra: str) -> dict[str, Any]:
    # Its own process: tensor hand-over switches torch's sharing strategy for the whole process.
    model = ["--model-path", str(cached_tiny_model(0))]
    res = subprocess.run(
        [sys.executable, "-m", "rb_bench.weightsync", "--smoke", "--out", str(tmp_path), *model, *extra],
        capture_output=True,
        text=True,
        timeout=120,
        env=with_bench_path(os.environ),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    data: dict[str, Any] = json.loads((tmp_path / "results.json").read_text())["weightsync"]
    data["printed"] = res.stdout
    return data


def _measured(m: dict[str, Any]) -> None:
    assert m["status"] == "ok" and len(m["rounds_s"]) == 2 and all(x > 0 for x in m["rounds_s"]), m
    assert m["nbytes"] > 0 and m["buckets"] >= 1 and m["median_s"] > 0


ADAPTER_ROWS = ("gloo", "tensors", "tensors flat", "disk")


def test_weightsync_smoke_measures_every_cpu_transport_against_its_own_baseline(tmp_path: Path) -> None:
    data = _smoke(tmp_path)
    got = {m["transport"]: m for m in data["results"]}
    assert set(got) == {
        "raw broadcast", "gloo", "raw tensors", "tensors", "raw flat", "sglang api flat", "tensors flat",
        "tensors flat, one bucket", "raw disk", "disk",
    }  # fmt: skip
    for m in got.values():
        _measured(m)
    # Each adapter row names its own baseline; its ratio is its total over that baseline's, paired by block.
    assert {t: got[t]["baseline"] for t in ADAPTER_ROWS} == {t: weightsync.BASELINE[t] for t in ADAPTER_ROWS}
    assert got["tensors flat"]["baseline"] == "sglang api flat"
    for t in ADAPTER_ROWS:
        base = got[weightsync.BASELINE[t]]
        assert base["baseline"] is None and base["ratio"] is None
        assert got[t]["ratio"] == pytest.approx(sum(got[t]["rounds_s"]) / sum(base["rounds_s"]))
        assert got[t]["ratio_low"] <= got[t]["ratio"] <= got[t]["ratio_high"]
    # Same bytes in the same buckets (--smoke buckets at 1 MiB: several, so the per-bucket paths run).
    family = ("raw broadcast", "gloo", "raw tensors", "tensors", "raw flat", "sglang api flat", "tensors flat")
    assert len({got[t]["nbytes"] for t in family}) == 1 and len({got[t]["buckets"] for t in family}) == 1
    assert got["tensors"]["buckets"] >= 2
    one = got["tensors flat, one bucket"]
    assert one["buckets"] == 1 and one["nbytes"] == got["tensors flat"]["nbytes"] and one["baseline"] is None
    assert got["disk"]["nbytes"] == got["raw disk"]["nbytes"]
    goals = {g["goal"]: g["met"] for g in data["targets"]}
    assert set(goals) == {
        f"adapter {t} ≤ {weightsync.TARGET_RATIO[t]:g}{weightsync.TIMES} {weightsync.BASELINE[t]}" for t in ADAPTER_ROWS
    }  # the GB/s goal is the GPU's
    assert all(met in (True, False, None) for met in goals.values())
    notes = " ".join(data["notes"])
    assert "generated 4 tokens after the updates" in notes
    for op in ("tensors", "flat"):
        assert f"{op}: the bare receiver's copies of all" in notes
    assert "match what was sent" in notes and "check failed" not in notes
    assert "| adapter: tensors flat | TensorBuckets.pack" in data["printed"]
    assert "tensors flat / tensors (flat buckets vs per-tensor" in data["printed"]
    md = (tmp_path / "benchmarks.md").read_text()
    assert "## Weight sync" in md and "| baseline | vs baseline [95 % CI] |" in md
    assert {x.name for x in tmp_path.iterdir()} >= {"benchmarks.md", "results.json", "weightsync-logs.tar.gz"}


def test_weightsync_two_transport_smoke_reports_the_group_transport_as_not_run(tmp_path: Path) -> None:
    data = _smoke(tmp_path, "--transports", "tensors", "disk")
    got = {m["transport"]: m for m in data["results"]}
    for t in weightsync.FAMILIES["tensors"] + weightsync.FAMILIES["disk"]:
        _measured(got[t])
    for t in ("raw broadcast", "gloo"):  # in the table with the reason, not dropped
        assert got[t]["status"] == weightsync.NOT_SELECTED and not got[t]["rounds_s"], got[t]
    assert got["gloo"]["baseline"] == "raw broadcast" and got["gloo"]["ratio"] is None
    judged = {g["goal"].split(" ≤ ")[0].removeprefix("adapter "): g for g in data["targets"]}
    assert judged["gloo"]["met"] is None and judged["gloo"]["detail"].startswith("not judged")
    assert "| adapter: gloo |" in data["printed"] and "NOT DECIDED: adapter gloo" in data["printed"]


def _dry(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    capsys.readouterr()
    assert weightsync.main(["--engine", "sglang", "--dry-run", "--model-path", "/m", *args]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


def test_weightsync_one_gpu_plan_runs_tensors_and_disk_and_reports_nccl_as_not_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = _dry(capsys, "--gpus", "0")
    rows = {r["name"]: r for r in plan["rows"]}
    assert rows["nccl"]["status"] == rows["raw broadcast"]["status"] == "not run: needs a second GPU"
    assert rows["nccl"]["baseline"] == "raw broadcast"
    for t in ("tensors", "disk"):
        assert rows[t]["status"] == rows[f"raw {t}"]["status"] == "planned"
        assert rows[t]["baseline"] == f"raw {t}"
    assert [r["name"] for r in plan["rows"]][-2:] == ["raw broadcast", "nccl"]  # the group transport last
    assert plan["placement"] == {
        "engine_gpu": "0",
        "engine_device": "cuda:0",
        "sender_device": "cuda:0",
        "receiver_device": "cuda:0",
    }
    bare = plan["bare_receiver"]
    assert bare["command"][-2:] == ["--serve", "SPEC"] and bare["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert bare["spec"]["device"] == "cuda:0" and bare["spec"]["decoder"] == "sglang"
    assert bare["spec"]["model_path"] == "/m"
    assert "broadcast_receiver" not in plan
    assert "nccl not run (needs a second GPU)" in plan["setup"]


def test_weightsync_gpu_plans_place_every_process_by_index(capsys: pytest.CaptureFixture[str]) -> None:
    two = _dry(capsys, "--gpus", "2,5")
    assert all(r["status"] == "planned" for r in two["rows"])
    assert two["placement"] == {
        "engine_gpu": "2",
        "engine_device": "cuda:2",
        "sender_device": "cuda:5",
        "receiver_device": "cuda:0",  # the receivers see only the engine's GPU, as the engine does
    }
    assert two["broadcast_receiver"]["spec"]["backend"] == "nccl"
    assert two["broadcast_receiver"]["env"] == two["bare_receiver"]["env"] == {"CUDA_VISIBLE_DEVICES": "2"}
    only = _dry(capsys, "--gpus", "0,1", "--transports", "tensors", "disk")
    assert {r["name"]: r["status"] for r in only["rows"]}["nccl"] == weightsync.NOT_SELECTED
    one = _dry(capsys, "--gpus", "3")
    assert one["placement"]["sender_device"] == one["placement"]["engine_device"] == "cuda:3"
    assert one["bare_receiver"]["env"] == {"CUDA_VISIBLE_DEVICES": "3"}
    for bad in ("0,0", "0,1,2", "x"):
        with pytest.raises(SystemExit):
            weightsync.main(["--engine", "sglang", "--dry-run", "--gpus", bad])


X = weightsync.TIMES


def _m(name: str, median: float, **kw: Any) -> weightsync.Measurement:
    base = weightsync.BASELINE.get(name)
    return weightsync.Measurement(name, f"{name} path", 10**9, 2, (median, median), median, baseline=base, **kw)


def test_weightsync_table_judges_each_row_against_its_own_baseline() -> None:
    results = [
        _m("raw tensors", 1.0),
        _m("tensors", 2.0),
        _m("raw disk", 0.1),
        _m("disk", 0.5),
        weightsync.Measurement("raw broadcast", "", 0, 0, status=weightsync.NEEDS_SECOND_GPU),
        weightsync.Measurement("nccl", "", 0, 0, status=weightsync.NEEDS_SECOND_GPU, baseline="raw broadcast"),
    ]
    assert weightsync.ratio(results[1], results) == pytest.approx(2.0)
    assert weightsync.ratio(results[3], results) == pytest.approx(5.0)
    assert weightsync.ratio(results[0], results) is None and weightsync.ratio(results[5], results) is None
    got = {goal.split()[1]: (met, detail) for goal, met, detail in weightsync.targets(results)}
    assert got["tensors"][0] is True and got["tensors"][1].startswith(f"2.00{X}")
    assert got["disk"][0] is False and got["disk"][1].startswith(f"5.00{X}")  # the bound is 1.1
    assert got["nccl"] == (None, "not judged (not run: needs a second GPU)")
    assert "tensors flat" not in got  # not in the run: no goal (and the GB/s goal only on GPU)
    lines = {line.split(" | ")[0]: line for line in weightsync.table(results).splitlines()}
    assert f"| raw tensors | 2.00{X}" in lines["| adapter: tensors"]
    assert f"| raw disk | 5.00{X}" in lines["| adapter: disk"]
    assert "| raw broadcast | — | not run: needs a second GPU |" in lines["| adapter: nccl"]
    # The table lists each baseline right above the rows measured against it.
    order = [line.split(" | ")[0] for line in weightsync.table(results).splitlines()[2:]]
    assert order == [
        "| raw broadcast",
        "| adapter: nccl",
        "| raw tensors",
        "| adapter: tensors",
        "| raw disk",
        "| adapter: disk",
    ]


def test_weightsync_judges_the_flat_path_in_gb_per_s_on_gpu_only() -> None:
    def flat(times: tuple[float, ...]) -> list[weightsync.Measurement]:
        return [
            weightsync.Measurement("sglang api flat", "api", 10**9, 2, times, times[0]),
            weightsync.Measurement("tensors flat", "lib", 10**9, 2, times, times[0], baseline="sglang api flat"),
        ]

    def gb_goal(results: list[weightsync.Measurement]) -> tuple[bool | None, str]:
        return next((met, d) for g, met, d in weightsync.targets(results, gpu=True) if "GB/s" in g)

    fast = flat((0.008, 0.009, 0.0085, 0.0082))  # 1 GB in ~8.5 ms: ~118 GB/s
    met, detail = gb_goal(fast)
    assert met is True and detail.startswith("118.") and "GB/s" in detail
    assert gb_goal(flat((0.02, 0.021, 0.019, 0.02)))[0] is False  # ~50 GB/s
    assert gb_goal(flat((0.007, 0.013, 0.008, 0.0125)))[0] is None  # straddles 100 GB/s: not decided
    assert not any("GB/s" in g for g, _, _ in weightsync.targets(fast))  # CPU: no GB/s goal


def test_bare_receiver_copies_what_was_sent_and_loads_the_folder(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    import rollout_backends as rb
    from rollout_backends._tensors import serialize_flat_bucket, serialize_named_tensors

    sent = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.full((4,), 0.5)}
    save_file({k: torch.zeros_like(v) for k, v in sent.items()}, str(tmp_path / "model.safetensors"))
    rx = weightsync.BareReceiver(torch.device("cpu"), str(tmp_path), weightsync._decoder("ours"))
    assert set(rx.bufs) == {"a", "b"}
    for b in rx.bufs.values():
        b.fill_(7)  # not what is sent: the copy must overwrite it
    reply = rx.handle({"op": "tensors", "payload": serialize_named_tensors(list(sent.items()))})
    assert reply == {"ok": True, "tensors": 2, "bytes": 12 + 16}
    assert all(torch.equal(rx.bufs[k], v) for k, v in sent.items())
    sums = rx.handle({"op": "checksum"})["sums"]
    assert all(weightsync.checksums_match(weightsync.checksum(v), sums[k]) for k, v in sent.items())
    assert not weightsync.checksums_match(weightsync.checksum(sent["b"] * 2), sums["b"])
    with pytest.raises(ValueError, match="expected"):
        rx.handle({"op": "tensors", "payload": serialize_named_tensors([("a", torch.zeros(3))])})
    # a flat bucket: SGLang's payload (the CPU stand-in without SGLang) and ours
    for b in rx.bufs.values():
        b.fill_(7)
    payload, _alive = weightsync.sglang_flat_payload(list(sent.items()))  # the buffer, kept until loaded
    assert rx.handle({"op": "flat", "payload": payload}) == {"ok": True, "tensors": 2, "bytes": 28}
    assert all(torch.equal(rx.bufs[k], v) for k, v in sent.items())
    (bucket,) = rb.TensorBuckets().pack([(k, v * 3) for k, v in sent.items()])
    assert rx.handle({"op": "flat", "payload": serialize_flat_bucket(bucket)})["tensors"] == 2
    assert all(torch.equal(rx.bufs[k], v * 3) for k, v in sent.items())
    assert rx.handle({"op": "disk", "path": str(tmp_path)}) == {"ok": True, "tensors": 2, "bytes": 28}
