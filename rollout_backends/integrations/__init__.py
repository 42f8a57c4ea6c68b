"""Integrations of ``rollout_backends`` into RL frameworks (each in its own subpackage)."""
