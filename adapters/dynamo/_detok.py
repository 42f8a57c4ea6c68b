"""Worker-side incremental detokenization, so the Dynamo 1.4.2 frontend never detokenizes.

Why: the 1.4.2 frontend's incremental decoder (``DecodeStream::step`` in the ``dynamo-tokenizers``
crate) slices ``new_text[prefix_text.len()..]`` by *bytes* without a char-boundary check. When a
window's lossy decoding shifts where a replacement character (U+FFFD) falls, the slice lands
inside a multi-byte character, the frontend thread panics ("start byte index N is not a char
boundary") and the client gets HTTP 500 — for a deterministic token sequence, not only under load
(``tests/dynamo/test_detok.py`` has one for the tiny model). The frontend's ``Backend`` operator
passes a chunk through untouched when the worker already sent ``text`` (and ``tokens``, the
per-token strings that ``logprobs.tokens`` is built from), so a worker that detokenizes itself
sidesteps the bug. Token ids and logprobs are unaffected either way.

The algorithm is the usual prefix/read-offset window (TGI, vLLM, SGLang's detokenizer): decode the
last emitted tokens with and without the new ones and emit the difference, holding it back while
the text ends in U+FFFD (an incomplete UTF-8 sequence). Python slices ``str`` by code points, so a
shifted window costs at most a wrong-looking character, never a crash; the difference is taken
after the longest common prefix to be safe even then. ``finish()`` emits what is still held (with
U+FFFD for bytes that never completed a character), which the frontend's decoder drops.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Sequence

import attrs

__all__ = [
    "IncrementalDetokenizer",
    "TextCodec",
    "TextDecoder",
    "load_text_codec",
    "load_text_decoder",
    "worker_text_enabled",
]

logger = logging.getLogger("rollout_backends.dynamo_detok")

#: ``decode(ids, skip_special_tokens) -> str`` with lossy UTF-8 (``tokenizers.Tokenizer.decode``).
TextDecoder = Callable[[Sequence[int], bool], str]

#: How many prompt tokens give the first output token its left context (TGI's and vLLM's value).
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas, one ``step`` per token."""

    __slots__ = ("_decode", "_ids", "_prefix", "_read", "_skip_special")

    def __init__(self, decode: TextDecoder, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = False):
        self._decode = decode
        self._skip_special = skip_special_tokens
        # Only the prompt's tail matters: it is the left context of the first output token.
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)

    def _delta(self, *, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read], self._skip_special)
        new_text = self._decode(self._ids[self._prefix :], self._skip_special)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)):
            return ""  # hold: not enough tokens yet for a complete character
        delta = new_text[_common_prefix_len(prefix_text, new_text) :]
        # Keep only the window: the ids before the new prefix are never decoded again.
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return delta

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def chunk(self, token_ids: Sequence[int], *, last: bool = False) -> tuple[list[str], str]:
        """One chunk's ``tokens`` (a string per token id, aligned with them) and ``text``.

        ``text`` is the window's difference after the whole chunk: two decodes per chunk, not per
        token (what it saves: ``docs/dynamo.md``, "Where the Dynamo path's time goes"); the chunks'
        texts add up to exactly what :meth:`step` token by token gives (hypothesis property in
        ``tests/dynamo/test_detok.py``).
        On the ``last`` chunk the held-back tail is added. ``tokens`` are each id decoded alone
        (what ``logprobs.tokens`` shows; cached per id), so they need not add up to ``text``.
        """
        self._ids.extend(int(t) for t in token_ids)
        text = self._delta(final=False) if token_ids else ""
        if last:
            text += self.finish()
        return _token_strings(self._decode, self._skip_special, token_ids), text

    def finish(self) -> str:
        """Return the text still held back at the end of the generation (may contain U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        return self._delta(final=True)


#: ``decode -> {skip_special_tokens: {token id: text of that id alone}}``; dies with the decoder.
_TOKEN_STRINGS: weakref.WeakKeyDictionary[TextDecoder, dict[bool, dict[int, str]]] = weakref.WeakKeyDictionary()


def _token_strings(decode: TextDecoder, skip_special: bool, token_ids: Sequence[int]) -> list[str]:
    """Each id decoded alone, from a per-decoder cache (a vocabulary's worth at most)."""
    by_skip = _TOKEN_STRINGS.get(decode)
    if by_skip is None:
        by_skip = _TOKEN_STRINGS[decode] = {}
    cache = by_skip.setdefault(skip_special, {})
    out = []
    for t in token_ids:
        piece = cache.get(t)
        if piece is None:
            piece = cache[t] = decode([t], skip_special)
        out.append(piece)
    return out


def worker_text_enabled() -> bool:
    """Workers send text unless ``ROLLOUT_DYN_WORKER_TEXT=0`` (then the frontend detokenizes)."""
    return os.environ.get("ROLLOUT_DYN_WORKER_TEXT", "1").strip().lower() not in ("0", "false", "no", "off")


@attrs.frozen(slots=True, kw_only=True)
class TextCodec:
    """The model's tokenizer as the worker needs it: ``decode`` for text, ``count_tokens`` for
    SGLang's stop-string window (a string's token count encoded without special tokens)."""

    decode: TextDecoder
    count_tokens: Callable[[str], int]


def load_text_codec(model_path: str) -> TextCodec | None:
    """A ``TextCodec`` for the model's ``tokenizer.json`` (the file the frontend loads), or None."""
    path = os.path.join(model_path, "tokenizer.json")
    if not os.path.isfile(path):
        logger.warning("no %s: the frontend will detokenize (and may hit its UTF-8 panic)", path)
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        logger.warning("the tokenizers package is missing: the frontend will detokenize")
        return None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
        logger.warning("cannot load %s (%s): the frontend will detokenize", path, exc)
        return None

    def decode(ids: Sequence[int], skip_special_tokens: bool) -> str:
        return str(tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def count_tokens(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return TextCodec(decode=decode, count_tokens=count_tokens)


def load_text_decoder(model_path: str) -> TextDecoder | None:
    """A ``TextDecoder`` for the model's ``tokenizer.json`` (the file the frontend loads), or None."""
    codec = load_text_codec(model_path)
    return None if codec is None else codec.decode
