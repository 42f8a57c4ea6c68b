"""Make a small Qwen2-architecture model directory with seeded random weights.

The reference engine, the conformance suite and the GPU bring-up all need *the same* model on
every machine without downloading anything, so the model is made here from a seed: the weights
are drawn from a private ``torch.Generator`` (the caller's global RNG is left alone) and written
in a fixed order, so the same seed and torch version give a byte-identical ``model.safetensors``.

The tokenizer is a byte-level BPE trained on ``data/corpus.txt`` (shipped with the package, so it
does not depend on the machine) and padded with unreachable filler tokens to the model's vocab
size, so that every id the model can produce decodes to text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SIZES", "SPECIAL_TOKENS", "make_tiny_model"]

#: Model shapes by preset name. ``initializer_range`` is large for "tiny" so that random greedy
#: choices are rarely near-ties (which would make tolerance-based comparisons flaky).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "initializer_range": 0.2,
    },
    "qwen2.5-0.5b": {
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "initializer_range": 0.02,
    },
}

#: Special tokens; the trainer puts them first, so ``<|endoftext|>`` is id 0 (= bos = eos).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: The trainer never needs more merges than a 32 KB corpus can support; the rest is filler.
_MAX_TRAINED_VOCAB = 4096


def corpus_path() -> Path:
    """The shipped tokenizer training text."""
    return Path(__file__).with_name("data") / "corpus.txt"


def _config_dict(size: str, std: float) -> dict[str, Any]:
    from transformers import Qwen2Config

    shape = dict(SIZES[size])
    shape["initializer_range"] = std
    cfg = Qwen2Config(
        **shape,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        hidden_act="silu",
        use_sliding_window=False,
        dtype="bfloat16",
    )
    cfg.architectures = ["Qwen2ForCausalLM"]
    data: dict[str, Any] = cfg.to_dict()
    # Older transformers (4.x) and SGLang read ``torch_dtype``; newer read ``dtype``.
    data["dtype"] = data["torch_dtype"] = "bfloat16"
    # transformers 4.x (and SGLang's Qwen2 loader) read a top-level rope_theta, 5.x rope_parameters.
    data["rope_theta"] = 10000.0
    for noise in ("id2label", "label2id", "_name_or_path"):
        data.pop(noise, None)
    return data


def _weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Seeded weights in a fixed order: normal(0, std) matrices, zero biases, unit norms."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**config)
    with torch.device("meta"):
        skeleton = Qwen2ForCausalLM(cfg)  # only for the parameter names and shapes
    std = float(config["initializer_range"])
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Any] = {}
    # named_parameters() lists a tied lm_head once (as the embedding), like save_pretrained.
    for name, param in sorted(skeleton.named_parameters()):
        shape = tuple(param.shape)
        if name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif name.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.empty(shape).normal_(0.0, std, generator=gen)
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def _filler(i: int) -> str:
    # Printable ASCII decodes to itself under the byte-level decoder. No BPE merge produces these
    # strings (they are added after training), so encoding never yields them: "unreachable".
    return f"<filler_{i}>"


def _write_tokenizer(out: Path, vocab_size: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = corpus_path().read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, _MAX_TRAINED_VOCAB),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    n = len(vocab)
    i = 0
    while n < vocab_size:
        s = _filler(i)
        i += 1
        if s not in vocab:
            vocab[s] = n
            n += 1
    full = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=full,
        bos_token=SPECIAL_TOKENS[0],
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return int(full.get_vocab_size())


def make_tiny_model(
    path: str | os.PathLike[str],
    seed: int = 0,
    size: str = "tiny",
    init_std: float | None = None,
) -> Path:
    """Write ``config.json``, ``model.safetensors`` and a tokenizer to ``path``; return it.

    ``size`` is a key of :data:`SIZES`; ``init_std`` overrides the preset's init std. No
    ``generation_config.json`` is written: SGLang would merge its sampling defaults into chat
    requests, and every backend must see the same (explicit) sampling parameters.
    """
    from safetensors.torch import save_file

    if size not in SIZES:
        raise ValueError(f"unknown size {size!r} (known: {sorted(SIZES)})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    std = float(SIZES[size]["initializer_range"] if init_std is None else init_std)
    if not std > 0:
        raise ValueError(f"init_std must be > 0, got {std}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _config_dict(size, std)
    n_tok = _write_tokenizer(out, int(config["vocab_size"]))
    if n_tok != config["vocab_size"]:  # pragma: no cover - a broken tokenizers release
        raise RuntimeError(f"tokenizer has {n_tok} tokens, model vocab is {config['vocab_size']}")
    weights = _weights(config, seed)
    tmp = out / "model.safetensors.tmp"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.chmod(0o644)  # safetensors writes 0600; the directory is meant to be shared with servers
    tmp.replace(out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out
