"""The conformance suite (``rollout_backends.conformance``)."""
