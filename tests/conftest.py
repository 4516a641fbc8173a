"""Shared fixtures: a tiny random-weight Llama (fast unit tests) and the real SmolLM2 (slow tests)."""

from __future__ import annotations

import pytest
import torch


def tiny_llama(vocab: int = 12, layers: int = 3, seed: int = 0, sharpness: float = 4.0):
    """A random Llama whose next-token distributions are peaked (not near-uniform).

    Random init gives almost uniform outputs, where every acceptance rule looks
    right; scaling the LM head makes draft and target disagree measurably.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
        model.lm_head.weight.mul_(sharpness / 4)
    model.requires_grad_(False)
    return model


@pytest.fixture(scope="module")
def one_thread():
    """Tiny-model forwards are dominated by thread start-up; two threads on a busy 2-core machine are 40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm2_fp32():
    from decoding.models import load_model

    return load_model("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_fp32):
    """A 2-layer random model with SmolLM2's tokenizer, saved as a local HF model directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-smol")
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=smollm2_fp32.model.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=smollm2_fp32.tokenizer.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(out)
    smollm2_fp32.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def long_prompt_and_ar(smollm2_fp32):
    """A Spec-Bench long-context prompt of 1.1-1.2K tokens (chat template included) and AR's 32 greedy float32 tokens."""
    from decoding.config import SpecConfig
    from decoding.engine import SpecDecoder
    from decoding.workloads import load_prompts, long_context_prompt

    ar = SpecDecoder(SpecConfig(dtype="float32", max_new_tokens=32, threads=1))
    prompt = long_context_prompt(load_prompts(), 1200, lambda text: ar.encode(text, chat=True).shape[1])
    ids = ar.encode(prompt.prompt, chat=True)
    assert 1100 <= ids.shape[1] <= 1200
    return ids, ar.generate_ids(ids).token_ids
