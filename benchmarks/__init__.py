"""Benchmark scripts (not installed). The logic lives in ``rollout_backends._bench``."""
