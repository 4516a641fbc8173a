"""Self-distillation data: the target's own greedy responses, with hidden states, as Parquet shards.

For each prompt the target generates a response (greedy, the one loop with no
drafter, i.e. method ``ar``); one more forward over prompt + response records
the hidden states the recipes need (layer l = output of the first l layers;
layer = depth is the last layer before the final norm). Hidden states of the
last ``window`` positions only are kept (training reads windows), as float16
bytes, so disk and memory stay bounded::

    DIR/part-00000.parquet   question_id, category, prompt_len, tokens, start, h<layer> (float16 [T-start, H])
    DIR/meta.json            written last: the data set is complete

Shards are written every ``shard_size`` prompts; an interrupted generation
resumes at the first missing shard. ``data_dir`` keys a cache under
``$SPECRAY_HOME/drafter-data`` by target fingerprint, prompt selection and
length, so recipes share data; a recipe needing a layer the cache lacks
re-extracts hidden states from the stored tokens (no new generation).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from decoding.paths import specray_home
from evaluation.workloads import Prompt

FLOAT16_MAX = 65504.0


def data_dir(fingerprint: str, prompts: list[Prompt], max_new_tokens: int, window: int, dtype: str) -> Path:
    """The cache directory of one (target, prompt set, length, window, dtype)."""
    h = hashlib.sha1()
    for p in prompts:
        h.update(json.dumps([p.question_id, p.category, p.prompt]).encode())
    h.update(f"{fingerprint}:{max_new_tokens}:{window}:{dtype}".encode())
    return specray_home() / "drafter-data" / h.hexdigest()[:16]


def read_meta(d: Path) -> dict | None:
    try:
        return json.loads((Path(d) / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


@torch.inference_mode()
def extract_hidden(adapter, tokens: torch.Tensor, layers: list[int], start: int) -> dict[int, np.ndarray]:
    """Hidden states after each of ``layers`` for positions start..T-1 of ``tokens`` [T]: {layer: float16 [T-start, H]}."""
    cache = adapter.new_cache(1, tokens.shape[0])
    tokens = tokens.to(adapter.device)  # stored tokens are on the CPU; the model may be on a GPU
    out, h, first = {}, None, 0
    for layer in sorted(set(layers)):
        if first == 0:
            h = adapter.forward(cache, 0, input_ids=tokens[None], last=layer)
        else:
            h = adapter.forward(cache, 0, hidden=h, first=first, last=layer)
        first = layer
        rows = h[0, start:].float()
        if rows.abs().max() > FLOAT16_MAX:
            raise ValueError(f"layer {layer} hidden states exceed float16's range; cannot store them as float16")
        out[layer] = rows.cpu().numpy().astype(np.float16)
    return out


def _write_shard(path: Path, rows: list[dict], layers: list[int]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = {k: [r[k] for r in rows] for k in ("question_id", "category", "prompt_len", "tokens", "start")}
    cols["question_id"] = [str(q) for q in cols["question_id"]]
    for layer in layers:
        cols[f"h{layer}"] = [r["hidden"][layer].tobytes() for r in rows]
    table = pa.table(cols)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def generate_data(
    decoder,
    prompts: list[Prompt],
    layers: list[int],
    out: Path,
    max_new_tokens: int = 128,
    window: int = 512,
    shard_size: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Generate (or resume, or extend with missing layers) the data set in ``out``; returns its meta.

    ``decoder`` is an ``ar`` :class:`~decoding.in_process.SpecDecoder` (its model, dtype and chat template are used).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layers = sorted(set(layers))
    meta = read_meta(out)
    if meta is not None:
        if set(layers) <= set(meta["layers"]):
            return meta
        return _add_layers(decoder, out, meta, sorted(set(layers) | set(meta["layers"])), progress)
    chat = bool(getattr(decoder.tokenizer, "chat_template", None))
    shards = [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]
    done = 0
    for s, shard in enumerate(shards):
        path = out / f"part-{s:05d}.parquet"
        if path.exists():  # resumed: this shard was finished before an interruption
            done += len(shard)
            continue
        rows = []
        for p in shard:
            ids = decoder.encode(p.prompt, chat=chat)
            gen = decoder.generate_ids(ids, max_new_tokens)
            tokens = torch.cat([ids[0], torch.tensor(gen.token_ids, dtype=torch.long)])
            start = max(0, tokens.shape[0] - window)
            hidden = extract_hidden(decoder.target, tokens, layers, start)
            row = dict(question_id=p.question_id, category=p.category, prompt_len=ids.shape[1], tokens=tokens.tolist(), start=start)
            rows.append({**row, "hidden": hidden})
            done += 1
            if progress:
                progress(done, len(prompts))
        _write_shard(path, rows, layers)
    meta = {
        "layers": layers,
        "hidden_size": decoder.target.config.hidden_size,
        "num_layers": len(decoder.target.layers),
        "sequences": len(prompts),
        "shards": len(shards),
        "max_new_tokens": max_new_tokens,
        "window": window,
        "dtype": decoder.cfg.dtype,
        "model": decoder.cfg.model,
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _add_layers(decoder, out: Path, meta: dict, layers: list[int], progress) -> dict:
    """Re-extract hidden states for ``layers`` from the stored tokens, shard by shard; then rewrite meta."""
    done = 0
    for path in sorted(out.glob("part-*.parquet")):
        rows = []
        for r in _read_rows(path, []):
            r["hidden"] = extract_hidden(decoder.target, torch.tensor(r["tokens"]), layers, r["start"])
            rows.append(r)
            done += 1
            if progress:
                progress(done, meta["sequences"])
        _write_shard(path, rows, layers)
    meta = {**meta, "layers": layers}
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def _read_rows(path: Path, layers: list[int], hidden_size: int | None = None) -> list[dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pylist()
    rows = []
    for r in table:
        hidden = {}
        for layer in layers:
            flat = np.frombuffer(r[f"h{layer}"], dtype=np.float16)
            hidden[layer] = flat.reshape(-1, hidden_size)
        keep = {k: r[k] for k in ("question_id", "category", "prompt_len", "tokens", "start")}
        rows.append({**keep, "hidden": hidden})
    return rows


def load_examples(d: Path, layers: list[int]) -> list[dict]:
    """Training examples: ``tokens`` [T] long, ``start``, ``hidden`` {layer: float16 tensor [T-start, H]}."""
    meta = read_meta(d)
    if meta is None:
        raise FileNotFoundError(f"{d}: no complete data set (meta.json missing)")
    missing = sorted(set(layers) - set(meta["layers"]))
    if missing:
        raise ValueError(f"{d}: the data set lacks hidden states of layers {missing}")
    out = []
    for path in sorted(Path(d).glob("part-*.parquet")):
        for r in _read_rows(path, layers, meta["hidden_size"]):
            r["tokens"] = torch.tensor(r["tokens"], dtype=torch.long)
            r["hidden"] = {k: torch.from_numpy(v.copy()) for k, v in r["hidden"].items()}
            out.append(r)
    return out
