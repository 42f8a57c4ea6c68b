"""Worker-side text cost per token: the library's chunk-level window vs the earlier per-token one,
on the tiny model's tokenizer (512 tokens) and on a Qwen2.5-sized one (151,936 tokens, written
by the reference engine's own tokenizer maker into a temporary folder).

    .venv/bin/python bench/probes/detok_bench.py
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.probes.per_token_detok import LIBRARY_CHUNK, chunk_per_token
from rollout_backends.adapters.dynamo._detok import IncrementalDetokenizer, load_text_decoder


def bench(decode, vocab: int, per_chunk: int, fn, tokens: int = 512, reps: int = 30) -> float:
    rng = random.Random(1)
    seqs = [
        [rng.randrange(3, min(vocab, 6000)) for _ in range(tokens)] for _ in range(reps)
    ]  # trained merges, not fillers
    times = []
    for ids in seqs:
        d = IncrementalDetokenizer(decode, [5, 6, 7])
        chunks = [ids[i : i + per_chunk] for i in range(0, len(ids), per_chunk)]
        t0 = time.perf_counter()
        for i, c in enumerate(chunks):
            fn(d, c, last=i == len(chunks) - 1)
        times.append((time.perf_counter() - t0) * 1e6 / len(ids))
    return statistics.median(times)


def main() -> None:
    from rollout_backends.adapters.reference import cached_tiny_model
    from rollout_backends.adapters.reference._model import _write_tokenizer

    big = Path(tempfile.mkdtemp(prefix="tok151k-"))
    _write_tokenizer(big, 151936)
    print("| tokenizer | tokens/chunk | per-token window (before) µs/token | chunk-level (library) µs/token |")
    print("|---|---|---|---|")
    for name, path, vocab in (
        ("tiny, 512", str(cached_tiny_model()), 512),
        ("Qwen2.5-sized, 151,936", str(big), 151936),
    ):
        decode = load_text_decoder(path)
        assert decode is not None
        bench(decode, vocab, 1, chunk_per_token)  # warm-up (the tokenizer's lazy caches)
        for k in (1, 4, 50):
            a = bench(decode, vocab, k, chunk_per_token)
            b = bench(decode, vocab, k, LIBRARY_CHUNK)
            print(f"| {name} | {k} | {a:.2f} | {b:.2f} |")


if __name__ == "__main__":
    main()
