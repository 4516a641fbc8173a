"""The table of methods (decoding/methods.py): one entry per method, and the outer layers consult it instead of names."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from decoding.config import METHODS, SpecConfig
from decoding.errors import ConfigError
from decoding.methods import (
    ACTOR_TRANSPORTS,
    METHOD_TABLE,
    SCHEDULES,
    TWO_SIDED_SCHEDULES,
    WORKER_ROLES,
    actor_methods,
    method_of,
    on_actors,
    runs_on_actors,
)

ROOT = Path(__file__).resolve().parents[2]
# the modules that used to answer "which methods run on actors, which knobs, which drafter" with string if-chains
CONSULTERS = [
    "decoding/in_process.py",
    "actors/driver.py",
    "actors/model_actor.py",
    "tuning/space.py",
    "tuning/resources.py",
    "serving/worker.py",
    "jobs/generate.py",
]


def test_every_method_has_one_entry_named_after_it():
    import decoding.in_process  # noqa: F401  (imports the drafters' modules, which register their builders)
    from decoding.builders import BUILDERS

    assert tuple(METHOD_TABLE) == METHODS and set(BUILDERS) == set(METHODS)  # a builder per method, none for others
    for name, entry in METHOD_TABLE.items():
        assert entry.name == name and entry.summary and callable(BUILDERS[name])
        assert entry.schedule in SCHEDULES
        SpecConfig(method=name, drafter="x" if entry.needs_drafter else None)  # every entry is a valid config


def test_an_unknown_method_fails_naming_the_field():
    with pytest.raises(ConfigError) as e:
        method_of("medusa")
    assert e.value.field == "method" and "medusa" in str(e.value) and "ngram" in str(e.value)
    with pytest.raises(ConfigError) as e:
        SpecConfig(method="medusa")
    assert e.value.field == "method"
    assert not runs_on_actors("medusa", "local") and not runs_on_actors(None, None)


def test_tunes_space_is_the_tables_knobs():
    from tuning.space import METHOD_KNOBS, NEEDS_LAYERS, SearchSpace, searchable_methods

    assert set(METHOD_KNOBS) == set(METHODS) and searchable_methods() == list(METHODS)
    for name, entry in METHOD_TABLE.items():
        assert [k.field for k in METHOD_KNOBS[name]] == [k.field for k in entry.knobs]
        assert [(k.kind, k.low, k.high, k.choices, k.step, k.log) for k in METHOD_KNOBS[name]] == [
            (k.kind, k.low, k.high, k.choices, k.step, k.log) for k in entry.knobs
        ]
        if entry.layer_knob:
            assert NEEDS_LAYERS[name] == entry.layer_knob and entry.layer_knob in {k.field for k in entry.knobs}
    # the depth-bounded knobs and the drop of layer methods on a one-layer model follow the entries
    space = SearchSpace.build(list(METHODS), depth=1, fixed=["drafter"])
    assert set(space.methods) == {m for m, e in METHOD_TABLE.items() if not e.layer_knob}


def test_actor_plans():
    assert actor_methods() == ("sps", "pearl", "triforce")
    for name in actor_methods():
        plan = on_actors(SpecConfig(method=name))
        assert plan.roles == WORKER_ROLES and plan.transports == ACTOR_TRANSPORTS
        assert plan.schedule_of(SpecConfig(method=name)) in TWO_SIDED_SCHEDULES
    assert on_actors(SpecConfig(method="sps")).schedule_of(None) == "sps"
    assert on_actors(SpecConfig(method="pearl")).schedule_of(None) == "pearl"
    tri = SpecConfig(method="triforce", triforce_schedule="pearl")
    assert on_actors(tri).schedule_of(tri) == "pearl" and on_actors(tri).ship_kv
    with pytest.raises(ConfigError, match="placement=actors runs sps, pearl and triforce, not 'ngram'") as e:
        on_actors(SpecConfig(method="ngram"))
    assert e.value.field == "placement"
    # pearl hosts actors whatever the placement; the others when asked to
    assert [m for m in METHODS if runs_on_actors(m, "local")] == ["pearl"]
    assert all(runs_on_actors(m, "actors") for m in METHODS)


def test_trial_resources_follow_the_table():
    from tuning.resources import bundles_for, hosts_actors

    assert [m for m in METHODS if hosts_actors({"method": m})] == ["pearl"]
    assert hosts_actors({"method": "sps", "placement": "actors"})
    assert len(bundles_for({"method": "triforce", "triforce": {"placement": "actors"}})) == 2


def test_the_table_builds_each_methods_drafter(tiny_model_dir):
    from decoding.drafters.draft_model import DraftModelDrafter
    from decoding.drafters.dynamic_exit import DynamicExitDrafter
    from decoding.drafters.ead import EadDrafter
    from decoding.drafters.early_exit import EarlyExitDrafter
    from decoding.drafters.hybrid import HybridDrafter
    from decoding.drafters.ngram import NgramDrafter
    from decoding.drafters.recycling import RecyclingDrafter
    from decoding.drafters.suffix import SuffixDrafter
    from decoding.in_process import build_drafter
    from decoding.model.loading import load_model
    from decoding.schedules.triforce import TriForceDrafter

    loaded = load_model(str(tiny_model_dir), "float32")  # 2 layers
    base = SpecConfig(model=str(tiny_model_dir), dtype="float32", exit_layer=1, draft_layers=1, tree_fit="budget")
    expected = {
        "ar": type(None),
        "sps": DraftModelDrafter,
        "pearl": DraftModelDrafter,
        "ngram": NgramDrafter,
        "early-exit": EarlyExitDrafter,
        "triforce": TriForceDrafter,
        "recycling": RecyclingDrafter,
        "suffix": SuffixDrafter,
        "hybrid": HybridDrafter,
        "del": DynamicExitDrafter,
        "ead": EadDrafter,
    }
    # trained and eagle need an artifact: tests/decoding/drafters/test_trained.py, test_eagle.py (none ships for this model);
    # swift skips intermediate layers, which a 2-layer model does not have (tests/decoding/drafters/test_seeds.py)
    assert set(expected) | {"trained", "eagle", "swift"} == set(METHODS)
    with pytest.raises(ConfigError, match="at least 3"):
        build_drafter(base.replace(method="swift"), loaded)
    with pytest.raises(ConfigError, match="no eagle head ships") as e:
        build_drafter(base.replace(method="eagle"), loaded)
    assert e.value.field == "drafter"
    for name, kind in expected.items():
        assert isinstance(build_drafter(base.replace(method=name), loaded), kind), name
    with pytest.raises(ConfigError, match="exit_layer"):
        build_drafter(base.replace(method="early-exit", exit_layer=2), loaded)
    with pytest.raises(ConfigError, match="draft_layers"):
        build_drafter(base.replace(method="sps", draft_layers=2), loaded)


def test_the_consulting_modules_compare_no_method_names():
    """The if-chains on method names are gone from the modules that now ask the table."""
    names = "|".join(re.escape(m) for m in METHODS)
    compare = re.compile(rf"method\s*(==|!=)\s*[\"']({names})[\"']|method\s+(not\s+)?in\s*[(\[{{]\s*[\"']({names})[\"']")
    hits = [
        f"{path}:{i}: {line.strip()}"
        for path in CONSULTERS
        for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if compare.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_shared_constants_are_defined_once():
    """Transports, worker roles, schedules, TriForce bottoms and GREEDY have one literal definition each."""
    names = ("TRANSPORTS", "ACTOR_TRANSPORTS", "ROLES", "WORKER_ROLES", "SCHEDULES", "TWO_SIDED_SCHEDULES")
    names += ("TRIFORCE_SCHEDULES", "TRIFORCE_BOTTOMS", "GREEDY")
    literal = re.compile(rf"^({'|'.join(names)})\s*=\s*(\(|SamplingParams\()", re.M)
    found = {}
    for path in sorted(ROOT.glob("*/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("tests/", ".")) or "/." in rel:
            continue
        for m in literal.finditer(path.read_text()):
            found.setdefault(m.group(1), []).append(rel)
    values = {"('target', 'draft')", "('calls', 'compiled')", "('sps', 'pearl')"}
    assert {repr(v) for v in (WORKER_ROLES, ACTOR_TRANSPORTS, TWO_SIDED_SCHEDULES)} == values
    assert all(len(paths) == 1 for paths in found.values()), found
    assert found["GREEDY"] == ["decoding/sampling.py"]


def test_the_table_stays_in_decoding_and_torch_free():
    tree = ast.parse((ROOT / "decoding/methods.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    outside = {m for m in imported if m.split(".")[0] not in ("decoding", "__future__", "collections", "dataclasses", "typing")}
    assert not outside, outside
    code = "import sys, decoding.config, decoding.methods; print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"  # the config (and the table it imports) load without torch or ray


# ---- a configuration: the common fields plus the options its method reads ---------------------------------------
def test_every_option_belongs_to_one_group_and_every_knob_to_its_methods_options():
    import dataclasses

    from decoding.config import COMMON, OPTION_DEFAULTS
    from decoding.methods import OPTION_GROUPS

    grouped = [name for names in OPTION_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(OPTION_DEFAULTS) and len(grouped) == len(set(grouped))
    fields = {f.name for f in dataclasses.fields(SpecConfig) if not f.name.startswith("_")}
    assert fields == set(COMMON) | set(OPTION_DEFAULTS)
    for entry in METHOD_TABLE.values():
        assert {k.field for k in entry.knobs} <= set(entry.fields), entry.name
        assert set(entry.defaults) <= set(entry.fields), entry.name


def test_a_config_serialises_its_methods_options_and_what_was_given():
    ngram = SpecConfig(method="ngram", k=6)
    assert "exit_layer" not in ngram.to_dict() and ngram.to_dict()["ngram_max"] == 3
    given = SpecConfig(method="ngram", exit_layer=10)  # given explicitly: kept, whatever the method
    assert given.to_dict()["exit_layer"] == 10 and given.replace(method="early-exit").exit_layer == 10
    assert set(SpecConfig().to_dict()) == {"method", "model", "temperature", "top_p", "top_k", "seed", "max_new_tokens"} | {
        "dtype",
        "quant",
        "compile",
        "threads",
        "device",
        "extra",
    }
    flat = {**SpecConfig(method="ngram").to_dict(), "exit_layer": 24, "triforce_budget": 1024, "placement": "local"}
    assert SpecConfig.from_dict(flat) == SpecConfig(method="ngram")  # a registry entry of the flat era reads the same


def test_per_method_defaults_apply_to_what_was_not_set():
    eagle = SpecConfig(method="eagle")
    assert (eagle.k, eagle.tree) == (3, "chain")
    assert (SpecConfig().k, SpecConfig(method="ngram").tree) == (4, "chain")  # other methods keep theirs
    assert SpecConfig().replace(method="eagle").k == 3  # a method change brings its defaults (k is 4 elsewhere)
    assert SpecConfig().with_overrides(["method=eagle"]).k == 3
    assert SpecConfig(k=5).replace(method="eagle").k == 5  # what the user set stays
    assert eagle.replace(method="ngram").k == 4  # leaving the method leaves its defaults
    assert SpecConfig(method="eagle", tree="levels").tree == "levels"
    assert SpecConfig().for_method("eagle").k == 3


def test_an_option_given_for_another_method_is_still_checked():
    with pytest.raises(ConfigError) as e:
        SpecConfig(method="ar", ngram_min=0)
    assert e.value.field == "ngram_min"
    with pytest.raises(ConfigError, match="unknown field"):
        SpecConfig.from_dict({"method": "ngram", "_given": []})
