"""make_tiny_model: reproducible bytes, a tokenizer that covers the whole vocab, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_backends.adapters.reference import make_tiny_model
from rollout_backends.adapters.reference._model import SPECIAL_TOKENS, _write_tokenizer


def test_same_seed_gives_identical_bytes(model_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert (again / "config.json").read_text() == (model_dir / "config.json").read_text()
    assert (again / "tokenizer.json").read_text() == (model_dir / "tokenizer.json").read_text()


def test_other_seed_gives_other_weights(model_dir: Path, model_dir_b: Path) -> None:
    assert (model_dir / "model.safetensors").read_bytes() != (model_dir_b / "model.safetensors").read_bytes()


def test_config_and_weights(model_dir: Path) -> None:
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["eos_token_id"], cfg["bos_token_id"], cfg["max_position_embeddings"]) == (0, 0, 4096)
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (512, 256, 2, 64)
    assert not (model_dir / "generation_config.json").exists()
    weights = load_file(str(model_dir / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert "lm_head.weight" not in weights  # tied
    emb = weights["model.embed_tokens.weight"].float()
    assert emb.shape == (512, 256)
    assert 0.15 < float(emb.std()) < 0.25  # initializer_range 0.2 for "tiny"


def test_tokenizer_covers_vocab(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 512
    assert [tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS] == [0, 1, 2]
    assert tok.eos_token_id == 0
    text = "Question: Mara has 12 apples.\ndef add(x):\n    return x + 1\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    for i in range(512):
        assert tok.convert_ids_to_tokens(i) is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_filler_tokens_decode_and_are_unreachable(tmp_path: Path) -> None:
    """A vocab larger than the corpus supports is padded with tokens encoding never produces."""
    from transformers import AutoTokenizer

    from rollout_backends.adapters.reference._model import corpus_path

    n = _write_tokenizer(tmp_path, 5000)
    assert n == 5000
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 5000
    ids = tok(corpus_path().read_text())["input_ids"]
    fillers = [i for i in range(5000) if tok.convert_ids_to_tokens(i).startswith("<filler_")]
    assert fillers, "the corpus cannot support 5000 merges; fillers expected"
    assert not set(ids) & set(fillers)
    assert tok.decode([fillers[0]]) == "<filler_0>"


def test_unknown_size_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown size"):
        make_tiny_model(tmp_path, size="huge")


def test_cli(tmp_path: Path, model_dir: Path) -> None:
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "rollout_backends.adapters.reference.make_model", str(out), "--seed", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
