"""The pure benchmark parts: prompt files, run order, identity/margins, and the summary maths on a hand-built table."""

from __future__ import annotations

import json

import pytest
import torch

from decoding.model.adapter import ModelAdapter
from evaluation import bench_figures as bm
from evaluation.workloads import DEFAULT_PROMPTS, WorkloadError, load_prompts, parse_prompts, select

# ---- workloads ----------------------------------------------------------------------


def _line(qid, cat, text="hello"):
    return json.dumps({"question_id": qid, "category": cat, "turns": [text, "second turn"]})


def test_bundled_spec_bench_file_loads_with_its_categories():
    prompts = load_prompts()
    assert DEFAULT_PROMPTS.name == "question.jsonl"
    assert len(prompts) == 480
    cats = {p.category for p in prompts}
    assert {"summarization", "rag", "writing", "translation", "qa", "math_reasoning"} <= cats
    assert all(p.prompt == p.turns[0] and p.prompt.strip() for p in prompts)


def test_select_limits_per_category_in_file_order():
    prompts = parse_prompts([_line(i, c) for i, c in enumerate("aabbbca")])
    picked = select(prompts, ["b", "a"], limit=2)
    assert [p.question_id for p in picked] == [0, 1, 2, 3]  # file order, two of each
    assert [p.question_id for p in select(prompts, None, limit=1)] == [0, 2, 5]


@pytest.mark.parametrize(
    "lines, expected",
    [
        ([_line(1, "a"), "{not json"], "p.jsonl:2: not valid JSON"),
        ([_line(1, "a"), "", json.dumps({"question_id": 2, "turns": ["x"]})], "p.jsonl:3: missing field 'category'"),
        ([json.dumps({"question_id": 1, "category": "a", "turns": []})], "p.jsonl:1: turns must be a non-empty list"),
        ([json.dumps([1, 2])], "p.jsonl:1: expected a JSON object"),
        ([_line(1, "a"), _line(1, "b")], "p.jsonl:2: duplicate question_id 1 (first on line 1)"),
        ([_line(1, "a", "   ")], "p.jsonl:1: the first turn is empty"),
        (["", "  "], "p.jsonl: no prompts"),
    ],
)
def test_parse_errors_name_file_and_line(lines, expected):
    with pytest.raises(WorkloadError) as e:
        parse_prompts(lines, source="p.jsonl")
    assert str(e.value).startswith(expected)
    assert "\n" not in str(e.value)


def test_unknown_category_lists_the_known_ones(tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text(_line(1, "qa") + "\n" + _line(2, "rag") + "\n")
    with pytest.raises(WorkloadError, match=r"unknown category 'poetry'; known categories: qa, rag"):
        select(load_prompts(f), ["qa", "poetry"], source=str(f))
    with pytest.raises(WorkloadError, match="does not exist"):
        load_prompts(tmp_path / "missing.jsonl")


# ---- order and fidelity ----------------------------------------------------------------


def test_method_order_rotates_so_each_method_leads_equally():
    methods = ["ar", "sps", "ngram", "early-exit"]
    firsts = [bm.method_order(methods, i)[0] for i in range(8)]
    assert sorted(firsts) == sorted(methods * 2)
    assert all(sorted(bm.method_order(methods, i)) == sorted(methods) for i in range(8))


def test_first_divergence_and_dtype_tolerance():
    assert bm.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bm.first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert bm.first_divergence([1, 2, 3, 7], [1, 2, 3]) == 3
    margins = [3.0, 2.0, 0.25, 0.0]
    near_tie = bm.compare_to_reference([1, 2, 9], [1, 2, 3], margins, "bfloat16")
    assert near_tie == {"identical": False, "first_diff": 2, "margin": 0.25, "suspicious": False, "differ_share": 1 / 3}
    # the same divergence is a bug in float32, whose rounding is far finer
    assert bm.compare_to_reference([1, 2, 9], [1, 2, 3], margins, "float32")["suspicious"] is True
    assert bm.compare_to_reference([1, 2, 3], [1, 2, 3], margins, "float32")["identical"] is True


def _tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(cfg).eval()


def test_reference_margins_match_a_plain_hf_forward():
    model = _tiny_llama()
    prompt = torch.tensor([[5, 17, 33, 2, 8]])
    new = [11, 40, 40, 3]
    margins = bm.reference_margins(ModelAdapter(model), prompt, new)
    with torch.no_grad():
        logits = model(torch.cat([prompt, torch.tensor([new])], 1)).logits[0].float()
    top = logits.topk(2, dim=-1).values
    expected = (top[:, 0] - top[:, 1])[prompt.shape[1] - 1 : prompt.shape[1] - 1 + len(new)]
    assert len(margins) == len(new)
    assert margins == pytest.approx(expected.tolist(), abs=1e-4)
    assert all(m >= 0 for m in margins)


# ---- summary maths on a hand-built table ------------------------------------------------------


def _hand_table():
    g = bm.gen_row
    gens = [
        g("ar", 1, "A", new_tokens=10, wall_s=1.0, target_forwards=10),
        g("ar", 2, "B", new_tokens=20, wall_s=1.0, target_forwards=20),
        g("ngram", 1, "A", new_tokens=10, wall_s=0.5, target_forwards=5, identical=True),
        g("ngram", 2, "B", new_tokens=20, wall_s=2.0, target_forwards=12, identical=False, first_diff=3, margin=0.9, suspicious=True),
        g("ngram", 3, "B", new_tokens=99, wall_s=0.1, target_forwards=1, identical=True),  # no ar row: left out
        g("hf-plain", 1, "A", kind="peer", new_tokens=10, wall_s=2.0, identical=True),
        g("hf-plain", 2, "B", kind="peer", new_tokens=20, wall_s=2.0, identical=True),
    ]

    def s(pid, drafted, accepted, d, v):
        return {"method": "ngram", "prompt_id": str(pid), "category": "A", "repeat": 0, "worker": "local", "step": 0,
                "drafted": drafted, "accepted": accepted, "draft_s": d, "verify_s": v, "config": ""}  # fmt: skip

    steps = [s(1, 3, 3, 0.01, 0.02), s(1, 3, 1, 0.01, 0.04), s(2, 2, 0, 0.04, 0.03), s(3, 4, 4, 9.0, 9.0)]
    return gens, steps


def test_summary_maths_on_a_hand_built_table():
    gens, steps = _hand_table()
    s = bm.summarize_methods(gens, steps)
    assert s["methods_order"] == ["ar", "ngram", "hf-plain"]
    assert (s["runs_complete"], s["runs_incomplete"]) == (2, 1)
    ar, ng = s["methods"]["ar"], s["methods"]["ngram"]
    assert ar["tokens_per_s"] == pytest.approx(15.0)  # 30 tokens / 2 s
    assert ar["speedup"] == pytest.approx(1.0)
    assert ng["tokens_per_s"] == pytest.approx(12.0)  # 30 tokens / 2.5 s (prompt 3 left out)
    assert ng["speedup"] == pytest.approx(0.8)
    assert ng["speedup_per_prompt"] == pytest.approx({"n": 2, "min": 0.5, "p25": 0.875, "median": 1.25, "p75": 1.625, "max": 2.0})
    assert ng["mean_accepted_tokens"] == pytest.approx(7 / 3)  # (4 accepted + 3 steps) / 3 steps
    assert ng["acceptance_rate"] == pytest.approx(0.5)  # 4 / 8
    assert ng["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3, 1 / 2])
    assert ng["target_forwards_per_token"] == pytest.approx(17 / 30)
    assert ng["draft_ms_per_step"] == pytest.approx(20.0)
    assert ng["verify_ms_per_step"] == pytest.approx(30.0)
    assert ng["identity"]["compared"] == 2 and ng["identity"]["identical"] == 1
    assert ng["identity"]["fraction"] == pytest.approx(0.5)
    assert ng["identity"]["suspicious"] == 1
    assert ng["identity"]["divergences"] == [
        {"prompt_id": "2", "category": "B", "repeat": 0, "first_diff": 3, "margin": 0.9, "suspicious": True}
    ]
    assert ar["identity"] is None and ar["per_position_acceptance"] == []
    assert s["categories"]["A"]["ngram"]["speedup"] == pytest.approx(2.0)
    assert s["categories"]["B"]["ngram"]["speedup"] == pytest.approx(0.5)
    assert s["categories"]["B"]["hf-plain"]["speedup"] == pytest.approx(0.5)
    peer = s["peer"]
    assert peer["best_specray"] == "ar" and peer["best_peer"] == "hf-plain"
    assert peer["ar_vs_plain"] == pytest.approx(15.0 / 7.5)
    assert peer["best_vs_best"] == pytest.approx(2.0)


def test_summary_repeats_and_workers():
    g = bm.gen_row
    gens = [
        g("ar", 1, "A", repeat=0, worker="w0", new_tokens=10, wall_s=1.0),
        g("sps", 1, "A", repeat=0, worker="w0", new_tokens=10, wall_s=0.5),
        g("ar", 1, "A", repeat=1, worker="w1", new_tokens=10, wall_s=1.0),
        g("sps", 1, "A", repeat=1, worker="w1", new_tokens=10, wall_s=0.25),
    ]
    s = bm.summarize_methods(gens, [], order=["sps", "ar"])
    assert s["methods_order"] == ["sps", "ar"]
    assert s["repeats"] == 2 and s["prompts_complete"] == 1 and s["runs_complete"] == 2
    assert s["methods"]["sps"]["speedup"] == pytest.approx(20 / 0.75 / 10)
    assert s["methods"]["sps"]["speedup_per_repeat"]["min"] == pytest.approx(2.0)
    assert s["methods"]["sps"]["speedup_per_repeat"]["max"] == pytest.approx(4.0)
    assert s["workers"]["w0"]["sps"]["speedup"] == pytest.approx(2.0)
    assert s["workers"]["w1"]["sps"]["speedup"] == pytest.approx(4.0)
    assert s["peer"] is None


def test_a_peer_run_in_fewer_repeats_is_compared_with_ar_on_those_runs():
    """--peer-repeats 1: the HF mode ran in repeat 0 only; the specray methods' repeats all count, and the peer is
    divided by AR's rate on repeat 0, not on all of AR's runs."""
    g = bm.gen_row
    gens = [
        g("ar", 1, "A", repeat=0, new_tokens=10, wall_s=1.0),
        g("sps", 1, "A", repeat=0, new_tokens=10, wall_s=0.5),
        g("hf-plain", 1, "A", kind="peer", repeat=0, new_tokens=10, wall_s=5.0),
        g("ar", 1, "A", repeat=1, new_tokens=10, wall_s=2.0),  # a slow repeat of AR: the peer never saw it
        g("sps", 1, "A", repeat=1, new_tokens=10, wall_s=1.0),
    ]
    s = bm.summarize_methods(gens, [])
    assert s["runs_complete"] == 2 and s["runs_incomplete"] == 0 and s["prompts_complete"] == 1
    assert s["methods"]["sps"]["speedup"] == pytest.approx(2.0)
    assert s["methods"]["hf-plain"]["speedup"] == pytest.approx(0.2)  # 2 tok/s over AR's 10 on repeat 0 (not 20/3)
    assert s["methods"]["hf-plain"]["speedup_per_repeat"] is None and s["methods"]["hf-plain"]["prompts"] == 1
    cat = s["categories"]["A"]
    assert cat["hf-plain"]["speedup"] == pytest.approx(0.2) and cat["sps"]["speedup"] == pytest.approx(2.0)
    assert (cat["ar"]["prompts"], cat["ar"]["runs"]) == (1, 2)


def test_summary_needs_the_baseline():
    with pytest.raises(ValueError, match="baseline"):
        bm.summarize_methods([bm.gen_row("sps", 1, "A", new_tokens=1, wall_s=1.0)], [])
    empty = bm.summarize_methods([], [])
    assert empty["methods"] == {} and empty["runs_complete"] == 0


def test_gen_row_rejects_unknown_columns():
    with pytest.raises(KeyError, match="tokens"):
        bm.gen_row("ar", 1, "A", tokens=3)
