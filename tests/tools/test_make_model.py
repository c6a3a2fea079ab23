"""`python -m vattn make-model`: the small random-weight models it writes load
with transformers, tokenizer included, for every --arch; the tests' models
(workloads/vllm_scenario.py make-model) keep their shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vattn.cli.make_model import ARCHITECTURES, make_model

ROOT = Path(__file__).resolve().parents[2]
transformers = pytest.importorskip("transformers", reason='needs transformers: pip install -e ".[transformers]"')

TEXT = "The capital of France is Paris. Zebras éclair 42!"  # words the training text lacks encode too (bytes)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_arch_loads_with_its_tokenizer_and_runs(arch, tmp_path):
    import torch

    made = make_model(tmp_path, arch, layers=2, hidden=64, query_heads=4, kv_heads=2, max_positions=4096)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert config.max_position_embeddings == 4096 == tok.model_max_length
    assert len(tok) == config.vocab_size == made["vocab_size"] > 256  # every id the model samples decodes
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id == config.bos_token_id == 1 and tok.eos_token_id == config.eos_token_id == 2
    assert tok.decode(ids, skip_special_tokens=True) == TEXT  # byte-level: any text round-trips
    assert len(tok("The capital of France is")["input_ids"]) <= 6  # trained: common words are whole tokens
    chat = tok.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<s>user: Hello\nassistant:"
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(model).__name__ == ARCHITECTURES[arch][1]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size) and torch.isfinite(logits).all()
    assert made["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # K and V x layers x KV heads x head dim x bf16


def test_the_same_arguments_write_the_same_model(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_model(a, layers=1, hidden=32)
    make_model(b, layers=1, hidden=32)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_the_tests_models_keep_their_shape_and_have_no_tokenizer(tmp_path):
    # vllm_scenario.make_model's defaults: the test_vllm scenarios pass token ids 3..255, and TOKEN_BYTES
    # (tests/integrations/test_vllm.py) is this shape's KV bytes per token in fp32
    made = make_model(tmp_path, "llama", layers=2, hidden=128, query_heads=4, kv_heads=2, max_positions=1024,
                      vocab_size=256, tokenizer=False)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["vocab_size"] == 256 and config["head_dim"] == 32 and config.get("pad_token_id") is None
    assert not (tmp_path / "tokenizer.json").exists() and made["tokenizer"] is False
    assert made["kv_bytes_per_token"] // 2 * 4 == 1024  # bf16 bytes -> fp32 bytes: test_vllm's TOKEN_BYTES


def test_bad_shapes_are_refused_with_the_rule():
    with pytest.raises(ValueError, match="multiple of query_heads"):
        make_model("/nonexistent", hidden=100, query_heads=3)
    with pytest.raises(ValueError, match="gemma2 alternates"):
        make_model("/nonexistent", "gemma2", layers=3)
    with pytest.raises(ValueError, match="at least 259 tokens"):
        make_model("/nonexistent", vocab_size=200)
    with pytest.raises(ValueError, match="sliding_window must be at least 1 token, got -3"):
        make_model("/nonexistent", "mistral", sliding_window=-3)


def test_a_file_in_the_way_is_refused_not_reported_as_written(tmp_path):
    """The directory named is an existing file: an error, exit status 2, the file untouched (transformers'
    save_pretrained had only logged it, and the command said it wrote the model, exit status 0)."""
    target = tmp_path / "target"
    target.write_text("not a dir")
    out = subprocess.run([sys.executable, "-m", "vattn", "make-model", str(target), "--layers", "1", "--hidden", "32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "wrote" not in out.stdout, out.stdout
    assert out.stderr.strip() == f"python -m vattn make-model: error: {target} exists and is not a directory"
    assert target.read_text() == "not a dir"


def test_the_command_writes_a_model_and_says_what_it_is(tmp_path):
    out = subprocess.run([sys.executable, "-m", "vattn", "make-model", str(tmp_path / "m"), "--layers", "2",
                          "--hidden", "64"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "a random-weight llama model (2 layers, hidden 64" in out.stdout
    assert "context up to 4096 tokens" in out.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in (tmp_path / "m").iterdir()}
    bad = subprocess.run([sys.executable, "-m", "vattn", "make-model", str(tmp_path / "x"), "--layers", "0"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--layers must be >= 1" in bad.stderr


def test_the_command_line_imports_transformers_only_to_make_a_model():
    code = ("import sys, vattn.__main__, vattn.cli.make_model, vattn.integrations.vllm.cli; "
            "print(sorted(m for m in ('transformers', 'tokenizers', 'vllm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
