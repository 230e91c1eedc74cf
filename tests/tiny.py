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


# Chat templates that mimic the model families the project is used with (for the tests that
# check SFT ids against the engine's ids; only the structure around the turns matters).
FAMILY_TEMPLATES = {
    # Qwen2.5 / ChatML: what make_tokenizer() has
    "chatml": CHAT_TEMPLATE,
    # Qwen3-Thinking-2507: the generation prompt opens a think block; a past assistant turn is
    # rendered without its reasoning (the text up to </think> is stripped)
    "qwen3_thinking": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
        "{{ m['content'].split('</think>')[-1].lstrip('\\n') }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"),
    # Qwen3 (hybrid) with enable_thinking=False: an empty think block in the generation prompt,
    # and one added to the last assistant turn when a conversation is rendered
    "qwen3_no_thinking": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"),
    # Llama-3: a BOS, header tokens, trimmed contents, <|eot_id|> ends a turn (EOS is another id)
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    # nothing after the end-of-turn token
    "chatml_no_newline": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    # no end-of-turn token at all after an assistant turn: the tokenizer's EOS ends it
    "plain": ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant: {% endif %}"),
}


def make_family_tokenizer(family: str):
    """(tokenizer, template kwargs): make_tokenizer() with FAMILY_TEMPLATES[family] and the
    family's special tokens (Qwen3's <think> / </think>, Llama-3's BOS, headers and EOT)."""
    tok = make_tokenizer()
    tok.chat_template = FAMILY_TEMPLATES[family]
    if family.startswith("qwen3"):
        tok.add_tokens(["<think>", "</think>"])
    if family == "llama3":
        tok.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                                "additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>",
                                                              "<|eot_id|>"]})
    return tok, ({"enable_thinking": False} if family == "qwen3_no_thinking" else {})


def make_sp_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2 / Mistral-style SentencePiece tokenizer: '▁' marks a space (a word's
    leading space is part of its token: 'import math' is 'import' + '▁math'), a '▁' is
    prepended to the text, characters outside the vocabulary fall back to byte tokens
    <0xNN>, and the decoder strips the first leading space (Llama-2's tokenizer.json)."""
    from tokenizers import normalizers
    specials = ["<unk>", "<s>", "</s>"]
    ascii_ = [chr(i) for i in range(33, 127)]
    words = ["import", "print", "math", "python", "output", "boxed", "```", "pi"]
    vocab = ([(t, 0.0) for t in specials] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
             + [("▁", -3.0)] + [(p + w, -1.0) for w in words for p in ("", "▁")]
             + [(p + c, -2.0) for c in ascii_ for p in ("", "▁")])
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<unk>", chat_template=CHAT_TEMPLATE)


# Phi-3: role tags and <|end|> are special tokens; <|end|> ends every turn but is neither the
# EOS (<|endoftext|>) nor a generation-config EOS; a rendered conversation ends with the EOS
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")


def make_phi3_tokenizer():
    """make_tokenizer() with a Phi-3-like template and Phi-3's special tokens and EOS."""
    tok = make_tokenizer()
    tok.add_special_tokens({"eos_token": "<|endoftext|>",
                            "additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]})
    tok.chat_template = PHI3_TEMPLATE
    return tok
