"""Trained drafter artifacts: ``drafter.safetensors`` (only the trained weights) + ``drafter.json`` (what it is).

The description names the recipe, its knobs, the target it was trained for
(name and :func:`~decoding.drafters.trained.model_fingerprint`), how the weights are
stored (``storage``: each matrix as its change from the target tensor it started
from, in ``bits``-bit groups of ``group``; see ``decoding.drafters.storage``) and
the training figures. Artifacts live in ``$SPECRAY_HOME/drafters/<name>`` or any directory;
``SpecConfig(method="trained", drafter=NAME_OR_PATH)`` loads one. Loading an
artifact for another target fails with a ``ConfigError`` on ``drafter``.

>>> # save_artifact(out_dir, "kangaroo", {"exit_layer": 10}, module, target_hf, "smollm2-135m", training={...})
>>> # art = load_artifact("kangaroo-smollm2", target_hf); drafter = art.drafter(confidence_threshold=0.3)
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.builders import builds
from decoding.drafters.base import Drafter
from decoding.drafters.draft_model import DraftModelDrafter, draft_model_adapter, first_layers_adapter, model_depth
from decoding.drafters.eagle import EagleDrafter, VocabHead
from decoding.drafters.early_exit import EarlyExitDrafter
from decoding.drafters.stop_head import EXIT_SOURCE, AcceptanceStop, StopHead, chain_drafting, exit_layers, stop_source_of
from decoding.drafters.storage import Storage, StorageError, bits_used, decode, encode, is_matrix
from decoding.drafters.trained import RECIPES, Recipe, TrimmedHead, get_recipe, trim_vocab
from decoding.errors import ConfigError
from decoding.model.adapter import ModelAdapter
from decoding.model.loading import model_fingerprint
from decoding.paths import specray_home
from decoding.trees.hardware import chooser_for
from decoding.trees.shapes import Dynamic, tree_shape

FORMAT = 2  # 2: matrices stored as quantised changes from the target's tensors (``storage``); 1: dense (still read)
READABLE = (1, 2)
WEIGHTS, DESCRIPTION = "drafter.safetensors", "drafter.json"


def drafters_home() -> Path:
    return specray_home() / "drafters"


def resolve_artifact(name: str) -> Path:
    """A directory holding drafter.json: ``name`` as a path, else ``$SPECRAY_HOME/drafters/<name>``, else a drafter
    shipped with specray (``shipped/<model>/<name>``, e.g. ``smollm2-135m/eagle``)."""
    for cand in (Path(name).expanduser(), drafters_home() / name, SHIPPED / name):
        if (cand / DESCRIPTION).is_file():
            return cand
    raise ConfigError("drafter", f"no trained drafter {name!r} (looked for {DESCRIPTION} in {name} and {drafters_home() / name})")


# The drafters trained for the bundled model ship in the package (each fingerprinted to its target): per model
# alias a folder of artifacts, the defaults of the methods that draft with a trained part.
SHIPPED = Path(__file__).resolve().parent / "shipped"
NO_DRAFTER = "none"  # drafter=none: a method that would use a shipped drafter by default runs without it


def shipped_artifact(model: str, name: str) -> str | None:
    """``<model>/<name>`` when specray ships that artifact for the model (``SHIPPED``; model aliases only), else None.

    >>> shipped_artifact("/some/model/dir", "eagle") is None
    True
    """
    if not _is_alias(model):
        return None
    return f"{model}/{name}" if (SHIPPED / model / name / DESCRIPTION).is_file() else None


def _is_alias(model: str) -> bool:
    """A model alias (``smollm2-135m``), not a path: only aliases have shipped drafters."""
    return bool(model) and "/" not in model and not model.startswith(".")


def shipped_exit_layers(model: str) -> list[int]:
    """The exit layers of the Kangaroo adapters shipped for ``model`` (``kangaroo-l<L>``), ascending."""
    if not _is_alias(model):
        return []
    layers = []
    for folder in (SHIPPED / model).glob("kangaroo-l*"):
        layer = folder.name.removeprefix("kangaroo-l")
        if layer.isdigit() and (folder / DESCRIPTION).is_file():
            layers.append(int(layer))
    return sorted(layers)


def default_drafter(cfg, name: str) -> str | None:
    """The artifact a method uses: ``cfg.drafter`` when set (None for ``none``), else the one shipped for the model."""
    if cfg.drafter == NO_DRAFTER:
        return None
    return cfg.drafter or shipped_artifact(cfg.model, name)


VOCAB_ORDER = "__vocab_order__"  # token ids by descending frequency in the training data (VocabTrim)


def save_artifact(
    out: Path,
    recipe: str,
    knobs: dict,
    module: torch.nn.Module,
    target_hf,
    target_name: str,
    training: dict,
    vocab: torch.Tensor | None = None,
    storage: Storage | None = None,
) -> Path:
    """Write weights and description atomically (a half-written artifact is never loaded), the weights in
    ``storage`` (default :class:`~decoding.drafters.storage.Storage`: each matrix as its change from the target's
    tensor, in the fewest bits within the error budget)."""
    from safetensors.torch import save_file

    storage = storage or Storage()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rec = get_recipe(recipe)
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    tensors, metadata = encode(state, base_state(rec, knobs, target_hf, state), storage)
    if vocab is not None:
        tensors[VOCAB_ORDER] = vocab.to(torch.int32).contiguous().cpu()
    save_file(tensors, str(out / (WEIGHTS + ".tmp")), metadata=metadata)
    os.replace(out / (WEIGHTS + ".tmp"), out / WEIGHTS)
    c = target_hf.config
    desc = {
        "format": FORMAT,
        "recipe": recipe,
        "knobs": knobs,
        "target": {
            "name": target_name,
            "fingerprint": model_fingerprint(target_hf),
            "num_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
        },
        "parameters": sum(t.numel() for t in state.values() if t.is_floating_point()),
        "storage": {**storage.to_dict(), "bits_used": bits_used(metadata), "bytes": (out / WEIGHTS).stat().st_size},
        "vocab_ranked": 0 if vocab is None else int(vocab.numel()),
        "training": training,
    }
    (out / (DESCRIPTION + ".tmp")).write_text(json.dumps(desc, indent=2, sort_keys=True, default=str))
    os.replace(out / (DESCRIPTION + ".tmp"), out / DESCRIPTION)
    return out


def base_state(recipe: Recipe, knobs: dict, target_hf, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors each matrix of a trained module started from: the module as ``recipe`` builds it from the target
    (a trimmed head: the target's head rows of the tokens in ``state``), for the matrices that are a function of the
    target; randomly initialised ones (they differ between two builds) and zero-initialised ones have none."""
    built = []
    for seed in (0, 1):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = recipe.build(target_hf, knobs)
        m.load_state_dict({k: v for k, v in state.items() if not v.is_floating_point()}, strict=False)  # token ids
        for head in m.modules():
            if isinstance(head, VocabHead):  # a trained head starts as the target's rows of its tokens
                head.reset(head.vocab)
        built.append({k: v.detach().cpu() for k, v in m.state_dict().items()})
    a, b = built
    return {k: v for k, v in a.items() if is_matrix(v) and torch.equal(v, b[k]) and bool(v.any())}


def stored_copy(module: torch.nn.Module, recipe: str, knobs: dict, target_hf, storage: Storage | None = None) -> torch.nn.Module:
    """A copy of ``module`` with the weights an artifact in ``storage`` loads back (what its drafter computes with):
    training evaluates it to record the agreement of the weights as stored."""
    import copy

    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    bases = base_state(get_recipe(recipe), knobs, target_hf, state)
    tensors, metadata = encode(state, bases, storage or Storage())
    loaded = decode(tensors, metadata, bases)
    out = copy.deepcopy(module)
    out.load_state_dict({k: v.to(state[k].dtype) for k, v in loaded.items()})
    return out


@dataclass
class Artifact:
    path: Path
    description: dict
    recipe: Recipe
    knobs: dict
    module: torch.nn.Module
    vocab: torch.Tensor | None = None  # VocabTrim ranking
    lm_head: torch.nn.Module | None = None

    @property
    def training_window(self) -> int | None:
        """The most tokens of context its training showed the drafter (its run's ``window``), None where not recorded."""
        window = ((self.description.get("training") or {}).get("spec") or {}).get("window")
        return int(window) if isinstance(window, int) and window > 0 else None

    def drafter(self, confidence_threshold: float = 0.0, draft_vocab: int = 0, tree=None):
        """The drafter; ``draft_vocab`` > 0 drafts over that many of the most frequent tokens (VocabTrim);
        ``tree`` (a ``trees.Tree`` or ``trees.Dynamic``) drafts token trees where the recipe can."""
        d = self.recipe.drafter(self.module, self.knobs, confidence_threshold, tree)
        if isinstance(d, EagleDrafter):  # it attends over no more context than its training showed it
            d.context = self.training_window
        if draft_vocab:
            if self.vocab is None:
                raise ConfigError("draft_vocab", f"{self.path} has no token ranking to trim the vocabulary with")
            d = trim_vocab(d, TrimmedHead(self.lm_head, self.vocab[:draft_vocab]))
        return d


def read_description(name: str) -> tuple[Path, dict]:
    path = resolve_artifact(name)
    try:
        desc = json.loads((path / DESCRIPTION).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("drafter", f"{path / DESCRIPTION} is not readable JSON ({e})") from None
    if not isinstance(desc, dict) or desc.get("format") not in READABLE or "recipe" not in desc or "target" not in desc:
        got = desc.get("format") if isinstance(desc, dict) else None
        raise ConfigError("drafter", f"{path / DESCRIPTION} is not a specray drafter description of format {FORMAT} (format {got})")
    return path, desc


def drafts_trees(name: str) -> bool:
    """Whether the artifact's recipe drafts token trees (Medusa, Hydra, distilled draft); reads only its description."""
    recipe = RECIPES.get(read_description(name)[1]["recipe"])
    return bool(recipe and recipe.drafts_trees)


_LOADED: dict[tuple, tuple[object, Artifact]] = {}  # the target is kept alive so its id() is never reused
_LOCK = threading.Lock()


def load_artifact(name: str, target_hf) -> Artifact:
    """Load a trained drafter for ``target_hf`` (a HF causal LM), in the target's dtype.

    Loads are cached per (artifact file, target object): forks of a decoder
    (one per request) share the read-only module and build only their drafter.
    """
    path, desc = read_description(name)
    weights = path / WEIGHTS
    key = (str(weights.resolve()), weights.stat().st_mtime_ns if weights.exists() else 0, id(target_hf))
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = (target_hf, _load(name, path, desc, target_hf))
        return _LOADED[key][1]


def _load(name: str, path: Path, desc: dict, target_hf) -> Artifact:
    fp = model_fingerprint(target_hf)
    want = desc["target"]
    if want.get("fingerprint") != fp:
        raise ConfigError(
            "drafter",
            f"{name!r} was trained for target {want.get('name')!r} (fingerprint {want.get('fingerprint')}), "
            f"not for this model (fingerprint {fp})",
        )
    recipe = get_recipe(desc["recipe"])
    knobs = recipe.check(desc.get("knobs", {}), target_hf.config.num_hidden_layers)
    module = recipe.build(target_hf, knobs)
    tensors, metadata = read_weights(path / WEIGHTS, desc["recipe"], knobs)
    vocab = tensors.pop(VOCAB_ORDER, None)
    vocab = None if vocab is None else vocab.long()
    try:
        state = decode(tensors, metadata, base_state(recipe, knobs, target_hf, tensors))
        module.load_state_dict(state)
    except (StorageError, RuntimeError) as e:
        raise ConfigError("drafter", f"{path / WEIGHTS} does not hold a {desc['recipe']} drafter with knobs {knobs}: {e}") from None
    dtype = target_hf.lm_head.weight.dtype
    module.to(device=target_hf.lm_head.weight.device, dtype=dtype).eval().requires_grad_(False)
    pack_like_target(module, target_hf)
    return Artifact(path, desc, recipe, knobs, module, vocab, target_hf.lm_head)


def pack_like_target(module: torch.nn.Module, target_hf) -> None:
    """Run a trained drafter's own matrices on the packed kernels of a target that runs packed weights (``quant``, a
    CPU): its decoder layers, a trimmed head (``VocabHead``) and EAGLE's input layers. A draft step over a few tokens
    is bound by the bytes of weights it reads; packed, it reads a quarter (4-bit) or half (int8) of bfloat16's.

    A one-layer drafter (EAGLE's head, a Kangaroo adapter) runs 4-bit groups like the target's layers; a deeper one
    (the distilled draft) int8 per channel, since 4-bit errors compound over its layers. Measured on the bundled
    model (6 Spec-Bench prompts, fixed k): EAGLE's draft 1.90 -> 1.11 ms a step at tau 1.249 -> 1.239; the
    distilled draft's 5.04 -> 2.97 ms at tau 1.374 -> 1.384 in int8, where 4-bit fell to tau 1.265.

    The weights as trained stay beside them (inputs of more than ``quant.MAX_ROWS`` rows run those): a drafter only
    proposes, so what it computes moves its acceptance, never the output. A dense target leaves the drafter dense."""
    quant = getattr(target_hf, "specray_quant", None)
    if quant is None or not hasattr(getattr(module, "model", None), "layers"):
        return
    from decoding.model.quant import pack_dense, quantize_model

    mode = quant.mode if len(module.model.layers) == 1 else "int8"
    weights = quantize_model(module, mode, overwrite=False, head=False)
    if isinstance(module.lm_head, VocabHead):
        module.lm_head.packed = pack_dense(module.lm_head.weight, mode, overwrite=False)
    elif module.lm_head is target_hf.lm_head:
        weights.head = quant.head  # the target's own head, already packed
    if isinstance(getattr(module, "packed", None), dict):  # EAGLE's fc layers
        for name in ("fc_features", "fc_in"):
            module.packed[name] = pack_dense(getattr(module, name).weight, mode, overwrite=False)
    module.specray_quant = weights  # read by the ModelAdapter made over the module (made after the load)


def read_weights(file: Path, recipe: str, knobs: dict) -> tuple[dict, dict]:
    """The tensors and metadata of a weights file; one line naming the file when it is missing or not safetensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error type for a corrupt or truncated file)
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError("drafter", f"{file} does not hold a {recipe} drafter with knobs {knobs}: {why}") from None


@builds("trained")
def _trained_drafter(cfg, target, device, memory):
    return load_artifact(cfg.drafter, target.model).drafter(cfg.confidence_threshold, cfg.draft_vocab, tree_shape(cfg))


def load_recipe_artifact(name: str, recipe: str, target_hf) -> Artifact:
    """An artifact that must be of ``recipe`` (one line naming it otherwise)."""
    art = load_artifact(name, target_hf)
    if art.recipe.name != recipe:
        raise ConfigError("drafter", f"{name!r} is a {art.recipe.name} drafter, not {recipe}")
    return art


def eagle_drafter(cfg, target, name: str | None = None):
    """The feature head (``decoding.drafters.eagle``) of ``name`` or the config's default; dynamic trees are sized by
    the measured verification cost when ``tree_fit=measured``."""
    name = name or default_drafter(cfg, "eagle")
    if name is None:
        hint = "train one (specray train-drafter --recipe eagle --data DIR) and set drafter="
        raise ConfigError("drafter", f"no eagle head ships for {cfg.model!r}; {hint}")
    drafter = load_recipe_artifact(name, "eagle", target.model).drafter(cfg.confidence_threshold, 0, tree_shape(cfg))
    if isinstance(drafter.tree, Dynamic):
        drafter.chooser = chooser_for(cfg, target)
    return drafter


@builds("eagle")
def _eagle_drafter(cfg, target, device, memory):
    return eagle_drafter(cfg, target)


def is_artifact(name: str | None) -> bool:
    """Whether ``name`` names a drafter artifact (a directory with drafter.json, or a shipped one)."""
    if not name:
        return False
    return any((cand / DESCRIPTION).is_file() for cand in (Path(name).expanduser(), drafters_home() / name, SHIPPED / name))


def draft_adapter(cfg, target, device) -> ModelAdapter:
    """The draft model of SpS, PEARL and TriForce's model bottom: ``draft_model`` (a local HF model directory, or a
    distilled-draft artifact), ``layers`` (the target's first ``draft_layers`` layers), or unset: the distilled draft
    shipped for the model when there is one, else the target's first layers."""
    name = cfg.draft_model
    if name == "layers" or (name is None and shipped_artifact(cfg.model, "distill") is None):
        return first_layers_adapter(cfg, target)
    if name is None or is_artifact(name):
        art = load_recipe_artifact(name or shipped_artifact(cfg.model, "distill"), "distill", target.model)
        return ModelAdapter(art.module)
    return draft_model_adapter(cfg, target, device)


@builds("sps", "pearl")
def _draft_model_drafter(cfg, target, device, memory) -> Drafter:
    """SpS (and PEARL in one process) with :func:`draft_adapter`'s draft."""
    return DraftModelDrafter(draft_adapter(cfg, target, device), cfg.confidence_threshold, tree=tree_shape(cfg))


@builds("early-exit")
def _early_exit_drafter(cfg, target, device, memory) -> Drafter:
    """The target's first ``exit_layer`` layers draft; through the Kangaroo adapter of that exit layer when one ships
    for the model (or ``drafter`` names one)."""
    shape, depth = tree_shape(cfg), model_depth(target)
    if cfg.exit_layer >= depth:
        raise ConfigError("exit_layer", f"must be below the model's {depth} layers, got {cfg.exit_layer}")
    name = default_drafter(cfg, f"kangaroo-l{cfg.exit_layer}")
    if name is None:
        return EarlyExitDrafter(cfg.exit_layer, cfg.confidence_threshold, tree=shape)
    art = load_recipe_artifact(name, "kangaroo", target.model)
    if art.knobs["exit_layer"] != cfg.exit_layer:
        raise ConfigError("drafter", f"{name!r} adapts exit layer {art.knobs['exit_layer']}, not exit_layer={cfg.exit_layer}")
    return art.drafter(cfg.confidence_threshold, 0, shape)


# ---- SpecDec++'s stop head (decoding/drafters/stop_head.py): its recipe, and the drafters that stop with it -----------
class StopRecipe(Recipe):
    """SpecDec++'s acceptance-prediction head (``decoding.drafters.stop_head``) for the drafter ``source``: a shipped or
    trained drafter artifact, or ``exit`` (the target's own head on intermediate layers: early exit, SWIFT, DEL). Not a
    drafter: a stop rule for one (``stop_threshold``, ``stop_head``). Trained on whether the source's top-1 agrees with
    the target's on the data (``training.objectives.stop_objectives``)."""

    name = "stop"
    knobs = {"source": EXIT_SOURCE, "hidden": 16}
    drafts = False

    def check(self, knobs, depth):
        unknown = sorted(set(knobs) - set(self.knobs))
        if unknown:
            raise ConfigError(unknown[0], f"not a knob of recipe {self.name!r}; knobs: {', '.join(self.knobs)}")
        out = {**self.knobs, **knobs}
        if not isinstance(out["source"], str) or not out["source"]:
            raise ConfigError("source", f"expected a drafter artifact name or {EXIT_SOURCE!r}, got {out['source']!r}")
        if not isinstance(out["hidden"], int) or isinstance(out["hidden"], bool) or out["hidden"] < 1:
            raise ConfigError("hidden", f"expected an integer >= 1, got {out['hidden']!r}")
        return out

    def data_layers(self, knobs, depth):
        if knobs["source"] == EXIT_SOURCE:
            return [*exit_layers(depth), depth]
        desc = read_description(knobs["source"])[1]
        source = get_recipe(desc["recipe"])
        return source.data_layers(source.check(desc.get("knobs", {}), depth), depth)

    def build(self, hf_model, knobs):
        return StopHead(knobs["hidden"], knobs["source"], hf_model)

    def drafter(self, module, knobs, confidence_threshold, tree=None):
        raise ConfigError("drafter", "a stop head is not a drafter: use it with stop_head=NAME and stop_threshold=H")


RECIPES[StopRecipe.name] = StopRecipe()


def stop_head_name(cfg, drafter) -> str:
    """``stop_head`` when set, else the head shipped for the model and the drafter (``stop-exit`` when the drafter has
    none of its own)."""
    if cfg.stop_head:
        return cfg.stop_head
    found = shipped_artifact(cfg.model, f"stop-{stop_source_of(drafter)}") or shipped_artifact(cfg.model, f"stop-{EXIT_SOURCE}")
    if found is None:
        hint = "train one (specray train-drafter --recipe stop --knob source=NAME --data DIR) and set stop_head="
        raise ConfigError("stop_head", f"no stop head ships for {cfg.model!r}; {hint}")
    return found


def with_stop_head(drafter, cfg, target):
    """The drafter with SpecDec++'s stop rule when ``cfg.stop_threshold`` > 0 (its ``confidence_threshold`` kept beside
    it); unchanged otherwise. Every model drafter drafts its chains through ``draft_chain`` with ``self.threshold``,
    which takes the rule in the float's place."""
    if drafter is None or not getattr(cfg, "stop_threshold", 0.0):
        return drafter
    if not chain_drafting(drafter) or not hasattr(drafter, "threshold"):
        raise ConfigError("stop_threshold", f"the stop head stops chains; the {drafter.name} drafter here drafts trees")
    head = load_recipe_artifact(stop_head_name(cfg, drafter), "stop", target.model).module
    drafter.threshold = AcceptanceStop(head, cfg.stop_threshold, cfg.confidence_threshold)
    return drafter
