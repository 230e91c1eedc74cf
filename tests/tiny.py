"""Tiny offline stand-ins for a real model: a byte-level BPE tokenizer with a Qwen-style
chat template, and a randomly initialised 2-layer Qwen3, both built in-process.

Nothing is downloaded. Used by the pytest fixtures in conftest.py and by the benchmarks.
"""
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "Solve the problem. Write a short plan, then only Python code blocks.",
    "```python\nprint(1 + 1)\n```\n```output\n2\n```\n",
    "```python\nimport sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**2 - 1))\n```\n",
    "for a in range(1, 101):\n    for b in range(a + 1, 101):\n        s.add(a + b + a * b)\n",
    "The answer is \\boxed{70}. Let us enumerate all pairs and count them.",
    "Traceback (most recent call last):\nZeroDivisionError: division by zero\n",
    "How many integers n between 1 and 100 are divisible by 3 or 5? Compute the sum.",
    "def f(n):\n    return n * (n + 1) // 2\nassert f(10) == 55\nprint(len(s))\n",
]


def make_tokenizer(vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (any text encodes) with `<|im_end|>` as EOS and
    `<|endoftext|>` as pad, like Qwen2.5's, and a ChatML template."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def make_model(tokenizer, seed: int = 0, layers: int = 2, hidden: int = 64) -> Qwen3ForCausalLM:
    """A randomly initialised fp32 Qwen3 sized for CPU tests (about 0.1M parameters)."""
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=hidden // 4, max_position_embeddings=4096, tie_word_embeddings=True,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).float().eval()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(path, seed: int = 0) -> str:
    """Write a tiny model + tokenizer as a Hugging Face directory; returns the path."""
    tok = make_tokenizer()
    make_model(tok, seed).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)
