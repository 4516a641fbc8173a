"""EAD is lossy by design, and says so everywhere a user sees it: generate's JSON, the bench's rows, summary and
tables (with its divergence from AR), the registry entry and /v1/models (only under a name that says lossy), and Tune
(never a winner unless asked, never a lossless one)."""

import json

import pytest

from cluster.registry import Entry, InvalidName, open_registry
from decoding.config import SpecConfig
from evaluation import bench_figures as bm
from evaluation.bench_report import report_rows, results_markdown

EAD = SpecConfig(method="ead", model="m")


def test_generate_json_says_lossy(tiny_model_dir, capsys):
    from jobs.generate import main

    args = ["--model", str(tiny_model_dir), "--prompt", "Tell me a story", "--max-new-tokens", "9", "--json", "--dtype", "float32"]
    assert main([*args, "--method", "ead", "--set", "draft_layers=1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["method"] == "ead" and out["lossy"] is True
    assert main([*args, "--method", "ngram"]) == 0
    assert json.loads(capsys.readouterr().out)["lossy"] is False


def test_registry_keeps_a_lossy_config_only_under_a_name_that_says_so(tmp_path):
    reg = open_registry(str(tmp_path))
    with pytest.raises(InvalidName, match="lossy"):
        Entry("m/chat/ead", EAD)  # every name that does not say lossy claims losslessness
    reg.put(Entry("m/chat/ead-lossy", EAD))
    stored = json.loads(reg.entry_path("m/chat/ead-lossy").read_text())
    assert stored["lossy"] is True and reg.get("m/chat/ead-lossy").lossy
    assert [(s.name, s.lossy) for s in reg.list()] == [("m/chat/ead-lossy", True)]
    assert Entry("m/chat/ngram", SpecConfig(method="ngram")).to_dict()["lossy"] is False


def test_serve_refuses_a_lossy_entry_under_a_lossless_name_and_labels_the_others(tmp_path):
    from serving.catalog import Catalog, ModelNotFound

    reg = open_registry(str(tmp_path))
    reg.put(Entry("m/chat/ead-lossy", EAD))
    # written by hand (or by an older specray) under a name that claims losslessness
    doc = Entry("m/chat/ead-lossy", EAD).to_dict() | {"name": "m/chat/fast", "version": 1}
    path = reg.entry_path("m/chat/fast")
    path.write_text(json.dumps(doc))
    cat = Catalog(str(tmp_path), base_model="m", dtype="float32", watch=False)
    rows = {m.name: m.describe()["specray"] for m in cat.models()}
    assert rows["m/chat/ead-lossy"]["lossy"] is True and rows["m"]["lossy"] is False
    assert "m/chat/fast" not in rows and "lossy" in cat.corrupt["m/chat/fast"]
    with pytest.raises(ModelNotFound, match="lossy"):
        cat.resolve("m/chat/fast")


def _rows():
    """AR and EAD on two prompts: EAD diverged at position 4 on the first (half its tokens differ) and not on the second."""
    gen = [
        bm.gen_row("ar", 1, "qa", new_tokens=10, wall_s=1.0),
        bm.gen_row("ar", 2, "qa", new_tokens=30, wall_s=3.0),
        bm.gen_row(
            "ead",
            1,
            "qa",
            new_tokens=10,
            wall_s=0.5,
            identical=False,
            first_diff=4,
            margin=3.0,
            lossy=True,
            differ_share=0.5,
            large_share=0.3,
        ),
        bm.gen_row("ead", 2, "qa", new_tokens=30, wall_s=1.0, identical=True, differ_share=0.0, large_share=0.1, lossy=True),
        bm.gen_row("ngram", 1, "qa", new_tokens=10, wall_s=0.8, identical=True, differ_share=0.0),
        bm.gen_row("ngram", 2, "qa", new_tokens=30, wall_s=2.0, identical=True, differ_share=0.0),
    ]
    return gen


def test_bench_measures_and_labels_the_divergence():
    rows = _rows()
    ead = rows[2]
    assert bm.compare_to_reference([1, 2, 3, 4, 9, 9], [1, 2, 3, 4, 5, 6], [5.0] * 6, "bfloat16", lossy=True) == {
        "identical": False,
        "first_diff": 4,
        "margin": 5.0,
        "suspicious": False,  # wide margin, but a lossy method diverges by design
        "differ_share": 2 / 6,
    }
    s = bm.summarize_methods(rows, [])
    m = s["methods"]
    assert m["ead"]["lossy"] and not m["ngram"]["lossy"] and m["ngram"]["divergence"] is None
    d = m["ead"]["divergence"]
    assert (d["first_diff_median"], d["never_diverged"], d["differ_share"]) == (4.0, 1, 0.125)
    assert d["large_share"] == pytest.approx((0.3 * 10 + 0.1 * 30) / 40)
    assert m["ead"]["speedup"] > m["ngram"]["speedup"] and ead["lossy"]
    head, table = report_rows(s)
    assert head[-3:] == ["first diff (med)", "differ", "large model"]
    row = {r[0]: r for r in table}["ead (LOSSY)"]
    assert row[-3:] == ["4", "12%", "15%"]
    md = results_markdown(s)
    assert "ead (LOSSY)" in md and "tokens that differ" in md


def test_bench_never_calls_a_lossy_method_the_best():
    rows = _rows() + [bm.gen_row("hf-plain", p, "qa", kind="peer", new_tokens=n, wall_s=n / 9) for p, n in ((1, 10), (2, 30))]
    s = bm.summarize_methods(rows, [])
    assert s["peer"]["best_specray"] == "ngram"  # ead is faster, but not lossless


def test_tune_never_picks_a_lossy_winner_unless_asked():
    from tuning.results import select_best
    from tuning.trainable import CANDIDATE, figures

    gen = [
        bm.gen_row("ar", 1, "qa", new_tokens=10, wall_s=1.0),
        bm.gen_row(
            CANDIDATE,
            1,
            "qa",
            new_tokens=10,
            wall_s=0.5,
            identical=False,
            first_diff=2,
            margin=2.0,
            lossy=True,
            differ_share=0.4,
            large_share=0.2,
        ),
    ]
    f = figures(gen, [], 1, EAD)
    assert f["lossy"] and not f["fidelity_ok"] and f["score"] == 0.0 and f["differ_share"] == 0.4 and f["large_share"] == 0.2
    lossless = {"valid": True, "fidelity_ok": True, "complete": True, "speedup": 1.3, "score": 1.3}
    lossy = {**f, "complete": True}
    assert select_best([lossless, lossy]) is lossless
    assert select_best([lossless, lossy], allow_lossy=True) is lossy  # 2.0x with --allow-lossy
    assert select_best([lossy]) is None
