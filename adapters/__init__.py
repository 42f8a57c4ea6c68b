"""Adapters: one subpackage per engine family (``rollout_backends.adapters.<name>``)."""
