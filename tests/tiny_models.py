"""Tiny random-weight models saved as local HF model directories (fast: no SmolLM2 load), shared by test modules.

``build_tiny_model`` writes a random Llama (4 layers unless told) with
``tiny_tokenizer``: byte-level, 259 tokens (3 chat specials and the 256
bytes, no merges, so any text encodes without a download) and a ChatML
template like SmolLM2's.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A byte-level PreTrainedTokenizerFast: ids 0-2 are <|endoftext|> (pad), <|im_start|> (bos), <|im_end|> (eos), then 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>", additional_special_tokens=specials
    )
    tok.chat_template = CHAT
    return tok


def build_tiny_model(d: Path, layers: int = 4, hidden: int = 64, context: int = 2048, weight_std: float | None = None) -> Path:
    """A random Llama (``layers`` deep, ``hidden`` wide, ``context`` positions) with ``tiny_tokenizer``, saved to ``d``.

    ``weight_std`` redraws every matrix from N(0, weight_std): with transformers' small default init a
    259-token model says the same few bytes whatever the prompt; 0.5 makes its outputs follow the prompt.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg)
    if weight_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, weight_std)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def write_prompts(path: Path, n_per_cat: int = 1, cats=("writing", "qa", "summarization")) -> Path:
    """A Spec-Bench style JSONL file with repetitive prompts (n-gram lookup finds matches in them)."""
    lines, qid = [], 100
    for c in cats:
        for i in range(n_per_cat):
            qid += 1
            text = f"Topic {c} {i}: repeat the words {c} {c} {c} and then say {c} again."
            lines.append(json.dumps({"question_id": qid, "category": c, "turns": [text, "a second turn"]}))
    path.write_text("\n".join(lines) + "\n")
    return path
