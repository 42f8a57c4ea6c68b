"""``RolloutEngine`` against the engine-actor contract Miles relies on.

In the style of Miles' ``tests/fast/utils/test_utils/test_mock_sglang_engine.py``: the methods Miles
calls on engine handles must all exist, with SGLangEngine's parameters (names, order, defaults).

Source: radixark/miles ``31f1ca961a94`` (2026-08-21). The method list is miles.md §1.2 (every
``<engine>.<method>.remote(`` call site under ``miles/``); the signatures below copy the shapes of
``miles/backends/sglang_utils/sglang_engine.py::SGLangEngine`` and ``miles/ray/ray_actor.py::RayActor``
at that commit (bodies omitted).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from rollout_backends.integrations.miles import RolloutEngine

#: miles.md §1.2, radixark/miles 31f1ca961a94.
MILES_ENGINE_METHODS = [
    # weight sync
    "flush_cache",
    "pause_generation",
    "continue_generation",
    "update_weights_from_disk",
    "get_weight_version",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "begin_weight_update",
    "end_weight_update",
    "init_weights_update_group",
    "pull_weights",
    "destroy_weights_update_group",
    "update_weight_version",
    "check_weights",
    # LoRA / memory
    "load_lora_adapter_from_distributed",
    "unload_lora_adapter",
    "load_lora_adapter_from_tensors",
    "release_memory_occupation",
    "resume_memory_occupation",
    # lifecycle / info
    "health_generate",
    "_get_current_node_ip_and_free_port",
    "init",
    "shutdown",
    "simulate_crash",
    "get_topology_info",
    "get_server_info",
    "get_parallelism_info",
    "get_remote_instance_transfer_engine_info",
]


class SGLangEngineShape:
    """Signatures of SGLangEngine (and RayActor) at radixark/miles 31f1ca961a94; no behaviour."""

    def __init__(
        self, args, rank, worker_type="regular", base_gpu_id=None, sglang_overrides=None, num_gpus_per_engine=None
    ): ...

    @staticmethod
    def _get_current_node_ip_and_free_port(start_port=10000, consecutive=1): ...

    def get_master_addr_and_port(self): ...
    def get_topology_info(self): ...
    def init(
        self,
        dist_init_addr,
        port,
        nccl_port,
        host=None,
        disaggregation_bootstrap_port=None,
        router_ip=None,
        router_port=None,
        engine_info_bootstrap_port=None,
    ): ...
    def health_generate(self, timeout=5.0): ...
    def update_weights_from_tensor(
        self, serialized_named_tensors, load_format=None, flush_cache=False, weight_version=None, selector="all"
    ): ...
    def get_remote_instance_transfer_engine_info(self, rank): ...
    def get_parallelism_info(self, rank): ...
    def get_server_info(self): ...
    def load_lora_adapter_from_tensors(
        self,
        lora_name,
        config_dict,
        serialized_tensors=None,
        serialized_named_tensors=None,
        load_format=None,
        pinned=False,
        added_tokens_config=None,
        upsert=False,
        expected_checksums=None,
    ): ...
    def load_lora_adapter_from_distributed(
        self,
        lora_name,
        config_dict,
        names,
        dtypes,
        shapes,
        group_name,
        pinned=False,
        added_tokens_config=None,
        upsert=False,
    ): ...
    def flush_cache(self): ...
    def shutdown(self): ...
    def get_weight_version(self): ...
    def unload_lora_adapter(self, lora_name): ...
    def release_memory_occupation(self, tags=None): ...
    def resume_memory_occupation(self, tags=None): ...
    def check_weights(self, action, allow_quant_error=False, selector="all", skip_list=None): ...
    def pull_weights(self, target_version): ...
    def update_weights_from_disk(self, model_path, load_format=None, weight_version=None): ...
    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend): ...
    def destroy_weights_update_group(self, group_name): ...
    def update_weights_from_distributed(
        self, names, dtypes, shapes, group_name, flush_cache=False, weight_version=None, selector="all"
    ): ...
    def pause_generation(self, mode="retract"): ...
    def continue_generation(self): ...
    def begin_weight_update(self, selector="all"): ...
    def end_weight_update(self): ...
    def update_weight_version(self, weight_version): ...
    def start_profile(
        self,
        output_dir=None,
        start_step=None,
        num_steps=None,
        activities=None,
        profile_by_stage=False,
        with_stack=None,
        record_shapes=None,
    ): ...
    def stop_profile(self): ...
    def simulate_crash(self): ...


def _public_methods(cls: type) -> set[str]:
    """Miles' ``_public_methods``: functions of the class, with one semi-private helper kept."""
    keep_underscored = {"_get_current_node_ip_and_free_port"}
    return {
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("__") and (not name.startswith("_") or name in keep_underscored)
    }


def check_compatible(real: Callable[..., Any], ours: Callable[..., Any]) -> list[str]:
    """Every call valid on ``real`` is valid on ``ours`` with the same meaning.

    Same positional parameters in the same order, the same defaults, and any extra parameter of
    ours optional (keyword-only or defaulted). Returns the problems found.
    """
    problems: list[str] = []
    rp = [p for p in inspect.signature(real).parameters.values() if p.name != "self"]
    op = {p.name: p for p in inspect.signature(ours).parameters.values() if p.name != "self"}
    order = [p.name for p in inspect.signature(ours).parameters.values() if p.name != "self"]
    if order[: len(rp)] != [p.name for p in rp]:
        problems.append(f"positional order {order[: len(rp)]} != {[p.name for p in rp]}")
    for p in rp:
        o = op.get(p.name)
        if o is None:
            problems.append(f"missing parameter {p.name!r}")
            continue
        if o.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD,):
            problems.append(f"{p.name!r} is {o.kind.description}, Miles may pass it positionally")
        if p.default is not inspect.Parameter.empty and o.default != p.default:
            problems.append(f"{p.name!r} defaults to {o.default!r}, SGLangEngine's to {p.default!r}")
    for name, o in op.items():
        if (
            name not in {p.name for p in rp}
            and o.default is inspect.Parameter.empty
            and o.kind
            not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            )
        ):
            problems.append(f"extra required parameter {name!r}")
    return problems


def test_every_method_miles_calls_exists() -> None:
    missing = set(MILES_ENGINE_METHODS) - _public_methods(RolloutEngine)
    assert not missing, f"RolloutEngine lacks methods Miles calls: {sorted(missing)}"


def test_the_list_is_sglang_engines_own() -> None:
    """The hard-coded list names real SGLangEngine methods (no typo makes a check vacuous)."""
    assert set(MILES_ENGINE_METHODS) <= _public_methods(SGLangEngineShape)


@pytest.mark.parametrize("name", sorted(_public_methods(SGLangEngineShape) | {"__init__"}))
def test_signature_compatible_with_sglang_engine(name: str) -> None:
    """The full SGLangEngine surface (not only what Miles calls today), constructor included."""
    ours = getattr(RolloutEngine, name, None)
    assert ours is not None, f"RolloutEngine.{name} is missing"
    problems = check_compatible(getattr(SGLangEngineShape, name), ours)
    assert not problems, f"RolloutEngine.{name}: {problems}"


def test_init_keeps_every_real_param() -> None:
    """Miles' own ``test_signature_compat_for_init``."""
    real = set(inspect.signature(SGLangEngineShape.init).parameters) - {"self"}
    ours = set(inspect.signature(RolloutEngine.init).parameters) - {"self"}
    assert real <= ours


def test_check_compatible_can_fail() -> None:
    def real(self: Any, a: Any, b: int = 1) -> None: ...
    def reordered(self: Any, b: int = 1, a: Any = None) -> None: ...
    def other_default(self: Any, a: Any, b: int = 2) -> None: ...
    def extra_required(self: Any, a: Any, b: int = 1, *, c: Any) -> None: ...
    def keyword_only(self: Any, *, a: Any, b: int = 1) -> None: ...

    assert check_compatible(real, real) == []
    assert check_compatible(real, reordered)
    assert check_compatible(real, other_default)
    assert check_compatible(real, keyword_only)
    assert check_compatible(real, extra_required)

    def missing(self: Any, a: Any) -> None: ...

    assert check_compatible(real, missing)


def test_is_a_plain_class_usable_as_a_ray_actor() -> None:
    """``ray.remote(cls)`` needs a plain, importable class whose instances are built in the actor."""
    assert inspect.isclass(RolloutEngine) and RolloutEngine.__module__.startswith("rollout_backends.")
    assert not hasattr(RolloutEngine, "__ray_actor_class__")
    engine = RolloutEngine(object(), rank=0)  # the constructor only stores state, like SGLangEngine's
    assert engine.rank == 0 and engine.node_rank == 0
