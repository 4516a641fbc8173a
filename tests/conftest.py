"""Shared fixtures: a tiny random-weight Llama (fast unit tests) and the real SmolLM2 (slow tests); the test tiers.

Two markers hold what the fast tier (plain ``python -m pytest``) leaves out:
``slow`` (loads the real SmolLM2) and ``cluster`` (starts Ray, Serve, Tune or
Redis). A test that uses one of the fixtures below is marked here; a module
that loads the model or starts a cluster another way sets ``pytestmark``.
"""

from __future__ import annotations

import pytest
import torch

import kernels

# what the CLI, the workers and Serve replicas do first: every test runs the kernels they run, whatever its order
# (tests/kernels install them too); on CPUs with AVX512-BF16 the bundled model's 4-bit linears and attention run
# kernels/cpu_int4.py
kernels.install()

SLOW_FIXTURES = {"smollm2_fp32", "long_prompt_and_ar", "ar_greedy"}
CLUSTER_FIXTURES = {"local_ray", "workers", "server", "redis_url", "first_run"}
REDIS_STORE_PARAMS = {"store", "registry"}  # fixtures parametrized file/redis: the redis case starts a redis-server


@pytest.hookimpl(tryfirst=True)  # mark before -m deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        params = getattr(getattr(item, "callspec", None), "params", {})
        if used & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)
        if used & CLUSTER_FIXTURES or any(params.get(name) == "redis" for name in REDIS_STORE_PARAMS):
            item.add_marker(pytest.mark.cluster)


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


@pytest.fixture(scope="session", autouse=True)
def _specray_home(tmp_path_factory):
    """The tests' own ``$SPECRAY_HOME``: the calibrations, checkpoints and registries they write stay out of the
    user's. Only the converted bundled model (``models/``, a conversion of the GGUF that takes a while) is shared."""
    from decoding.paths import specray_home

    real = specray_home() / "models"
    real.mkdir(parents=True, exist_ok=True)
    home = tmp_path_factory.mktemp("specray-home")
    (home / "models").symlink_to(real, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECRAY_HOME", str(home))
        yield home


@pytest.fixture(autouse=True)
def _fast_tier_one_thread(request):
    """Fast-tier tests run torch on one thread (tiny forwards on a shared 2-core machine: 2 threads only contend)."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    from decoding.model.loading import load_model

    return load_model("smollm2-135m", "float32")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer random model (context 512) with the byte-level tiny tokenizer, saved as a local HF model directory."""
    from tiny_models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"), layers=2, hidden=32, context=512, weight_std=0.5)


@pytest.fixture(scope="session")
def ar_greedy(smollm2_fp32):
    """``ar_greedy(question, max_new_tokens)``: AR's greedy float32 new tokens for a Spec-Bench question (chat template).

    Each (question, length) is generated once per session, whichever module asks first.
    """
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder

    decoders, outputs = {}, {}

    def reference(question: dict, max_new_tokens: int) -> list[int]:
        key = (question["question_id"], max_new_tokens)
        if key not in outputs:
            if max_new_tokens not in decoders:
                decoders[max_new_tokens] = SpecDecoder(SpecConfig(dtype="float32", max_new_tokens=max_new_tokens))
            dec = decoders[max_new_tokens]
            outputs[key] = dec.generate_ids(dec.encode(question["turns"][0], chat=True)).token_ids
        return outputs[key]

    return reference


@pytest.fixture(scope="session")
def long_prompt_and_ar(smollm2_fp32):
    """A Spec-Bench long-context prompt of 1.1-1.2K tokens (chat template included) and AR's 32 greedy float32 tokens."""
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from evaluation.workloads import load_prompts, long_context_prompt

    ar = SpecDecoder(SpecConfig(dtype="float32", max_new_tokens=32, threads=1))
    prompt = long_context_prompt(load_prompts(), 1200, lambda text: ar.encode(text, chat=True).shape[1])
    ids = ar.encode(prompt.prompt, chat=True)
    assert 1100 <= ids.shape[1] <= 1200
    return ids, ar.generate_ids(ids).token_ids
