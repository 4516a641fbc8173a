"""The OpenAI-compatible Serve app end to end: a real Ray Serve server, real HTTP clients (openai, httpx).

One server for the module (``server`` fixture in conftest.py). The last test kills
the model replica, so it stays last.
"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.registry import Entry
from decoding.config import SpecConfig

PROMPTS = [
    f"Item {i}: the {w} of the {v} is"
    for i, (w, v) in enumerate(
        [(w, v) for w in ("colour", "size", "age", "name") for v in ("sea", "sky", "road", "tree", "house", "river", "cloud", "stone")]
    )
]


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def cfg_of(server, name: str) -> SpecConfig:
    return server.registry.get(name).config


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)


def metric_samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def sse_events(raw: str) -> list:
    lines = [ln for ln in raw.split("\n") if ln.strip()]
    assert all(ln.startswith("data: ") for ln in lines), lines[:3]
    return [ln[len("data: ") :] for ln in lines]


# ---- models and the registry --------------------------------------------------------
def test_models_lists_registry_entries_and_plain_ids_but_not_corrupt(server):
    ids = [m.id for m in oai(server).models.list().data]
    assert ids[:3] == ["tiny/chat/ngram", "tiny/chat/sps", "tiny/long/ar"]
    assert server.tiny in ids and server.tiny_long in ids  # plain AR under the model id
    assert "tiny/chat/broken" not in ids
    with server.client() as c:
        row = next(m for m in c.get("/v1/models").json()["data"] if m["id"] == "tiny/chat/ngram")
        assert row["specray"]["method"] == "ngram" and row["specray"]["speedup"] == 1.5 and row["specray"]["config"]["k"] == 4
        health = c.get("/health").json()
    assert [x["name"] for x in health["registry"]["corrupt"]] == ["tiny/chat/broken"]
    assert "medusa" in health["registry"]["corrupt"][0]["error"]


def test_entry_added_or_changed_after_start_is_served_without_restart(server, in_process):
    client = oai(server)
    assert "tiny/late/early-exit" not in [m.id for m in client.models.list().data]
    server.registry.put(
        Entry("tiny/late/early-exit", SpecConfig(method="early-exit", exit_layer=1, k=2, dtype="float32", model=server.tiny))
    )
    # straight to a request for the new name (the unknown name triggers a registry re-read)
    out = client.completions.create(model="tiny/late/early-exit", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    ref = in_process.generate(cfg_of(server, "tiny/late/early-exit"), PROMPTS[0], 12)
    assert out.choices[0].text == ref["text"]
    assert out.model_extra["specray"]["method"] == "early-exit"
    assert "tiny/late/early-exit" in [m.id for m in client.models.list().data]
    # a changed entry: new version and config are served
    server.registry.put(
        Entry("tiny/late/early-exit", SpecConfig(method="early-exit", exit_layer=1, k=5, dtype="float32", model=server.tiny))
    )
    row = next(m for m in client.models.list().data if m.id == "tiny/late/early-exit")
    assert row.model_extra["specray"]["version"] == 2 and row.model_extra["specray"]["config"]["k"] == 5
    out = client.completions.create(model="tiny/late/early-exit", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert out.model_extra["specray"]["registry_version"] == 2


# ---- greedy outputs equal in-process generation --------------------------------------------
@pytest.mark.parametrize("name", ["tiny/chat/ngram", "tiny/chat/sps", "BASE"])
def test_completion_greedy_equals_in_process(server, in_process, name):
    model = server.tiny if name == "BASE" else name
    cfg = SpecConfig(method="ar", model=server.tiny, dtype="float32") if name == "BASE" else cfg_of(server, name)
    out = oai(server).completions.create(model=model, prompt=PROMPTS[1], max_tokens=20)
    ref = in_process.generate(cfg, PROMPTS[1], 20)
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ref["finish_reason"]
    assert out.object == "text_completion" and out.model == model and out.id.startswith("cmpl-")
    assert out.usage.completion_tokens == len(ref["token_ids"]) == 20
    assert out.usage.prompt_tokens == in_process.decoder(cfg).encode(PROMPTS[1]).shape[1]
    assert out.usage.total_tokens == out.usage.prompt_tokens + 20
    stats = out.model_extra["specray"]
    assert stats["method"] == cfg.method and stats["new_tokens"] == 20 and stats["target_forwards"] >= 1
    if cfg.method == "ar":
        assert stats["drafted_tokens"] == 0 and stats["mean_accepted_tokens"] == 1.0


def test_chat_greedy_equals_in_process_chat_template(server, in_process):
    out = oai(server).chat.completions.create(
        model="tiny/chat/ngram", messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=16, temperature=0
    )
    ref = in_process.generate(cfg_of(server, "tiny/chat/ngram"), "Tell me about rivers.", 16, chat=True)
    assert out.choices[0].message.content == ref["text"] and out.choices[0].message.role == "assistant"
    assert out.object == "chat.completion"
    assert (
        out.usage.prompt_tokens == in_process.decoder(cfg_of(server, "tiny/chat/ngram")).encode("Tell me about rivers.", chat=True).shape[1]
    )
    # a conversation with a system message goes through the template too (SmolLM2's replaces its default system prompt)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers."}]
    multi = oai(server).chat.completions.create(model="tiny/chat/ngram", messages=messages, max_tokens=4)
    tok = in_process.decoder(cfg_of(server, "tiny/chat/ngram")).tokenizer
    expected = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert multi.usage.prompt_tokens == len(expected) != out.usage.prompt_tokens and multi.usage.completion_tokens == 4


def test_streaming_completion_and_chat_equal_in_process(server, in_process):
    client = oai(server)
    cfg = cfg_of(server, "tiny/chat/sps")
    ref = in_process.generate(cfg, PROMPTS[2], 24)
    chunks = list(client.completions.create(model="tiny/chat/sps", prompt=PROMPTS[2], max_tokens=24, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref["text"]
    assert len(chunks) >= 3 and {c.id for c in chunks} == {chunks[0].id}
    assert chunks[-1].choices[0].finish_reason == "length" and all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].model_extra["specray"]["new_tokens"] == 24

    ref_chat = in_process.generate(cfg, "Hi there", 16, chat=True)
    chunks = list(
        client.chat.completions.create(
            model="tiny/chat/sps",
            messages=[{"role": "user", "content": "Hi there"}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref_chat["text"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16  # include_usage: a last usage-only chunk

    # the raw wire format: SSE events, the last one [DONE]
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny/chat/sps", "prompt": PROMPTS[2], "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_sampling_follows_the_seed_and_matches_in_process(server, in_process):
    client = oai(server)
    kw = dict(model="tiny/chat/ngram", prompt=PROMPTS[3], max_tokens=16, temperature=0.9, top_p=0.95)
    a = client.completions.create(seed=123, **kw).choices[0].text
    b = client.completions.create(seed=123, **kw).choices[0].text
    c = client.completions.create(seed=124, **kw).choices[0].text
    ref = in_process.generate(cfg_of(server, "tiny/chat/ngram").replace(temperature=0.9, top_p=0.95), PROMPTS[3], 16, seed=123)
    assert a == b == ref["text"]
    assert c != a


def test_stop_sequences_cut_the_text(server, in_process):
    cfg = cfg_of(server, "tiny/chat/ngram")
    ref = in_process.generate(cfg, PROMPTS[4], 30)["text"]
    stop = ref[len(ref) // 2 : len(ref) // 2 + 3]
    expected = ref[: ref.find(stop)]
    client = oai(server)
    out = client.completions.create(model="tiny/chat/ngram", prompt=PROMPTS[4], max_tokens=30, stop=[stop, "never-appears-xyz"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 30
    streamed = list(client.completions.create(model="tiny/chat/ngram", prompt=PROMPTS[4], max_tokens=30, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected and streamed[-1].choices[0].finish_reason == "stop"


# ---- errors -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}, "max_tokens", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature", None),
        ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "invalid_type"),
        ("/v1/completions", {"prompt": "hi", "n": 2}, "n", None),
        ("/v1/completions", {"prompt": 42}, "prompt", "invalid_type"),
        ("/v1/chat/completions", {"messages": []}, "messages", None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream", "invalid_type"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p", None),
    ],
)
def test_invalid_parameters_are_400_in_openai_shape(server, path, body, param, code):
    with server.client() as c:
        r = c.post(path, json={"model": "tiny/chat/ngram", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    if code:
        assert err["code"] == code


def test_openai_client_raises_typed_errors(server):
    client = oai(server)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny/chat/ngram", prompt="hi", max_tokens=0)
    assert e.value.status_code == 400 and e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no/such/model", prompt="hi", max_tokens=3)
    assert e.value.body["code"] == "model_not_found"


def test_unknown_corrupt_and_malformed_requests(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "no/such/model", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model" and r.json()["error"]["code"] == "model_not_found"
        r = c.post("/v1/chat/completions", json={"model": "tiny/chat/broken", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and "corrupt" in r.json()["error"]["message"]
        r = c.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        r = c.get("/v1/nowhere")
        assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---- metrics ------------------------------------------------------------------------------
def test_metrics_per_configuration(server):
    oai(server).completions.create(model="tiny/chat/ngram", prompt=PROMPTS[5], max_tokens=20)
    with server.client() as c:
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = metric_samples(r.text)
    m = (("model", "tiny/chat/ngram"),)
    assert s[("specray_requests_total", (("endpoint", "completions"), ("model", "tiny/chat/ngram"), ("status", "200")))] >= 1
    assert s[("specray_output_tokens_total", m)] >= 20
    assert s[("specray_prompt_tokens_total", m)] >= 1
    assert s[("specray_time_to_first_token_seconds_count", m)] >= 1 and s[("specray_time_to_first_token_seconds_sum", m)] > 0
    assert s[("specray_time_per_output_token_seconds_count", m)] >= 1
    assert 0.0 <= s[("specray_acceptance_rate", m)] <= 1.0
    assert s[("specray_mean_accepted_tokens", m)] >= 1.0
    assert s[("specray_draft_tokens_total", m)] >= s[("specray_accepted_draft_tokens_total", m)]
    assert s[("specray_speedup_estimate", (("model", "tiny/chat/ngram"), ("source", "registry")))] == 1.5
    assert s[("specray_tokens_per_second", m)] > 0
    # 400s are counted as such
    with server.client() as c:
        c.post("/v1/completions", json={"model": "tiny/chat/ngram", "prompt": "x", "max_tokens": -3})
        s2 = metric_samples(c.get("/metrics").text)
    assert s2[("specray_requests_total", (("endpoint", "completions"), ("model", "tiny/chat/ngram"), ("status", "400")))] >= 1


# ---- cancellation ---------------------------------------------------------------------------
def test_client_disconnect_stops_the_generation(server):
    max_tokens = 3000  # ~10+ s of work on this model if nothing stopped it
    with server.client() as c:
        with c.stream(
            "POST", "/v1/completions", json={"model": "tiny/long/ar", "prompt": "Count:", "max_tokens": max_tokens, "stream": True}
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = [json.loads(ln[len("data: ") :]) for ln in (next(lines) for _ in range(10)) if ln.startswith("data: ")]
            rid = events[0]["id"]
        # leaving the block closed the connection mid-stream
        t_closed = time.monotonic()

        def finished():
            rec = c.get(f"/v1/specray/requests/{rid}").json()
            return rec if rec.get("state") not in (None, "running") else None

        rec = wait_for(finished, timeout=30, what="the generation to stop")
        stopped_after = time.monotonic() - t_closed
        assert rec["state"] == "cancelled", rec
        assert len(events) <= rec["tokens"] < max_tokens // 3, rec  # it was generating, then it stopped
        time.sleep(1.0)  # and nothing keeps running afterwards
        again = c.get(f"/v1/specray/requests/{rid}").json()
        assert again["tokens"] == rec["tokens"]
        stats = c.get("/v1/specray/stats").json()
        assert stats["worker"]["active_generations"] == 0 and stats["worker"]["totals"]["cancelled"] >= 1
        s = metric_samples(c.get("/metrics").text)
        assert s[("specray_generations_cancelled_total", (("model", "tiny/long/ar"),))] >= 1
    print(f"\ncancelled after {rec['tokens']} of {max_tokens} tokens, stopped {stopped_after:.2f}s after the disconnect")


def test_admission_limit_answers_429_with_retry_after(server):
    limit = server.settings.max_queued_requests

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=limit + 8)) as ac:
            body = {"model": "tiny/long/ar", "prompt": "Count:", "max_tokens": 2000}
            hogs = [asyncio.create_task(ac.post("/v1/completions", json=body)) for _ in range(limit)]
            try:
                for _ in range(300):  # wait until the ingress holds all of them (/health does not queue behind the model)
                    inflight = (await ac.get("/health")).json()["ingress"]["inflight"]
                    if inflight >= limit:
                        break
                    await asyncio.sleep(0.1)
                assert inflight == limit and not any(t.done() for t in hogs)
                r = await ac.post("/v1/completions", json={**body, "max_tokens": 2})
                assert r.status_code == 429, r.text
                assert r.headers["retry-after"] == str(server.settings.retry_after_s)
                assert r.json()["error"]["code"] == "queue_full" and set(r.json()["error"]) == {"message", "type", "param", "code"}
            finally:
                for t in hogs:
                    t.cancel()
                await asyncio.gather(*hogs, return_exceptions=True)

    asyncio.run(scenario())
    with server.client() as c:
        # the disconnected requests give their slots back and their generations stop
        wait_for(lambda: c.get("/v1/specray/stats").json()["ingress"]["inflight"] == 0, timeout=60, what="slots to be released")
        wait_for(lambda: c.get("/v1/specray/stats").json()["worker"]["active_generations"] == 0, timeout=60, what="generations to stop")
        r = c.post("/v1/completions", json={"model": "tiny/chat/ngram", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        s = metric_samples(c.get("/metrics").text)
    assert s[("specray_admission_rejected_total", ())] >= 1


# ---- load ---------------------------------------------------------------------------------
def test_32_concurrent_streams_none_lost_or_mixed(server, in_process):
    names = ["tiny/chat/ngram", "tiny/chat/sps"]
    jobs = [(names[i % 2], PROMPTS[i]) for i in range(32)]
    max_tokens = 24
    refs = [in_process.generate(cfg_of(server, n), p, max_tokens)["text"] for n, p in jobs]
    assert len(set(refs)) == len(refs)  # distinct outputs, so a mix-up would show

    async def one(client, model, prompt):
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True)
        parts, ids = [], set()
        async for chunk in stream:
            ids.add(chunk.id)
            parts.append(chunk.choices[0].text)
        return "".join(parts), ids

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
        try:
            t0 = time.perf_counter()
            out = await asyncio.wait_for(asyncio.gather(*(one(client, m, p) for m, p in jobs)), timeout=240)
            return out, time.perf_counter() - t0
        finally:
            await client.close()

    with server.client() as c:
        before = c.get("/v1/specray/stats").json()["worker"]["engines"]
    results, wall = asyncio.run(run())
    assert len(results) == 32
    for (text, ids), ref, job in zip(results, refs, jobs, strict=True):
        assert len(ids) == 1, job
        assert text == ref, job
    assert len({next(iter(ids)) for _, ids in results}) == 32
    with server.client() as c:
        engines = c.get("/v1/specray/stats").json()["worker"]["engines"]
    key = f"{server.tiny}/float32"  # both configurations (ngram and sps) of the tiny model share its one batch
    steps = engines[key]["steps"] - before.get(key, {}).get("steps", 0)
    assert steps < 32 * max_tokens // 4, engines  # a step served many streams at once
    assert engines[key]["restarts"] == 0
    print(f"\nload: 32 streams x {max_tokens} tokens in {wall:.2f}s = {32 / wall:.2f} req/s, {32 * max_tokens / wall:.1f} tokens/s")


# ---- the real model ---------------------------------------------------------------------------
@pytest.mark.slow
def test_real_smollm2_greedy_through_http_equals_in_process(server, in_process):
    # registering an entry for SmolLM2 also serves the plain id "smollm2-135m" (AR, float32 as configured)
    server.registry.put(Entry("smollm2-135m/test/ngram", SpecConfig(method="ngram", k=4, dtype="float32")))
    client = oai(server)
    prompt = "Write one sentence about the sea."
    for model, cfg in [
        ("smollm2-135m", SpecConfig(method="ar", dtype="float32")),
        ("smollm2-135m/test/ngram", SpecConfig(method="ngram", k=4, dtype="float32")),
    ]:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0)
        ref = in_process.generate(cfg, prompt, 16, chat=True)
        assert out.choices[0].message.content == ref["text"], model
        assert out.usage.completion_tokens == len(ref["token_ids"])


# ---- health and replica replacement (keep last: it kills the model replica) ---------------------
def test_health_reports_a_dead_replica_and_its_replacement(server):
    import ray

    with server.client() as c:
        h = c.get("/health")
        assert h.status_code == 200 and h.json()["status"] == "ok"
        assert h.json()["deployments"]["ModelServer"]["running_replicas"] == 1

        actors = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ModelServer" in a["name"]]
        assert len(actors) == 1, actors
        ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=True)

        seen = wait_for(
            lambda: (h := c.get("/health")).status_code == 503 and h.json(), timeout=60, interval=0.1, what="/health to report it"
        )
        assert seen["status"] == "degraded" and any("ModelServer" in p for p in seen["problems"])
        wait_for(lambda: c.get("/health").status_code == 200, timeout=120, what="the replacement replica")
        now = [a for a in ray.util.list_named_actors(all_namespaces=True) if "ModelServer" in a["name"]]
        assert len(now) == 1 and now[0]["name"] != actors[0]["name"]
        r = c.post("/v1/completions", json={"model": "tiny/chat/ngram", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
