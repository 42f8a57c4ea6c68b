"""Test your rollout code without servers: an in-memory fleet that keeps the protocol's rules.

    import rollout_backends as rb
    from rollout_backends.testing import fake_fleet, write_checkpoint

    async def test_my_rollout_loop(tmp_path):
        async with fake_fleet(workers=2) as backend:      # a RolloutBackend, no torch, no engine
            gen = await backend.generate(rb.GenerateRequest(input_ids=[1, 2, 3]))
            async with backend.weight_update("step-1") as tx:
                await tx.update_from_disk(write_checkpoint(tmp_path / "step-1", seed=2))
            assert await backend.weight_version() == "step-1"
            assert [type(op).__name__ for op in backend.fake("fake-0").ops][:2] == ["Pause", "FlushCache"]

``fake_fleet`` is the same ``Fleet`` every real backend is (validation, fan-out, versions, health,
the transaction), over ``FakeDriver``s: a hash stands for the model (token ids below
``VOCAB_SIZE``, prompts shorter than ``MAX_CONTEXT``), a checkpoint is a directory holding a seed
(``write_checkpoint``), and each worker records the operations it received (``FakeDriver.ops``)
and can be told to fail the next one (``FakeDriver.fail_next(UpdateFromDisk)``). It passes the
conformance suite: ``run_checks(fake_factory(), ...)`` (with
``Harness(permute_vocabulary=permute_checkpoint)`` for the checks that derive other weights from
the served checkpoint, which here is not a safetensors one).
"""

from rollout_backends._fake import (
    EOS,
    FAKE_CAPABILITIES,
    MAX_CONTEXT,
    VOCAB_SIZE,
    FakeDriver,
    FakeFleet,
    fake_factory,
    fake_fleet,
    load_checkpoint,
    permute_checkpoint,
    read_checkpoint,
    write_checkpoint,
)

__all__ = [
    "EOS",
    "FAKE_CAPABILITIES",
    "MAX_CONTEXT",
    "VOCAB_SIZE",
    "FakeDriver",
    "FakeFleet",
    "fake_factory",
    "fake_fleet",
    "load_checkpoint",
    "permute_checkpoint",
    "read_checkpoint",
    "write_checkpoint",
]
