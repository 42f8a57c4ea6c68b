"""Launch commands and multi-node configuration, without starting anything."""

from __future__ import annotations

import json
import sys

import attrs
import pytest

from rollout_backends import InvalidRequest
from rollout_backends._launch import EngineCommand, EngineInfo, EntryCommand, NodeContext, pick_port
from rollout_backends.adapters.dynamo._commands import DynamoFrontend, DynamoWorkerCommand, generate_instances
from rollout_backends.adapters.dynamo._services import DynamoPlanes, _prefix_end, find_binary
from rollout_backends.adapters.reference import ReferenceServerCommand
from rollout_backends.adapters.sglang import SGLangServerCommand, SmgRouter

ETCD = DynamoPlanes(etcd_endpoints="http://10.0.0.2:2379,http://10.0.0.3:2379", event_plane="zmq")


def ctx(host: str = "127.0.0.1", gpus: tuple[str, ...] = ()) -> NodeContext:
    """A node binding ``host``; a non-loopback ``host`` is advertised while binding all interfaces."""
    bind = host if host == "127.0.0.1" else "0.0.0.0"
    return NodeContext(index=3, bind_host=bind, advertise_host=host, log_dir="/tmp/x", gpu_ids=gpus)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_commands_satisfy_the_protocols() -> None:
    for cmd in (
        ReferenceServerCommand(model_path="/m"),
        SGLangServerCommand(model_path="/m"),
        DynamoWorkerCommand(kind="mocker", model_path="/m", namespace="ns", planes=ETCD),
    ):
        assert isinstance(cmd, EngineCommand)
    assert isinstance(SmgRouter(), EntryCommand)
    assert isinstance(DynamoFrontend(namespace="ns", planes=ETCD), EntryCommand)


def test_reference_command() -> None:
    launch = ReferenceServerCommand(model_path="/m/tiny", weight_version="v3", make_model_seed=7).build(ctx())
    argv = launch.spec.argv
    port = int(flag(argv, "--port"))
    assert argv[:3] == (sys.executable, "-m", "rollout_backends.adapters.reference.serve")
    assert flag(argv, "--host") == "127.0.0.1" and flag(argv, "--make-model") == "7"
    assert flag(argv, "--weight-version") == "v3" and flag(argv, "--worker-id") == f"127.0.0.1:{port}"
    assert launch.generate_url == launch.control_url == f"http://127.0.0.1:{port}"
    assert launch.spec.ready is not None and launch.spec.ready.url == f"http://127.0.0.1:{port}/health"
    assert launch.spec.ports == (("127.0.0.1", port),) and launch.spec.name == "reference-3"


def test_sglang_command_uses_the_assigned_gpus() -> None:
    launch = SGLangServerCommand(model_path="/m", tp=2, extra_args=["--mem-fraction-static", "0.5"]).build(
        ctx("10.1.2.3", gpus=("4", "5"))
    )
    argv = launch.spec.argv
    assert flag(argv, "--tp-size") == "2" and flag(argv, "--base-gpu-id") == "0"
    assert argv[-2:] == ("--mem-fraction-static", "0.5")
    assert launch.spec.env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert launch.control_url.startswith("http://10.1.2.3:")


def test_smg_router_lists_every_engine() -> None:
    engines = [
        EngineInfo(
            index=i,
            name=f"e{i}",
            host="h",
            node_id=None,
            node_ip=None,
            pid=1,
            generate_url=f"http://h:{9000 + i}",
            control_url=f"http://h:{9000 + i}",
        )
        for i in range(2)
    ]
    argv = SmgRouter(policy="cache_aware").build(ctx(), engines).spec.argv
    i = argv.index("--worker-urls")
    assert argv[i + 1 : i + 3] == ("http://h:9000", "http://h:9001") and flag(argv, "--policy") == "cache_aware"
    assert engines[1].port == 9001 and engines[1].control_port == 9001


def test_dynamo_worker_command_etcd() -> None:
    planes = DynamoPlanes(etcd_endpoints=["http://e:2379"], nats_url="nats://n:4222", event_plane="nats", lease_ttl=4)
    cmd = DynamoWorkerCommand(kind="mocker", model_path="/m/tiny", namespace="ns1", planes=planes)
    launch = cmd.build(ctx())
    argv, env = launch.spec.argv, launch.spec.env
    assert flag(argv, "--discovery-backend") == "etcd" and flag(argv, "--event-plane") == "nats"
    assert flag(argv, "--endpoint") == "dyn://ns1.backend.generate" and flag(argv, "--model-name") == "tiny"
    assert env["ETCD_ENDPOINTS"] == "http://e:2379" and env["NATS_SERVER"] == "nats://n:4222"
    assert env["ETCD_LEASE_TTL"] == "4" and env["DYN_TCP_RESPONSE_STREAM_HOST"] == "lo"
    system, rpc = int(env["DYN_SYSTEM_PORT"] or 0), int(env["DYN_TCP_RPC_PORT"] or 0)
    assert system < 32768 and rpc < 32768 and launch.extra["rpc_port"] == rpc
    assert launch.generate_url is None and launch.control_url == f"http://127.0.0.1:{system}"

    gpu = DynamoWorkerCommand(kind="sglang", model_path="/m", namespace="ns1", planes=ETCD).build(
        ctx("10.0.0.9", ("1",))
    )
    assert json.loads(flag(gpu.spec.argv, "--kv-events-config"))["publisher"] == "zmq"
    assert gpu.spec.env["CUDA_VISIBLE_DEVICES"] == "1" and gpu.spec.env["DYN_TCP_RPC_HOST"] == "10.0.0.9"
    assert gpu.spec.env["DYN_SYSTEM_HOST"] == "0.0.0.0" and flag(gpu.spec.argv, "--host") == "0.0.0.0"
    assert "DYN_TCP_RESPONSE_STREAM_HOST" not in gpu.spec.env


def test_planes_validation() -> None:
    assert ETCD.etcd_endpoints == ("http://10.0.0.2:2379", "http://10.0.0.3:2379")
    with pytest.raises(InvalidRequest, match="etcd_endpoints"):
        DynamoPlanes(discovery="etcd")
    with pytest.raises(InvalidRequest, match="nats_url"):
        DynamoPlanes(etcd_endpoints=["http://e:1"], event_plane="nats")
    with pytest.raises(InvalidRequest, match="event_plane"):
        DynamoPlanes(etcd_endpoints=["http://e:1"], event_plane="kafka")
    with pytest.raises(InvalidRequest, match="kind"):
        DynamoWorkerCommand(kind="trtllm", model_path="/m", namespace="n", planes=ETCD)  # not a kind we launch


def test_generate_instances_filters_namespace() -> None:
    health = {"instances": [
        {"endpoint": "generate", "namespace": "a"}, {"endpoint": "generate", "namespace": "b"},
        {"endpoint": "worker_kv_query_source_1", "namespace": "a"},
    ]}  # fmt: skip
    assert generate_instances(health, "a") == [{"endpoint": "generate", "namespace": "a"}]
    assert len(generate_instances(health)) == 2 and generate_instances(None) == []


def test_small_helpers() -> None:
    assert _prefix_end(b"v1/") == b"v10" and _prefix_end(b"a\xff") == b"b" and _prefix_end(b"\xff") == b"\0"
    assert find_binary("sh") is not None and find_binary("no-such-binary-xyz") is None
    taken: set[int] = set()
    ports = {pick_port(below=32768, avoid=taken) for _ in range(5)}
    assert len(ports) == 5 and all(20000 <= p < 32768 for p in ports) and ports == taken


def test_ray_fleet_spec_validation() -> None:
    pytest.importorskip("ray")
    from rollout_backends.ray import RayFleetSpec

    cmd = ReferenceServerCommand(model_path="/m")
    spec = RayFleetSpec(engine=cmd, num_engines=2, gpus_per_engine=2, cpus_per_engine=4, resources={"accel": 1})
    assert spec.bundle() == {"CPU": 4.0, "GPU": 2.0, "accel": 1.0}
    assert RayFleetSpec(engine=cmd, num_engines=1).bundle() == {"CPU": 1.0}
    with pytest.raises(InvalidRequest, match="num_engines"):
        RayFleetSpec(engine=cmd, num_engines=0)
    with pytest.raises(InvalidRequest, match="strategy"):
        RayFleetSpec(engine=cmd, num_engines=1, strategy="ANYWHERE")
    with pytest.raises(InvalidRequest, match="bundle_indices"):
        RayFleetSpec(engine=cmd, num_engines=2, bundle_indices=[0, 1])


def test_only_the_ray_subpackage_imports_ray() -> None:
    import subprocess

    code = (
        "import sys, rollout_backends, rollout_backends.kit, rollout_backends._launch\n"
        "import rollout_backends.adapters.sglang, rollout_backends.adapters.reference\n"
        "import rollout_backends.adapters.dynamo._commands, rollout_backends.adapters.dynamo._services\n"
        "from rollout_backends.adapters.reference import ReferenceServerCommand\n"
        "print('ray' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_local_launchers_build_through_the_same_commands() -> None:
    """One mechanism: the local launchers' processes are these commands on a local NodeContext."""
    from rollout_backends.adapters.dynamo._launcher import DynamoFleet, fleet_planes, frontend_command, worker_command
    from rollout_backends.adapters.sglang import SGLangFleetConfig
    from rollout_backends.adapters.sglang._launcher import engine_command, router_command

    cfg = SGLangFleetConfig(model_path="/m", workers=2, api_key="K", router_policy="round_robin")
    eng = engine_command(cfg, 1)
    assert isinstance(eng, SGLangServerCommand) and eng.mem_fraction_static == 0.4 and eng.api_key == "K"
    assert isinstance(engine_command(attrs.evolve(cfg, worker_kind="reference"), 0), ReferenceServerCommand)
    router = router_command(cfg)
    assert router.register_workers is False and router.policy == "round_robin"  # smg: POST /workers
    launch = router.build(NodeContext.on(-1, "127.0.0.1", "/tmp/x", fixed={"http": 9000, "prometheus": 9001}), [])
    assert "--worker-urls" not in launch.spec.argv and launch.spec.ready is not None
    assert launch.spec.ready.url == "http://127.0.0.1:9000/liveness" and launch.extra["prometheus_port"] == 9001

    dyn = DynamoFleet(model_path="/m/tiny", worker_kind="reference", router_mode="kv", kv_events=False)
    planes = fleet_planes(dyn, "/tmp/kv")
    assert planes.file_kv == "/tmp/kv" and planes.discovery == "file"
    worker = worker_command(dyn, "ns", planes).build(NodeContext.on(0, "127.0.0.1", "/tmp/x", fixed={"system": 21000}))
    arg = json.loads(flag(worker.spec.argv, "--engine-arg"))
    assert arg["worker_id"] == "127.0.0.1:21000" and worker.control_url == "http://127.0.0.1:21000"
    assert worker.spec.ready is not None and worker.spec.ready.status is None  # /live answers at all
    fe = frontend_command(dyn, "ns", planes).build(NodeContext.on(-1, "127.0.0.1", "/tmp/x"), [])
    assert "--no-router-kv-events" in fe.spec.argv and fe.spec.env["DYN_ENABLE_RL"] == "true"
    assert int(fe.spec.env["DYN_RL_PORT"] or 0) < 32768 and fe.spec.env["DYN_NAMESPACE"] == "ns"


def test_node_context_fixed_ports_and_wildcards() -> None:
    ctx = NodeContext.on(2, "0.0.0.0", "/tmp/x", node_ip="10.0.0.7", fixed={"http": 25000})
    assert ctx.advertise_host == "10.0.0.7" and NodeContext.on(0, "0.0.0.0", "/x").advertise_host == "127.0.0.1"
    assert ctx.port("http") == 25000 and ctx.port("other") not in (25000,) and 25000 in ctx.picked
    from rollout_backends._launch import carry, str_tuple

    with pytest.raises(TypeError):
        str_tuple("--flag")
    cmd = carry(ReferenceServerCommand, ctx, model_path="/m")  # nothing same-named: defaults
    assert cmd.page_size == 16 and cmd.model_path == "/m"
