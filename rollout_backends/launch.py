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

Re-exports only: the names live in private modules and are public here.
"""

from rollout_backends._launch import (
    EngineCommand,
    EngineInfo,
    EntryCommand,
    Launch,
    NodeContext,
    carry,
    env_map,
    pick_port,
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
    "EngineCommand",
    "EngineInfo",
    "EntryCommand",
    "Launch",
    "ManagedProcess",
    "NodeContext",
    "ProcessSpec",
    "ProcessState",
    "ReadyCheck",
    "ReadyProgress",
    "Supervisor",
    "carry",
    "env_map",
    "free_port",
    "group_members",
    "pick_port",
    "port_in_use",
    "redact_argv",
    "run_launcher_cli",
    "split_passthrough",
    "stderr_progress",
    "str_tuple",
]
