"""Benchmarks shipped with the library (private): ``rollout-backends bench ...`` runs them.

``benchmarks/`` at the repository root holds thin scripts over these modules.
"""
