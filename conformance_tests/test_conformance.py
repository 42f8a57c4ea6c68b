"""The conformance suite as pytest tests: ``pytest --pyargs rollout_backends.conformance --rb-backend URL``.

Without ``--rb-backend`` the whole module is one skip. Tests are synchronous (each runs its check
with ``asyncio.run``), so no pytest asyncio plugin is needed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.conformance import Check, Outcome, check_parity, plugin

_NO_BACKEND = (
    "no backend given: pass --rb-backend URL (e.g. --rb-backend 'reference://?workers=2') to run the "
    "rollout-backends conformance suite"
)


def _factory(url: str) -> Any:
    async def make() -> rb.RolloutBackend:
        return await rb.open_backend(url)

    return make


if not plugin.backend_urls():
    # One clear skip (and exit status 0), rather than no test at all.
    def test_conformance_suite() -> None:
        pytest.skip(_NO_BACKEND)

else:

    def test_contract(rb_backend_url: str, rb_check: Check) -> None:
        harness = plugin.harness_for(rb_backend_url)
        result = asyncio.run(rb_check(_factory(rb_backend_url), harness))
        plugin.record(f"[{rb_backend_url}] {result.line()}")
        if result.outcome is Outcome.SKIP:
            pytest.skip(result.message)
        if result.outcome is Outcome.ERROR:
            pytest.fail(
                f"ERROR (harness or check, not the backend): {result.message}\n{result.traceback}", pytrace=False
            )
        if result.outcome is Outcome.FAIL:
            pytest.fail(f"{result.message}\n{result.traceback or ''}", pytrace=False)

    def test_parity() -> None:
        urls = plugin.backend_urls()
        first = plugin.harness_for(urls[0])
        hf_path = first.hf_model_path
        if len(urls) < 2 and hf_path is None:
            pytest.skip("parity needs two --rb-backend URLs, or one and --rb-hf-model")
        report = asyncio.run(
            check_parity(
                {u: _factory(u) for u in urls},
                max_new_tokens=16,
                tolerance=first.logprob_tolerance,
                hf_model_path=hf_path,
                hf_tolerance=first.hf_logprob_tolerance,
            )
        )
        for r in report.results():
            plugin.record(r.line())
        if not report.ok:
            pytest.fail(report.summary(), pytrace=False)
