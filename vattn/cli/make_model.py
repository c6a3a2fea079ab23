"""`python -m vattn make-model DIR`: a small random-weight model to try vattn with, made offline.

Writes a transformers checkpoint (config.json, model.safetensors,
generation_config.json) with random weights and, by default, a real
tokenizer: a byte-level BPE trained here on a short built-in English text
(``tokenizers``, which transformers depends on), saved so that
``AutoTokenizer.from_pretrained(DIR)`` and vLLM load it, with a chat template
for chat requests. Nothing is downloaded. The model's answers are gibberish
(its weights are random); what it is for is serving: vLLM and vattn's engine
load it, tokenize text, run every layer and return tokens.

transformers and tokenizers are imported only when a model is made, so
``python -m vattn`` stays light. Run it with the transformers of the
environment that will load the model (vLLM's own, for vLLM).
workloads/vllm_scenario.py and workloads/vllm_models.py make the vLLM tests' models with
:func:`save_random_weights` and :func:`model_config` too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ARCHITECTURES: dict[str, tuple[str, str]] = {
    # --arch: (transformers config class, model class); all decoder-only with GQA. Not qwen2: transformers'
    # AutoTokenizer loads a Qwen2Tokenizer for it, which adds a token past the model's vocabulary.
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
}

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""Ids 0, 1, 2 of every tokenizer written here: padding, beginning and end of a sequence."""
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
"""A plain "role: content" chat template, so /v1/chat/completions works as well as /v1/completions."""

TRAINING_TEXT = """\
The capital of France is Paris, and the capital of Italy is Rome.
A language model reads a prompt one token at a time and writes the next token.
Each layer keeps the keys and values of every token it has seen: that is the KV cache.
The cache grows with the context, so long prompts and many requests need a lot of memory.
Virtual memory lets a program reserve a large range of addresses and back only the pages it uses.
The operating system maps a physical page behind a virtual page when it is needed.
A request that has ten tokens needs a few pages; a request with ten thousand tokens needs many more.
When a request finishes, its pages go back to a pool and the next request can use them.
The quick brown fox jumps over the lazy dog. The lazy dog sleeps in the sun.
Once upon a time there was a small town by a river, with a bridge, a school and a market.
Every morning the baker opened the shop at six and sold bread, cakes and coffee.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 16 32 64 128 256 512 1024 2048 4096.
Questions and answers: What is the weather like today? It is sunny and warm.
How many days are there in a week? There are seven days in a week.
Which is larger, the sun or the moon? The sun is much larger than the moon.
Hello, how are you? I am fine, thank you. Good morning! Good night.
user: Write a short poem about the sea.
assistant: The sea is wide, the sea is deep, it sings the sailors all to sleep.
The server answers requests over HTTP; a client sends a prompt and reads the completion.
"""
"""What the tokenizer is trained on: everyday English, digits and a chat turn, so common words are one or
two tokens and any other text still encodes (byte-level: every byte is in the vocabulary)."""


def model_config(arch: str = "llama", *, layers: int = 4, hidden: int = 256, query_heads: int = 4,
                 kv_heads: int = 2, vocab_size: int = 1024, max_positions: int = 4096,
                 sliding_window: int | None = None, pad_token_id: int | None = PAD_ID) -> Any:
    """The transformers config of a small ``arch`` model: ``layers`` decoder
    layers of width ``hidden`` (MLP 2 x hidden), ``query_heads`` query heads
    and ``kv_heads`` KV heads of ``hidden // query_heads`` each,
    ``max_positions`` tokens of context (vLLM's derived max_model_len),
    beginning and end of sequence ids 1 and 2. ``sliding_window`` (tokens):
    mistral's window, gemma2's on every other layer (default: the whole
    context for mistral, 1024 for gemma2). ``pad_token_id=None`` leaves it
    out (as the tests' models do)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    if hidden % query_heads or query_heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of query_heads ({query_heads}), and query_heads "
                         f"a multiple of kv_heads ({kv_heads})")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
    import transformers

    head_dim = hidden // query_heads
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=query_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_positions, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    if pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    if arch == "mistral":
        kwargs["sliding_window"] = sliding_window
    elif arch == "gemma2":
        if layers % 2:
            raise ValueError(f"gemma2 alternates sliding-window and global layers: layers must be even, got {layers}")
        kwargs.update(sliding_window=sliding_window or min(1024, max_positions), query_pre_attn_scalar=head_dim,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    return getattr(transformers, ARCHITECTURES[arch][0])(**kwargs)


def save_random_weights(config: Any, path: str | Path, model_class: str | None = None, dtype: str = "bfloat16",
                        seed: int = 0) -> int:
    """Builds ``model_class`` (a transformers class name; default: the
    config's causal LM) from ``config`` with weights drawn from torch's
    generator seeded with ``seed``, casts it to ``dtype`` and saves it to
    ``path``. Returns the parameter count."""
    import torch
    import transformers

    torch.manual_seed(seed)  # the same seed and config give the same weights
    if model_class is None:
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = getattr(transformers, model_class)(config)
    model.to(getattr(torch, dtype)).save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def train_tokenizer(vocab_size: int, max_length: int) -> Any:
    """A byte-level BPE tokenizer of at most ``vocab_size`` tokens (ids 0-2:
    SPECIAL_TOKENS; it adds ``<s>`` in front of every text) trained on
    TRAINING_TEXT, as a transformers ``PreTrainedTokenizerFast`` that accepts
    ``max_length`` tokens. Deterministic: the same arguments give the same
    tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(SPECIAL_TOKENS):
        raise ValueError(f"a byte-level tokenizer needs at least {len(alphabet) + len(SPECIAL_TOKENS)} tokens "
                         f"(256 bytes and {len(SPECIAL_TOKENS)} special ones), got vocab_size={vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TRAINING_TEXT.splitlines(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=alphabet,
        show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=max_length)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(path: str | Path, arch: str = "llama", *, layers: int = 4, hidden: int = 256, query_heads: int = 4,
               kv_heads: int = 2, max_positions: int = 4096, vocab_size: int = 1024, dtype: str = "bfloat16",
               seed: int = 0, sliding_window: int | None = None, tokenizer: bool = True) -> dict[str, Any]:
    """Writes a random-weight ``arch`` model (see :func:`model_config` for the
    shape; ``max_positions`` in tokens) to ``path``, with a byte-level BPE
    tokenizer of at most ``vocab_size`` tokens unless ``tokenizer`` is False
    (then the model has ``vocab_size`` tokens and no tokenizer: callers pass
    token ids). With a tokenizer the model's vocabulary is the tokenizer's,
    so every id the model samples decodes. Returns what was written: arch,
    layers, hidden, heads, head_dim, vocab_size, max_positions, dtype,
    parameters, KV bytes per token (K and V of every layer, in ``dtype``),
    tokenizer (bool)."""
    import torch

    path = Path(path)
    if path.exists() and not path.is_dir():  # transformers only logs this and writes nothing
        raise ValueError(f"{path} exists and is not a directory")
    fast = None
    if tokenizer:
        fast = train_tokenizer(vocab_size, max_positions)
        vocab_size = len(fast)
    config = model_config(arch, layers=layers, hidden=hidden, query_heads=query_heads, kv_heads=kv_heads,
                          vocab_size=vocab_size, max_positions=max_positions, sliding_window=sliding_window,
                          pad_token_id=PAD_ID if tokenizer else None)
    params = save_random_weights(config, path, ARCHITECTURES[arch][1], dtype, seed)
    if fast is not None:
        fast.save_pretrained(str(path))
    head_dim = hidden // query_heads
    return dict(arch=arch, layers=layers, hidden=hidden, query_heads=query_heads, kv_heads=kv_heads,
                head_dim=head_dim, vocab_size=vocab_size, max_positions=max_positions, dtype=dtype,
                parameters=params, tokenizer=tokenizer,
                kv_bytes_per_token=2 * layers * kv_heads * head_dim * getattr(torch, dtype).itemsize)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``python -m vattn make-model``."""
    p.add_argument("dir", help="directory to write the model to (created; files in it are overwritten)")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama", help="architecture (default llama)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default 256; MLP 2x)")
    p.add_argument("--query-heads", type=int, default=4, help="query heads (default 4: head dim hidden / 4)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads (default 2)")
    p.add_argument("--max-positions", type=int, default=4096,
                   help="max_position_embeddings: the longest max_model_len vLLM accepts (default 4096 tokens)")
    p.add_argument("--vocab-size", type=int, default=1024, help="tokenizer vocabulary, at most (default 1024)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="dtype of the saved weights (default bfloat16; vLLM's --dtype can still choose)")
    p.add_argument("--sliding-window", type=int, default=None, help="tokens (mistral, gemma2)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")


def run(args: argparse.Namespace) -> int:
    """``python -m vattn make-model``: writes the model, says what it is and how to serve it."""
    for name in ("layers", "hidden", "query_heads", "kv_heads", "max_positions"):
        if getattr(args, name) < 1:
            print(f"python -m vattn make-model: error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"python -m vattn make-model needs transformers (and its tokenizers): pip install -e "
              f"\".[transformers]\", or run it with the Python of vLLM's environment ({e})", file=sys.stderr)
        return 1
    try:
        made = make_model(args.dir, args.arch, layers=args.layers, hidden=args.hidden, query_heads=args.query_heads,
                          kv_heads=args.kv_heads, max_positions=args.max_positions, vocab_size=args.vocab_size,
                          dtype=args.dtype, seed=args.seed, sliding_window=args.sliding_window)
    except ValueError as e:
        print(f"python -m vattn make-model: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.dir}: a random-weight {made['arch']} model ({made['layers']} layers, hidden {made['hidden']}, "
          f"{made['query_heads']} query / {made['kv_heads']} KV heads of {made['head_dim']}, "
          f"{made['parameters'] / 1e6:.1f}M parameters, {made['dtype']}), a byte-level BPE tokenizer of "
          f"{made['vocab_size']} tokens and a chat template; context up to {made['max_positions']} tokens; "
          f"{made['kv_bytes_per_token']} KV bytes per token. Its weights are random: it answers gibberish.")
    return 0
