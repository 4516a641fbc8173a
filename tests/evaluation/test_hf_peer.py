"""The Hugging Face peer's static-cache modes on a CPU (a tiny random model): transformers' fast mode decodes the same
greedy tokens as plain ``generate()``, and each cache bucket is warmed once, untimed."""

from __future__ import annotations

import pytest

from decoding.config import SpecConfig
from decoding.in_process import SpecDecoder

PROMPT = "the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def peer(tiny_model_dir):
    from evaluation.hf_peer import HFPeer

    cfg = SpecConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", k=3, draft_layers=1, exit_layer=1, threads=1)
    dec = SpecDecoder(cfg)
    return HFPeer(dec, cfg, modes=["hf-plain", "hf-static", "hf-static-prompt-lookup"]), dec


@pytest.mark.parametrize("mode", ["hf-static", "hf-static-prompt-lookup"])
def test_static_cache_modes_equal_plain_greedy(peer, mode):
    hf, dec = peer
    assert mode in hf.modes and "static" in hf.describe(mode)
    ids = dec.encode(PROMPT)
    want, _ = hf.generate("hf-plain", ids, 10)
    got, wall = hf.generate(mode, ids, 10)
    assert got == want == dec.generate_ids(ids, max_new_tokens=10).token_ids and wall > 0
    assert hf.static_len[mode] == 256  # the prompt and 10 tokens fit the smallest bucket


def test_static_cache_is_warmed_once_per_bucket(peer, monkeypatch):
    from evaluation import hf_peer

    hf, dec = peer
    calls = []
    generate = hf.model.generate

    def counting(*args, **kw):
        calls.append(kw["input_ids"].shape[1])
        return generate(*args, **kw)

    monkeypatch.setattr(hf.model, "generate", counting)
    hf.static_len.clear()
    ids = dec.encode(PROMPT)
    hf.generate("hf-static", ids, 6)
    hf.generate("hf-static", ids, 8)  # same bucket: no warm-up
    assert calls == [256 - 6, ids.shape[1], ids.shape[1]]
    long = dec.encode(PROMPT * 5)  # over 256 tokens with 40 new ones and the slack: the next bucket (512, the context)
    assert 256 < long.shape[1] + 40 + hf_peer.STATIC_SLACK <= 512
    hf.generate("hf-static", long, 40)
    assert calls[3:] == [512 - 40, long.shape[1]] and hf.static_len["hf-static"] == 512
    calls.clear()  # an assisted mode: the cache's size, then its own shapes, inside the slack
    hf.generate("hf-static-prompt-lookup", ids, 6)
    assert calls == [256 - 6, 256 - 6 - hf_peer.STATIC_SLACK, ids.shape[1]]
    assert hf_peer.static_bucket(1000) == 1024 and hf.model.config.max_position_embeddings == 512
