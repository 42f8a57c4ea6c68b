"""The multi-node examples stay in step with the code (they are not run against a cluster here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mnhelpers import require

from rollout_backends.adapters.dynamo._services import DynamoPlanes

ROOT = Path(__file__).resolve().parents[2]


def _docs(path: Path) -> list[dict[str, Any]]:
    yaml = require("yaml")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_k8s_dynamo_example_matches_planes() -> None:
    docs = _docs(ROOT / "examples" / "multinode" / "k8s-dynamo-etcd.yaml")
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    config = by_name["ConfigMap", "dynamo-planes"]["data"]
    planes = DynamoPlanes(
        etcd_endpoints=[config["ETCD_ENDPOINTS"]],
        nats_url=config["NATS_SERVER"],
        event_plane=config["DYN_EVENT_PLANE"],
        request_plane=config["DYN_REQUEST_PLANE"],
        lease_ttl=int(config["ETCD_LEASE_TTL"]),
    )
    env = planes.env("0.0.0.0", "10.0.0.1")
    for key, value in config.items():
        if key in env:
            assert env[key] == value, key
    plane_flags = planes.args()
    for kind, name in (("StatefulSet", "dynamo-worker"), ("Deployment", "dynamo-frontend")):
        container = by_name[kind, name]["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        for flag, value in zip(plane_flags[::2], plane_flags[1::2], strict=True):
            assert args[args.index(flag) + 1] == value, (name, flag)
        assert args[args.index("--namespace") + 1] == config["DYN_NAMESPACE"]
        names = {e["name"] for e in container["env"]}
        assert "DYN_TCP_RPC_HOST" in names  # a routable request-plane address, as DynamoPlanes.env sets
    worker = by_name["StatefulSet", "dynamo-worker"]["spec"]["template"]["spec"]["containers"][0]
    system = {e["name"]: e.get("value") for e in worker["env"]}["DYN_SYSTEM_PORT"]
    assert int(system) < 32768 and worker["readinessProbe"]["httpGet"]["port"] == int(system)


def test_ray_example_parses_its_arguments() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("ray_fleet_example", ROOT / "examples" / "multinode" / "ray_fleet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import argparse

    args = argparse.Namespace(engine="sglang", gpus_per_engine=2.0)
    cmd = module.engine_command(args, "/m")
    assert type(cmd).__name__ == "SGLangServerCommand" and cmd.tp == 2
