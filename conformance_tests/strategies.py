"""Hypothesis strategies for property-based tests of a backend (needs ``hypothesis``).

    from hypothesis import given
    from rollout_backends.conformance.strategies import prompts, sampling_params

    @given(prompts(vocab_size=512, max_len=64), sampling_params(max_new_tokens=8))
    def test_any_request(prompt, sampling): ...

Every value drawn is valid (``SamplingParams`` accepts it), so a backend must serve it.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from rollout_backends import SamplingParams

__all__ = ["prompts", "sampling_params"]


def prompts(vocab_size: int, max_len: int, *, min_len: int = 1, min_id: int = 0) -> Any:
    """Token-id tuples of length ``min_len..max_len`` with ids in ``[min_id, vocab_size)``."""
    if not 0 <= min_id < vocab_size:
        raise ValueError(f"need 0 <= min_id < vocab_size, got {min_id}, {vocab_size}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    return st.lists(st.integers(min_id, vocab_size - 1), min_size=min_len, max_size=max_len).map(tuple)


@st.composite
def _sampling(
    draw: Any, max_new_tokens: int, greedy: bool | None, seeded: bool | None, stop_vocab: int | None
) -> SamplingParams:
    is_greedy = draw(st.booleans()) if greedy is None else greedy
    m = draw(st.integers(1, max_new_tokens))
    temperature = 0.0 if is_greedy else draw(st.floats(0.05, 2.0, allow_nan=False))
    use_seed = draw(st.booleans()) if seeded is None else seeded
    stops: tuple[int, ...] = ()
    if stop_vocab is not None:
        stops = tuple(draw(st.lists(st.integers(0, stop_vocab - 1), max_size=3, unique=True)))
    return SamplingParams(
        max_new_tokens=m,
        temperature=temperature,
        top_p=draw(st.sampled_from([1.0, 0.95, 0.5])),
        top_k=draw(st.sampled_from([-1, 1, 20])),
        min_p=draw(st.sampled_from([0.0, 0.05])),
        min_new_tokens=draw(st.integers(0, m)),
        stop_token_ids=stops,
        ignore_eos=draw(st.booleans()),
        seed=draw(st.integers(0, 2**63 - 1)) if use_seed else None,
        repetition_penalty=draw(st.sampled_from([1.0, 1.1])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.5])),
        presence_penalty=draw(st.sampled_from([0.0, -0.5])),
    )


def sampling_params(
    *,
    max_new_tokens: int = 16,
    greedy: bool | None = None,
    seeded: bool | None = None,
    stop_vocab: int | None = None,
) -> Any:
    """Valid ``SamplingParams``: ``max_new_tokens`` in ``1..max_new_tokens``; ``greedy``/``seeded``
    force temperature 0 / a seed (``None``: either); ``stop_vocab`` draws stop token ids below it."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    return _sampling(max_new_tokens, greedy, seeded, stop_vocab)
