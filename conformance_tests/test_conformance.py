"""The conformance suite as pytest tests: ``pytest --pyargs rollout_backends.conformance --rb-backend URL``.

Without ``--rb-backend`` the whole module is one skip. Each check runs in a fixture (pytest's
set-up), so that a setup or harness problem is a pytest *error* and only a backend that broke the
contract is a *failure* (the test's call). Tests are synchronous (each runs its check with
``asyncio.run``), so no pytest asyncio plugin is needed.
"""

from __future__ import annotations

import pytest

from rollout_backends.conformance import Check, CheckResult, plugin

_NO_BACKEND = (
    "no backend given: pass --rb-backend URL (e.g. --rb-backend 'reference://?workers=2') to run the "
    "rollout-backends conformance suite"
)


if not plugin.backend_urls():
    # One clear skip (and exit status 0), rather than no test at all.
    def test_conformance_suite() -> None:
        pytest.skip(_NO_BACKEND)

else:
    if plugin.selected_checks():

        @pytest.fixture
        def rb_contract_result(rb_backend_url: str, rb_check: Check) -> CheckResult:
            return plugin.settle(plugin.run_contract(rb_backend_url, rb_check))

        def test_contract(rb_contract_result: CheckResult) -> None:
            plugin.judge(rb_contract_result)

    if plugin.parity_selected():

        @pytest.fixture
        def rb_parity_result(rb_parity_case: plugin.ParityCase | None) -> CheckResult:
            return plugin.settle(plugin.run_parity(rb_parity_case))

        def test_parity(rb_parity_result: CheckResult) -> None:
            plugin.judge(rb_parity_result)
