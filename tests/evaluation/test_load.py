"""The load harness (evaluation/load.py): its figures from request records and its README table."""

import pytest

from evaluation.load import LoadPlan, percentile, results_table, summarize_wave, update_readme


def test_wave_figures():
    reqs = [
        {"ok": True, "tokens": 10, "ttft_s": 0.5, "itl_s": [0.1, 0.1, 0.3]},
        {"ok": True, "tokens": 20, "ttft_s": 2.0, "itl_s": [0.2]},
        {"ok": False, "tokens": 0, "ttft_s": None, "itl_s": []},
    ]
    fig = summarize_wave(reqs, wall=2.0, slo_ttft=1.0, slo_itl=0.5)
    assert fig["completed"] == 2 and fig["requests"] == 3 and fig["tokens"] == 30
    assert fig["tokens_per_s"] == 15.0 and fig["requests_per_s"] == 1.0
    assert fig["goodput_tokens_per_s"] == 5.0  # only the first met the TTFT objective
    assert fig["ttft_p50_s"] == 1.25 and fig["itl_p99_s"] == pytest.approx(percentile([0.1, 0.1, 0.3, 0.2], 99))
    assert percentile([], 50) is None


def test_readme_block_is_rewritten_in_place(tmp_path):
    summary = {
        "model": "m",
        "dtype": "bfloat16",
        "threads": 2,
        "max_tokens": 8,
        "entries": {"ngram": {"k": 4, "adaptive_k": True}},
        "rows": [
            {
                "method": m,
                "concurrency": c,
                "tokens_per_s": t,
                "speedup_vs_batched_ar": t / a,
                "vs_one_stream_ar": a / 10.0,
                "ttft_p99_s": 0.5,
                "itl_p99_s": 0.1,
            }
            for c, a, n in [(1, 10.0, 14.0), (16, 60.0, 59.0)]
            for m, t in [("ar", a), ("ngram", n)]
        ],
        "in_process": {"specray_inprocess_ar": {"1": 11.0, "16": 70.0}, "hf_padded_generate": {"1": 10.0, "16": 50.0}},
    }
    table = results_table(summary)
    assert "| 16 | 60.0 | 59.0 | 0.98x | 6.00x | 0.50 | 100 | 1.40x |" in table
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- load-results -->\nold\n<!-- /load-results -->\n\nafter\n")
    update_readme(readme, summary, tmp_path / "load.png")
    text = readme.read_text()
    assert "old" not in text and table in text and text.endswith("after\n") and "ngram: k=4, adaptive_k=True" in text


def test_a_plan_sends_enough_prompts_and_refuses_nonsense():
    plan = LoadPlan([1, 3], min_requests=4)
    assert [plan.waves_of(c) for c in plan.levels] == [4, 2] and plan.prompts_needed == 6 and plan.mode == "sweep"
    poisson = LoadPlan([1, 2], rate=2.0, requests=5)
    assert poisson.levels == [5] and poisson.waves_of(5) == 1 and poisson.mode == "poisson@2.0"
    for bad in ({"rate": -1.0}, {"max_tokens": 0}, {"levels": [0]}):
        with pytest.raises(ValueError, match="must be"):
            LoadPlan(**{"levels": [1], **bad})


@pytest.mark.parametrize("usage", [True, False])
def test_any_openai_server_is_measured_as_a_peer(tiny_model_dir, usage):
    """A real OpenAI-compatible HTTP server (the tiny model behind tests_support.tiny_openai_server): the load harness
    finds its model, streams the same prompts to it and counts its tokens by usage, or by content chunks without."""
    import openai
    from tests_support import tiny_openai_server

    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder
    from evaluation.load import peer_base_url, peer_model, references, run_load

    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", threads=1))
    prompts = ["Name three colours.", "What is two plus two?", "Say hello."]
    reference = references(dec, [dec.encode(p, chat=True) for p in prompts], 6)
    with tiny_openai_server(tiny_model_dir, usage=usage) as url:
        client = openai.OpenAI(base_url=peer_base_url(url), api_key="unused", max_retries=0, timeout=60)
        assert peer_model(client) == "tiny-peer" and peer_model(client, "other") == "other"
        rows, requests = run_load(client, {"peer": "tiny-peer"}, prompts, LoadPlan([1, 3], max_tokens=6, min_requests=3), reference)
    assert [(r["method"], r["concurrency"], r["completed"]) for r in rows] == [("peer", 1, 3), ("peer", 3, 3)]
    assert all(r["mismatched"] == 0 and r["tokens"] > 0 for r in rows)  # float32 greedy AR of the same model
    assert all(r["usage"] is usage for r in requests)
    if usage:
        assert all(r["tokens"] == 6 or r["text"] == reference[r["index"]] for r in requests)


def test_a_peer_that_cannot_be_reached_is_a_config_error():
    import openai

    from cluster.runtime import free_port
    from decoding.errors import ConfigError
    from evaluation.load import peer_base_url, peer_model

    with pytest.raises(ConfigError, match="peer_url"):
        peer_base_url("ftp://x")
    client = openai.OpenAI(base_url=peer_base_url(f"http://127.0.0.1:{free_port()}"), api_key="x", max_retries=0, timeout=5)
    with pytest.raises(ConfigError, match="cannot list the peer's models"):
        peer_model(client)
