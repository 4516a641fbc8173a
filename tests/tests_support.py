"""Helpers the tests import (pytest runs with --import-mode=importlib, tests/ is on the path)."""

import contextlib
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = REPO / "data" / "spec_bench" / "question.jsonl"


def spec_bench_prompts(per_category: int, categories=None) -> list[dict]:
    rows, seen = [], {}
    for line in SPEC_BENCH.read_text().splitlines():
        q = json.loads(line)
        if categories and q["category"] not in categories:
            continue
        if seen.get(q["category"], 0) < per_category:
            seen[q["category"]] = seen.get(q["category"], 0) + 1
            rows.append(q)
    return rows


# Ray forwards its workers' and daemons' logs to the driver's stderr, prefixed "(ActorName pid=123)", "(raylet, ip=..)"
# or "(autoscaler +1s)" (coloured on a terminal).
_RAY_FORWARDED = re.compile(r"^(\x1b\[[0-9;]*m)?\(([^)]*pid=\d+|raylet|autoscaler|gcs_server)[^)]*\)")


def own_stderr_lines(err: str) -> list[str]:
    """The non-blank lines of ``err`` that the code under test printed, without the worker logs Ray forwards to a
    driver (a test that runs a command in the driver of a live cluster sees those interleaved)."""
    return [ln for ln in err.splitlines() if ln.strip() and not _RAY_FORWARDED.match(ln)]


def assert_one_line_error(rc: int, err: str, *needles: str) -> None:
    """A command failed on bad input as the house wants it: exit 2, one line on stderr naming every needle."""
    lines = own_stderr_lines(err)
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def compare_with_ar(decoder, prompts: list[dict], reference: dict) -> tuple[list, float]:
    """Run ``decoder`` on the prompts: (question ids whose output differs from ``reference``, tokens per target forward)."""
    mismatched, forwards, tokens = [], 0, 0
    for q in prompts:
        out = decoder.generate_ids(decoder.encode(q["turns"][0], chat=True))
        if out.token_ids != reference[q["question_id"]]:
            mismatched.append(q["question_id"])
        forwards += out.stats.target_forwards
        tokens += out.stats.new_tokens
    return mismatched, tokens / forwards


@contextlib.contextmanager
def multinode_cluster(worker_cpus: list[int], head_resources: dict | None = None, log_to_driver: bool = True):
    """A ``ray.cluster_utils.Cluster`` on this machine: a head with no CPUs (the driver only) and one worker node
    per entry of ``worker_cpus``; the driver is connected to it. Yields (cluster, worker nodes); tears it all down."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster import runtime

    if ray.is_initialized():
        ray.shutdown()
    head = {"num_cpus": 0, "include_dashboard": False, **({"resources": head_resources} if head_resources else {})}
    c = Cluster(initialize_head=True, head_node_args=head)
    workers = [c.add_node(num_cpus=n) for n in worker_cpus]
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=log_to_driver)
    try:
        yield c, workers
    finally:
        ray.shutdown()
        runtime._STARTED_HERE = False
        c.shutdown()


@contextlib.contextmanager
def tiny_openai_server(model_dir, name: str = "tiny-peer", usage: bool = True):
    """A minimal OpenAI-compatible HTTP server on a free loopback port, yielding its root URL: ``GET /v1/models`` (one
    model, ``name``) and ``POST /v1/chat/completions`` (plain or streamed as server-sent events, one chunk per decoded
    step). It generates with the model at ``model_dir`` in process (float32 greedy AR, one request at a time, like
    llama.cpp's server with one slot): a real peer for ``specray bench-serve --peer-url``, without Ray. ``usage``
    False leaves ``usage`` out of the streams (as servers that ignore ``stream_options`` do)."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder

    dec = SpecDecoder(SpecConfig(model=str(model_dir), dtype="float32", threads=1))
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path.rstrip("/") != "/v1/models":
                return self._json(404, {"error": {"message": "not found"}})
            self._json(200, {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "tests"}]})

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                return self._json(404, {"error": {"message": "not found"}})
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ids = dec.encode(req["messages"])
            base = {"id": "chatcmpl-tiny", "created": int(time.time()), "model": name}
            if not req.get("stream"):
                with lock:
                    gen = dec.generate_ids(ids, max_new_tokens=req.get("max_tokens") or 16)
                message = {"role": "assistant", "content": dec.decode(gen.token_ids)}
                n = len(gen.token_ids)
                usage_body = {"prompt_tokens": ids.shape[-1], "completion_tokens": n, "total_tokens": ids.shape[-1] + n}
                choice = {"index": 0, "message": message, "finish_reason": gen.finish_reason}
                return self._json(200, {**base, "object": "chat.completion", "choices": [choice], "usage": usage_body})
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            said, tokens = "", []

            def send(body: dict) -> None:
                self.wfile.write(f"data: {json.dumps({**base, 'object': 'chat.completion.chunk', **body})}\n\n".encode())
                self.wfile.flush()

            def on_step(new, final=False):
                nonlocal said
                tokens.extend(new)
                text = dec.decode(tokens)
                if text != said and text.startswith(said) and (final or not text.endswith("\ufffd")):  # whole characters
                    send({"choices": [{"index": 0, "delta": {"content": text[len(said) :]}, "finish_reason": None}]})
                    said = text

            with lock:
                gen = dec.generate_ids(ids, max_new_tokens=req.get("max_tokens") or 16, on_step=on_step)
            on_step([], final=True)
            send({"choices": [{"index": 0, "delta": {}, "finish_reason": gen.finish_reason}]})
            if usage and (req.get("stream_options") or {}).get("include_usage"):
                n = len(gen.token_ids)
                send({"choices": [], "usage": {"prompt_tokens": ids.shape[-1], "completion_tokens": n, "total_tokens": ids.shape[-1] + n}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def generate(
    target,
    prompt_ids,
    *,
    drafter=None,
    k=4,
    sampling=None,
    max_new_tokens=128,
    eos_token_ids=(),
    generator=None,
    on_step=None,
    adaptive=False,
    cost=None,
):
    """One sequence through the loop alone (a batch of one): the tests' shorthand for ``run_alone(target, Sequence(...))``."""
    from decoding.loop.batch import Sequence, run_alone
    from decoding.sampling import GREEDY

    seq = Sequence(
        prompt_ids,
        drafter=drafter,
        k=k,
        adaptive=adaptive,
        sampling=sampling or GREEDY,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        generator=generator,
        on_step=on_step,
    )
    return run_alone(target, seq, cost)


def confidence_head(scale: float = 12.0):
    """A hand-set SpecDec++ stop head (``decoding.drafters.stop_head.StopHead``) whose predicted acceptance is about
    sigmoid(scale * (p1 - 0.5)), p1 the draft's top-1 probability: sure drafts are predicted accepted."""
    import torch

    from decoding.drafters.stop_head import StopHead

    head = StopHead(hidden=1)
    with torch.no_grad():
        head.net[0].weight.zero_()
        head.net[0].weight[0, 0] = 1.0
        head.net[0].bias.zero_()
        head.net[2].weight.fill_(scale / torch.sigmoid(torch.tensor(1.0)).item())  # SiLU(p1) = p1 * sigmoid(p1)
        head.net[2].bias.fill_(-scale * 0.5)
    return head


def always_drafting_del(depth: int):
    """DEL made to draft every step from its top candidate exit (tests that need drafts: sampled distributions)."""
    from decoding.drafters.dynamic_exit import DynamicExitDrafter, candidate_exits

    class AlwaysDraft(DynamicExitDrafter):
        def alphas(self):
            return [0.0] * (len(self.exits) - 1) + [0.999]

    return AlwaysDraft(candidate_exits(depth))
