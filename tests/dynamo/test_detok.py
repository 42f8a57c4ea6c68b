"""Worker-side detokenization (``adapters/dynamo/_detok.py``): exact text, never a split character.

``frontend_decoder_would_panic`` replays, on bytes, what the ai-dynamo 1.4.2 frontend's
``DecodeStream::step`` does (``dynamo-tokenizers``: decode the prefix window and the window plus
the new token, then ``new_text[prefix_text.len()..]``, a byte slice): True where that slice starts
inside a multi-byte character, i.e. where the frontend thread panics and the client gets HTTP 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_backends._types import FinishReason, Generation
from rollout_backends.adapters.dynamo._detok import IncrementalDetokenizer, TextDecoder, load_text_decoder
from rollout_backends.adapters.dynamo._worker import DynamoWorker

#: Token sequences (prompt, output) of the seed-0 tiny model's tokenizer found to trip the frontend.
SCRIPTED_PANIC = ([387, 370, 121, 139], [102, 129, 146, 112])


def frontend_decoder_would_panic(decode: TextDecoder, prompt: Sequence[int], output: Sequence[int]) -> bool:
    ids = list(prompt)
    prefix, read = max(0, len(ids) - 5), len(ids)
    for t in output:
        ids.append(t)
        prefix_bytes = decode(ids[prefix:read], False).encode()
        new_text = decode(ids[prefix:], False)
        new_bytes = new_text.encode()
        if len(new_bytes) > len(prefix_bytes) and not new_text.endswith("\ufffd"):
            if new_bytes[len(prefix_bytes)] & 0xC0 == 0x80:  # a UTF-8 continuation byte: not a boundary
                return True
            prefix, read = read, len(ids)
    return False


@pytest.fixture(scope="module")
def decode(tiny_model: Path) -> TextDecoder:
    d = load_text_decoder(str(tiny_model))
    assert d is not None
    return d


def expected_text(decode: TextDecoder, prompt: Sequence[int], output: Sequence[int]) -> str:
    """What the output adds to the prompt's text: the whole decode after its common prefix with the
    prompt's decode (a character whose first bytes end the prompt belongs to the output's text)."""
    full, before = decode([*prompt, *output], False), decode(list(prompt), False)
    n = 0
    while n < min(len(full), len(before)) and full[n] == before[n]:
        n += 1
    return full[n:]


def _text(decode: TextDecoder, prompt: Sequence[int], output: Sequence[int]) -> tuple[list[str], str]:
    d = IncrementalDetokenizer(decode, prompt)
    pieces = [d.step(t) for t in output]
    return pieces, d.finish()


def test_the_scripted_sequence_trips_the_frontend_algorithm(decode: TextDecoder) -> None:
    # The premise of the workaround: this exact sequence makes the frontend's byte slice panic.
    assert frontend_decoder_would_panic(decode, *SCRIPTED_PANIC)
    prompt, output = SCRIPTED_PANIC
    pieces, tail = _text(decode, prompt, output)
    assert "".join(pieces) + tail == expected_text(decode, prompt, output)
    # Here the prompt ends with the first byte of a character that the first output token completes.
    assert not decode(prompt + output, False).startswith(decode(prompt, False))


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 511), max_size=8),
    output=st.lists(st.integers(0, 511), min_size=1, max_size=16),
)
def test_deltas_add_up_to_the_full_decode(decode: TextDecoder, prompt: list[int], output: list[int]) -> None:
    pieces, tail = _text(decode, prompt, output)
    assert "".join(pieces) + tail == expected_text(decode, prompt, output)
    # A held (incomplete) character is never emitted half-way: no piece ends in U+FFFD.
    assert not any(p.endswith("\ufffd") for p in pieces)


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 511), max_size=8),
    output=st.lists(st.integers(0, 511), min_size=1, max_size=60),
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=8),
)
def test_chunks_give_the_text_of_token_by_token_steps(
    decode: TextDecoder, prompt: list[int], output: list[int], sizes: list[int]
) -> None:
    """The fast path (one window step per chunk) against the checked one (a step per token)."""
    chunks: list[list[int]] = []
    i = 0
    while i < len(output):
        n = sizes[len(chunks) % len(sizes)]
        chunks.append(output[i : i + n])
        i += n
    d = IncrementalDetokenizer(decode, prompt)
    got = [d.chunk(c, last=k == len(chunks) - 1) for k, c in enumerate(chunks)]
    pieces, tail = _text(decode, prompt, output)
    assert "".join(text for _, text in got) == "".join(pieces) + tail == expected_text(decode, prompt, output)
    for (tokens, text), c in zip(got, chunks, strict=True):
        assert tokens == [decode([t], False) for t in c]  # aligned with the ids, each decoded alone
        assert not text.endswith("\ufffd") or c is chunks[-1]  # nothing half-emitted before the end


def test_incomplete_characters_are_held_until_complete(decode: TextDecoder) -> None:
    # Find a 2-token UTF-8 character: a token that alone decodes to U+FFFD, completed by another.
    vocab = range(512)
    lone = [t for t in vocab if decode([t], False) == "\ufffd"]
    pair = next(((a, b) for a in lone for b in lone if "\ufffd" not in decode([a, b], False)), None)
    assert pair is not None, "the tiny tokenizer has byte tokens that combine into a character"
    d = IncrementalDetokenizer(decode, [])
    assert d.step(pair[0]) == ""
    assert d.step(pair[1]) == decode(list(pair), False)
    assert d.finish() == ""
    # A character that never completes comes out at the end, as U+FFFD.
    d = IncrementalDetokenizer(decode, [])
    assert d.step(pair[0]) == ""
    assert d.finish() == "\ufffd"


def test_missing_tokenizer_gives_no_decoder(tmp_path: Path) -> None:
    assert load_text_decoder(str(tmp_path)) is None
    (tmp_path / "tokenizer.json").write_text("not json")
    assert load_text_decoder(str(tmp_path)) is None


def _worker(model_path: Path) -> DynamoWorker:
    return DynamoWorker(object(), namespace="ns", model_path=str(model_path), served_model_name="tiny")


def _generation(ids: Sequence[int]) -> Generation:
    return Generation(
        request_id="r", output_ids=tuple(ids), logprobs=tuple(-0.5 for _ in ids),
        finish_reason=FinishReason.LENGTH, weight_version="v", prompt_tokens=4,
    )  # fmt: skip


def test_worker_chunks_carry_text_and_tokens(tiny_model: Path, decode: TextDecoder) -> None:
    prompt, output = SCRIPTED_PANIC
    request: dict[str, Any] = {"token_ids": prompt, "stop_conditions": {"max_tokens": 4}}
    chunks = _worker(tiny_model)._chunks(_generation(output), request)
    assert [c["token_ids"] for c in chunks] == [[t] for t in output]
    assert all(len(c["tokens"]) == 1 for c in chunks)
    assert "".join(c["text"] for c in chunks) == expected_text(decode, prompt, output)
    assert [c["log_probs"] for c in chunks] == [[-0.5]] * 4


def test_worker_leaves_text_stop_sequences_to_the_frontend(tiny_model: Path) -> None:
    # Only the frontend's decoder matches stop strings: a chunk with text would switch it off.
    request: dict[str, Any] = {"token_ids": [5, 6], "stop_conditions": {"stop": ["zz"], "max_tokens": 4}}
    chunks = _worker(tiny_model)._chunks(_generation([7, 8]), request)
    assert not any("text" in c or "tokens" in c for c in chunks)
    no_decoder = DynamoWorker(
        object(), namespace="ns", model_path=str(tiny_model), served_model_name="t", detokenize=False
    )
    assert not any("text" in c for c in no_decoder._chunks(_generation([7, 8]), {"token_ids": [5]}))
