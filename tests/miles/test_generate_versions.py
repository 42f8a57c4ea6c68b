"""The generate hook records a generation that spanned a weight update under each version that served
it (issue 27 item 6b), as Miles records a sample that partial rollout resumed under a new version:
one ``Sample.weight_versions`` entry per version, in order (``miles/utils/types.py`` at 31f1ca961a94:
``update_from_meta_info`` appends one per call; ``oldest_weight_version``, the ``mixed_version``
metric in ``miles/ray/rollout/metrics.py`` read them)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

import rollout_backends as rb
from rollout_backends.integrations.miles import generate
from rollout_backends.integrations.miles._generate import served_versions
from tests.miles.miles_shapes import (
    BareSample,
    GenerateFnInput,
    GenerateState,
    Sample,
    compute_sampling_params,
    make_args,
)
from tests.miles.scripted import ScriptedBackend


def _gen(out: tuple[int, ...], *, start: str | None, end: str | None, spans: Any = None) -> rb.Generation:
    return rb.Generation(
        request_id="r",
        output_ids=out,
        logprobs=tuple(-0.5 for _ in out),
        finish_reason=rb.FinishReason.LENGTH,
        weight_version=end,
        version_at_start=start,
        version_spans=spans,
        prompt_tokens=3,
    )


@pytest.mark.parametrize("sample_cls", [Sample, BareSample], ids=["miles_sample", "duck_typed"])
async def test_a_generation_spanning_an_update_is_recorded_under_each_version(
    sample_cls: type, scripted: tuple[ScriptedBackend, str], tokenizer: Any
) -> None:
    backend, url = scripted
    args = make_args(rollout_backend_url=url, rollout_max_response_len=4)
    backend.script.append(_gen((40, 41, 42, 43), start="3", end="4", spans=((0, "3"), (2, "4"))))
    sample = sample_cls(index=0, prompt="Q: 2+3?")
    sp = compute_sampling_params(args)
    await generate(GenerateFnInput(GenerateState(args, tokenizer), sample, copy.deepcopy(sp), False))
    assert sample.weight_versions == ["3", "4"]
    assert sample.tokens[-4:] == [40, 41, 42, 43]


def test_served_versions() -> None:
    assert served_versions(_gen((1, 2), start="3", end="3", spans=((0, "3"),))) == ["3"]
    # admitted under 3 (its prompt's KV), every token under 4
    assert served_versions(_gen((1, 2), start="3", end="4", spans=((0, "4"),))) == ["3", "4"]
    # A -> B -> A across two updates (a rollback): each run once, in order
    assert served_versions(_gen((1, 2, 3), start="a", end="a", spans=((0, "a"), (1, "b"), (2, "a")))) == [
        "a",
        "b",
        "a",
    ]
    assert served_versions(_gen((1,), start=None, end="5")) == ["5"]  # spans and start not known
    assert served_versions(_gen((1,), start="4", end="5")) == ["4", "5"]
    assert served_versions(_gen((), start=None, end=None)) == []
