"""The serving layer's pure parts: request validation, text assembly, settings, catalog, metrics. No Ray."""

import json

import pytest

from cluster.registry import Entry, open_registry
from decoding.config import SpecConfig
from decoding.errors import ConfigError
from serving import protocol as P
from serving.catalog import Catalog, ModelNotFound
from serving.prometheus import ServingMetrics
from serving.settings import ServeSettings
from serving.textstream import TextAssembler


def err(fn, body):
    with pytest.raises(P.ApiError) as e:
        fn(body)
    return e.value


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi"}, "model"),
        ({"model": 3, "prompt": "hi"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "  "}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "hi", "max_tokens": "10"}, "max_tokens"),
        ({"model": "m", "prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"model": "m", "prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "hi", "n": 2}, "n"),
        ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "hi", "stop": [1]}, "stop"),
        ({"model": "m", "prompt": "hi", "seed": 1.5}, "seed"),
        ({"model": "m", "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
        ({"model": "m", "prompt": "hi", "logprobs": 3}, "logprobs"),
        ({"model": "m", "prompt": "hi", "echo": True}, "echo"),
    ],
)
def test_completion_validation_names_the_param(body, param):
    e = err(P.parse_completion, body)
    assert e.status == 400 and e.param == param, (e.param, e.message)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    assert e.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": ""}]}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ],
)
def test_chat_validation_names_the_param(body, param):
    e = err(P.parse_chat, body)
    assert e.status == 400 and e.param == param, (e.param, e.message)


def test_valid_requests_parse():
    c = P.parse_completion({"model": "m", "prompt": ["Hi"], "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 7, "n": 1})
    assert (c.prompt, c.max_tokens, c.temperature, c.stop, c.seed) == ("Hi", 5, 0.0, ["\n"], 7)
    ch = P.parse_chat(
        {
            "model": "m",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert ch.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert ch.stream and ch.include_usage and ch.max_tokens is None


def test_parse_body_rejects_non_objects():
    assert err(P.parse_body, b"{nope").code == "invalid_json"
    assert err(P.parse_body, b"[1, 2]").status == 400
    assert P.parse_body(b'{"a": 1}') == {"a": 1}


def test_sse_framing():
    assert P.sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert P.DONE == b"data: [DONE]\n\n"


# ---- text assembly -------------------------------------------------------------
def test_assembler_deltas_concatenate_to_the_decoded_text(smollm2_fp32):
    tok = smollm2_fp32.tokenizer

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    text = "Héllo wörld — naïve café ✓ 日本語のテキスト and emoji 🎉🎉 end."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    a = TextAssembler(decode)
    parts = [a.feed([i]) for i in ids] + [a.finish()]
    assert "".join(parts) == decode(ids)
    assert not any("\ufffd" in p for p in parts)  # a half character is never sent


def test_assembler_stops_and_never_leaks_a_stop_prefix(smollm2_fp32):
    tok = smollm2_fp32.tokenizer

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    ids = tok("one two three four five", add_special_tokens=False)["input_ids"]
    a = TextAssembler(decode, stops=["three f", "zzz"])
    sent = ""
    for i in ids:
        sent += a.feed([i])
        assert "three" not in sent
        if a.stopped:
            break
    sent += a.finish()
    assert a.stopped and sent == "one two "


# ---- settings ------------------------------------------------------------------
def test_settings_validate_and_round_trip():
    s = ServeSettings(registry="/x", max_ongoing_requests=3, num_replicas=2)
    assert ServeSettings.from_dict(json.loads(s.to_json())) == s
    assert s.model_deployment_options()["num_replicas"] == 2 and "autoscaling_config" not in s.model_deployment_options()
    assert ServeSettings().model_deployment_options()["autoscaling_config"]["max_replicas"] >= 1
    assert s.ingress_deployment_options()["max_ongoing_requests"] > s.max_queued_requests
    for bad, field in [({"max_ongoing_requests": 0}, "max_ongoing_requests"), ({"dtype": "float16"}, "dtype"), ({"nope": 1}, "nope")]:
        with pytest.raises(ConfigError) as e:
            ServeSettings.from_dict(bad)
        assert e.value.field == field
    with pytest.raises(ConfigError, match="max_queued_requests"):
        ServeSettings(max_queued_requests="10")


# ---- catalog -------------------------------------------------------------------
def test_catalog_serves_entries_and_plain_ids_and_skips_corrupt(tmp_path):
    reg = open_registry(tmp_path)
    reg.put(Entry("m/chat/ngram", SpecConfig(method="ngram", model="some-model", k=5), metrics={"speedup": 1.4}))
    reg.entry_path("m/chat/broken").write_text(json.dumps({"name": "m/chat/broken", "config": {"method": "medusa"}}))
    cat = Catalog(str(tmp_path), base_model="base-model", dtype="float32", watch=False)
    names = [m.name for m in cat.models()]
    assert names == ["m/chat/ngram", "base-model", "some-model"]
    assert cat.resolve("m/chat/ngram").config.k == 5
    ar = cat.resolve("some-model").config
    assert (ar.method, ar.model, ar.dtype) == ("ar", "some-model", "float32")
    assert "m/chat/broken" in cat.corrupt and "medusa" in cat.corrupt["m/chat/broken"]
    with pytest.raises(ModelNotFound, match="corrupt"):
        cat.resolve("m/chat/broken")
    with pytest.raises(ModelNotFound):
        cat.resolve("nope")
    # a new entry is found on an unknown name without any explicit refresh
    reg.put(Entry("m/chat/new", SpecConfig(method="early-exit", model="some-model", exit_layer=2)))
    assert cat.resolve("m/chat/new").config.method == "early-exit"
    cat.close()


def test_catalog_watcher_picks_up_changes(tmp_path):
    import time

    reg = open_registry(tmp_path)
    reg.put(Entry("w/x/ngram", SpecConfig(method="ngram", k=2)))
    cat = Catalog(str(tmp_path), base_model="b", refresh_s=3600, watch=True)
    try:
        reg.put(Entry("w/x/ngram", SpecConfig(method="ngram", k=7)))
        deadline = time.monotonic() + 10
        while cat.lookup("w/x/ngram").config.k != 7 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cat.lookup("w/x/ngram").config.k == 7 and cat.lookup("w/x/ngram").version == 2
    finally:
        cat.close()


# ---- metrics -------------------------------------------------------------------
def test_metrics_ratios_and_live_speedup():
    from prometheus_client.parser import text_string_to_metric_families

    m = ServingMetrics()
    m.describe_model("b", "ar", "b", None, None)
    m.describe_model("b/x/ngram", "ngram", "b", 3, 1.6)
    m.observe_generation("b", "ar", 4, 10, 0.1, 1.0, {"target_forwards": 10, "wall_s": 1.0})
    m.observe_generation(
        "b/x/ngram", "ngram", 4, 10, 0.1, 0.5, {"drafted_tokens": 12, "accepted_tokens": 6, "target_forwards": 4, "wall_s": 0.5}
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples
    }
    assert samples[("specray_acceptance_rate", (("model", "b/x/ngram"),))] == 0.5
    assert samples[("specray_mean_accepted_tokens", (("model", "b/x/ngram"),))] == 3.0  # 9 decode tokens / 3 decode forwards
    assert samples[("specray_speedup_estimate", (("model", "b/x/ngram"), ("source", "registry")))] == 1.6
    assert samples[("specray_speedup_estimate", (("model", "b/x/ngram"), ("source", "live")))] == 2.0
    assert samples[("specray_time_per_output_token_seconds_count", (("model", "b"),))] == 1


@pytest.mark.cluster
def test_catalog_over_redis_follows_published_updates():
    import time

    from redis_server import redis_server

    with redis_server() as url:
        reg = open_registry(url)
        reg.put(Entry("r/x/ngram", SpecConfig(method="ngram", k=2, model="mm")))
        cat = Catalog(url, base_model="b", refresh_s=3600, watch=True)
        try:
            assert [m.name for m in cat.models()] == ["r/x/ngram", "b", "mm"]
            reg.put(Entry("r/x/ngram", SpecConfig(method="ngram", k=6, model="mm")))
            reg.put(Entry("r/y/sps", SpecConfig(method="sps", model="mm")))
            deadline = time.monotonic() + 10
            while (cat.lookup("r/x/ngram").config.k != 6 or cat.lookup("r/y/sps") is None) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cat.lookup("r/x/ngram").config.k == 6 and cat.lookup("r/y/sps").config.method == "sps"
            reg.delete("r/y/sps")
            deadline = time.monotonic() + 10
            while cat.lookup("r/y/sps") is not None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cat.lookup("r/y/sps") is None
        finally:
            cat.close()
            reg.close()


# ---- hostile bodies and the shared limits ------------------------------------------
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
        (b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}", "nests deeper"),
        (b'{"max_tokens": ' + b"9" * 5000 + b"}", "5000 digits"),
        (b'{"temperature": NaN}', "NaN"),
        (b'{"prompt": "hi \\ud800"}', "lone UTF-16 surrogate"),
        (b'{"\\udfff": 1}', "lone UTF-16 surrogate"),
        (b'{"messages": [{"content": "\\ud83d"}]}', "messages[0].content"),
        (b'{"prompt": "\xed\xa0\x80"}', "surrogate"),  # json decodes UTF-8 of a surrogate as one
    ],
)
def test_parse_body_refuses_hostile_json_with_a_400(raw, needle):
    e = err(P.parse_body, raw)
    assert e.status == 400 and needle in e.message, e.message


def test_the_cli_and_http_share_the_sampling_limits():
    from decoding.limits import check_sampling

    for field, bad in [("temperature", 2.5), ("temperature", -1), ("top_p", 0), ("top_k", -1), ("seed", -1), ("seed", 2**64)]:
        with pytest.raises(ConfigError) as cli:
            check_sampling(**{field: bad})
        http = err(P.parse_completion, {"model": "m", "prompt": "hi", field: bad})
        assert cli.value.field == field and http.param == field and http.status == 400
    for field, good in [("temperature", 2.0), ("top_p", 1.0), ("top_k", 0), ("seed", 2**63 - 1)]:
        check_sampling(**{field: good})
        assert getattr(P.parse_completion({"model": "m", "prompt": "hi", field: good}), field) == good
    schema = P.CompletionRequest.model_json_schema()["properties"]
    assert schema["temperature"]["anyOf"][0]["maximum"] == 2.0 and schema["seed"]["anyOf"][0]["maximum"] == 2**63 - 1


def test_top_k_is_applied_and_response_format_refused_rather_than_ignored():
    assert P.parse_completion({"model": "m", "prompt": "hi", "top_k": 5}).to_worker()["top_k"] == 5
    assert P.parse_completion({"model": "m", "prompt": "hi", "response_format": {"type": "text"}}).prompt == "hi"
    assert err(P.parse_completion, {"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}}).param == "response_format"


def test_error_types_follow_the_status():
    assert P.ApiError(405, "x").type == "invalid_request_error"
    assert P.ApiError(401, "x").type == "invalid_request_error"
    assert P.ApiError(413, "x").type == "invalid_request_error"
    assert P.ApiError(429, "x").type == "rate_limit_error"
    assert P.ApiError(500, "x").type == "server_error"


def test_response_builders_match_the_response_models():
    use = P.usage(3, 2)
    P.CompletionResponse.model_validate(P.completion_response("cmpl-1", "m", 1, "hi", "stop", use, {"method": "ar"}))
    P.ChatCompletionResponse.model_validate(P.chat_response("chatcmpl-1", "m", 1, "hi", "length", use, {}))
    P.ErrorResponse.model_validate(P.invalid("prompt", "bad").body())


def test_a_prompt_that_cannot_fit_is_known_before_tokenizing(smollm2_fp32):
    tok = smollm2_fp32.tokenizer
    longest = P.longest_token_chars(tok)
    assert 1 < longest < 200
    text = "a" * (100 * longest + 1)
    assert P.prompt_surely_exceeds(tok, len(text), 100)
    assert len(tok(text, add_special_tokens=False)["input_ids"]) > 100  # the bound is never wrong about that
    assert not P.prompt_surely_exceeds(tok, 100, 100)
