"""A real specray Serve app on a local Ray, on a free loopback port, for the serving tests.

The registry is a file registry in a temp dir holding configurations of the tiny
random model (float32, so greedy outputs have no bfloat16 near-ties) plus one
of a long-context copy of it (for generations long enough to cancel).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from redis_server import free_port

from cluster.registry import Entry, FileRegistry, open_registry
from cluster.runtime import PATIENT_SERVE
from decoding.config import SpecConfig

os.environ.update(PATIENT_SERVE)  # the Ray these tests start waits for a slow proxy start on a busy machine

THREADS = 1  # torch threads in the model replica and for in-process references: same numerics, no oversubscription


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    registry: FileRegistry
    registry_dir: Path
    tiny: str  # the tiny model directory (also the base model id)
    tiny_long: str  # the long-context tiny model directory
    settings: object

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)


@pytest.fixture(scope="session")
def tiny_long_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a 4096-token context: a cheap way to ask for thousands of tokens."""
    out = tmp_path_factory.mktemp("tiny-long") / "model"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def tiny_entries(tiny: str, tiny_long: str) -> list[Entry]:
    f32 = {"dtype": "float32", "model": tiny}
    return [
        Entry("tiny/chat/ngram", SpecConfig(method="ngram", k=4, **f32), metrics={"speedup": 1.5, "tokens_per_s": 300.0}),
        Entry("tiny/chat/sps", SpecConfig(method="sps", k=3, draft_layers=1, **f32), metrics={"speedup": 1.1}),
        Entry("tiny/long/ar", SpecConfig(method="ar", dtype="float32", model=tiny_long, max_new_tokens=3000)),
    ]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tiny_long_model_dir, tmp_path_factory):
    import ray
    from ray import serve

    from serving.app import build_app
    from serving.settings import ServeSettings

    reg_dir = tmp_path_factory.mktemp("serve-registry")
    reg = open_registry(reg_dir)
    for e in tiny_entries(str(tiny_model_dir), str(tiny_long_model_dir)):
        reg.put(e)
    # a corrupt entry: reported, never served
    reg.entry_path("tiny/chat/broken").write_text(json.dumps({"name": "tiny/chat/broken", "config": {"method": "medusa"}}))

    settings = ServeSettings(
        registry=str(reg_dir),
        base_model=str(tiny_model_dir),
        dtype="float32",
        max_ongoing_requests=48,  # the 32-stream test's requests all reach the replica's batch
        max_batch_rows=32,
        num_replicas=1,
        model_num_cpus=1,
        threads=THREADS,
        max_queued_requests=40,
        retry_after_s=2,
        max_loaded_configs=8,
        preload=["tiny/chat/ngram"],
    )
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False)  # never join a stray cluster
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(settings), name="specray", route_prefix="/")
        yield Server(f"http://127.0.0.1:{port}", reg, reg_dir, str(tiny_model_dir), str(tiny_long_model_dir), settings)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class InProcess:
    """In-process generation with the same configurations, for equality checks."""

    def __init__(self):
        self._decoders = {}

    def decoder(self, cfg: SpecConfig):
        from decoding.in_process import SpecDecoder

        key = cfg.to_json()
        if key not in self._decoders:
            self._decoders[key] = SpecDecoder(cfg)
        return self._decoders[key]

    def generate(self, cfg: SpecConfig, prompt: str, max_tokens: int, chat: bool = False, seed: int | None = None) -> dict:
        dec = self.decoder(cfg)
        before = torch.get_num_threads()
        torch.set_num_threads(THREADS)
        try:
            out = dec.generate_ids(dec.encode(prompt, chat=chat), max_new_tokens=max_tokens, seed=seed)
        finally:
            torch.set_num_threads(before)
        return {"text": dec.decode(out.token_ids), "token_ids": out.token_ids, "finish_reason": out.finish_reason}


@pytest.fixture(scope="module")
def in_process():
    return InProcess()
