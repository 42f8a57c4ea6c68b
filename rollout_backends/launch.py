"""Starting engines and entry points: the door for launchers and adapter authors.

An adapter describes *what* runs (an ``EngineCommand``: a command line, its ports, how to tell it
is ready; an ``EntryCommand`` for a router or frontend); a launcher decides *where* (a
``NodeContext``) and runs it under the ``Supervisor``, which owns the process groups, their logs
and their readiness checks::

    from rollout_backends.launch import NodeContext, Supervisor

    async with Supervisor(log_dir) as sup:
        ctx = NodeContext.on(0, "127.0.0.1", log_dir)
        launch = command.build(ctx)                 # e.g. SGLangServerCommand(model_path=...)
        proc = await sup.start(launch.spec)
        await sup.wait_ready([launch.spec.name], timeout=600)
        info = launch.info(ctx, proc.pid)           # what an EntryCommand's ``connect`` is given

A whole fleet, the same way for every engine and every placement::

    fleet = await launch_fleet(SGLangServerCommand(model_path=...), 2, SmgRouter(), Local())
    backend = await fleet.connect()
    ...
    await fleet.aclose()                            # backends, entry, engines

(``rollout_backends.ray.Ray(...)`` places the engines on a Ray cluster instead of ``Local()``.)

Re-exports only: the names live in private modules and are public here.
"""

from rollout_backends._launch import (
    ConnectableEngine,
    EngineCommand,
    EngineInfo,
    EntryCommand,
    HelpFormatter,
    Launch,
    Local,
    LocalEngines,
    NodeContext,
    PlacedEngines,
    Placement,
    RunningFleet,
    carry,
    env_map,
    launch_fleet,
    one_line_error,
    pick_port,
    require_model_dir,
    require_module,
    run_launcher_cli,
    split_passthrough,
    str_tuple,
)
from rollout_backends._supervisor import (
    ManagedProcess,
    ProcessSpec,
    ProcessState,
    ReadyCheck,
    ReadyProgress,
    Supervisor,
    free_port,
    group_members,
    port_in_use,
    redact_argv,
    stderr_progress,
)

__all__ = [
    "ConnectableEngine",
    "EngineCommand",
    "EngineInfo",
    "EntryCommand",
    "HelpFormatter",
    "Launch",
    "Local",
    "LocalEngines",
    "ManagedProcess",
    "NodeContext",
    "PlacedEngines",
    "Placement",
    "ProcessSpec",
    "ProcessState",
    "ReadyCheck",
    "ReadyProgress",
    "RunningFleet",
    "Supervisor",
    "carry",
    "env_map",
    "free_port",
    "group_members",
    "launch_fleet",
    "one_line_error",
    "pick_port",
    "port_in_use",
    "redact_argv",
    "require_model_dir",
    "require_module",
    "run_launcher_cli",
    "split_passthrough",
    "stderr_progress",
    "str_tuple",
]
