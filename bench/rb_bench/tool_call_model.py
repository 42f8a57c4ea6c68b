"""A small model that answers every chat turn with reasoning and a tool call, made without a download.

    python -m rb_bench.tool_call_model OUT --base TINY_MODEL_DIR

Random weights never write tool-call markup, and a chat agent's session (Miles' session server,
tool messages, ``finish_reason: tool_calls``) needs an engine that does, on every engine the
comparison runs (our reference engine on CPU, SGLang on GPU). This model is the tiny model of
``rollout-backends make-model`` with:

* the markup pieces (:data:`PIECES`) added to its tokenizer as one ordinary token each, and
  filler tokens up to a round vocabulary (every id decodes);
* every layer's ``o_proj`` and ``down_proj`` zero, so each position's output depends on its own
  token only (the residual stream stays the token's embedding);
* an untied ``lm_head`` whose row for token *b* points along the embedding of the token *a* that
  precedes it in the chain, with a logit of :data:`LOGIT` there (the other rows small random).

So from the last token of the chat template's generation prompt (``\\n`` after ``assistant``) the
greedy continuation is the chain ``<think>``, ``The tool knows.``, ``</think>``, ``\\n\\n``,
``<tool_call>``, the call's JSON, ``</tool_call>``, then ``<|endoftext|>`` (eos), whatever came
before: the text SGLang's ``qwen3`` reasoning parser and ``qwen25`` tool-call parser read as
reasoning plus one ``get_weather`` call. The logits are real (bf16), so the logprobs are the
engine's own, small but not zero.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["CALL_ARGUMENTS", "PIECES", "TOOL", "make_tool_call_model"]

CALL_ARGUMENTS = '{"city": "Paris"}'
#: What the model writes after the generation prompt, one token each (then eos).
PIECES: tuple[str, ...] = (
    "<think>",
    "The tool knows.",
    "</think>",
    "\n\n",
    "<tool_call>",
    '\n{"name": "get_weather", "arguments": ' + CALL_ARGUMENTS + "}\n",
    "</tool_call>",
)
#: The tool the call names, as an agent declares it.
TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
#: The chain's logit at each step (the other logits stay within a few units of 0).
LOGIT = 16.0
VOCAB = 576
_EOS = 0


def _chain_ids(tok: Any) -> list[int]:
    """The trigger (the generation prompt's last token), the pieces' ids, eos."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    trigger = tok.encode(prompt, add_special_tokens=False)[-1]
    ids = [int(tok.convert_tokens_to_ids(p)) for p in PIECES]
    if len(set(ids)) != len(ids) or trigger in ids:
        raise RuntimeError(f"the pieces are not distinct single tokens: {ids} (trigger {trigger})")
    return [int(trigger), *ids, _EOS]


def _tokenizer(base: Path, out: Path) -> tuple[Any, list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_tokens(list(PIECES))
    tok.add_tokens([f"<tool_model_filler_{i}>" for i in range(VOCAB - len(tok))])
    if len(tok) != VOCAB:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, wanted {VOCAB}")
    tok.save_pretrained(str(out))
    for text in PIECES:  # each piece encodes to its own token and decodes back
        if tok.decode(tok.encode(text, add_special_tokens=False)) != text:
            raise RuntimeError(f"piece {text!r} does not round-trip")
    return tok, _chain_ids(tok)


def _weights(base: Path, chain: list[int], seed: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(base / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    embed = weights["model.embed_tokens.weight"].float()
    std = float(embed.std())
    extra = torch.empty(VOCAB - embed.shape[0], embed.shape[1]).normal_(0.0, std, generator=gen)
    embed = torch.cat([embed, extra])
    hidden = embed.shape[1]
    lm_head = torch.empty(VOCAB, hidden).normal_(0.0, 0.02, generator=gen)
    for a, b in itertools.pairwise(chain):
        # The final RMSNorm scales the embedding to length sqrt(hidden): this row gives logit LOGIT.
        lm_head[b] += (LOGIT / math.sqrt(hidden)) * embed[a] / embed[a].norm()
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.embed_tokens.weight"] = embed.to(torch.bfloat16)
    weights["lm_head.weight"] = lm_head.to(torch.bfloat16)
    return {k: v.contiguous() for k, v in weights.items()}


def make_tool_call_model(out: str | Path, base: str | Path, *, seed: int = 0) -> Path:
    """Write the model into ``out`` from the tiny model in ``base``; returns ``out``."""
    from safetensors.torch import save_file

    base, out = Path(base), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _, chain = _tokenizer(base, out)
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    config.update(vocab_size=VOCAB, tie_word_embeddings=False)
    save_file(_weights(base, chain, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rb_bench.tool_call_model", description=__doc__.split("\n")[0])
    p.add_argument("out", help="output directory")
    p.add_argument("--base", required=True, help="a model made by `rollout-backends make-model` (size tiny)")
    ns = p.parse_args(argv)
    print(f"wrote {make_tool_call_model(ns.out, ns.base)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
