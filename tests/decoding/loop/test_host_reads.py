"""Host reads per decoding step, counted on the CPU: a new synchronisation fails CI without a GPU.

On a GPU every read of a tensor's value (``item``, ``tolist``, ``int``/``bool`` of a tensor, ``cpu()``, ``numpy()``)
and every op whose output shape depends on values (``nonzero``, ``masked_select``) stops the host until the device
has caught up, and a tensor made from host data (``torch.tensor``) is a blocking copy. A step of the loop does
exactly one of these: the read of its verdicts (``decoding.loop.step.Workspace.read``). Counted here with a
``TorchDispatchMode`` for the ops and patched ``Tensor`` methods for the Python-level reads (which the mode does not
see), for AR, prompt lookup, an eagle head, and a batched step of mixed rows, greedy and sampled. The ops a step
dispatches are counted too (on a GPU each is a kernel launch): the budget below fails when a change adds many.
"""

from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
from conftest import tiny_llama
from torch.utils._python_dispatch import TorchDispatchMode

from decoding.drafters.eagle import EagleDrafter, EagleNet
from decoding.drafters.ngram import NgramDrafter
from decoding.loop.batch import Batch, Sequence
from decoding.model.adapter import ModelAdapter
from decoding.sampling import SamplingParams

# ops that only make a view (no kernel on a GPU)
VIEWS = {f"aten.{n}" for n in ("slice.Tensor", "view.default", "transpose.int", "select.int", "unsqueeze.default", "reshape.default")}
VIEWS |= {
    f"aten.{n}" for n in ("alias.default", "split_with_sizes.default", "chunk.default", "expand.default", "t.default", "detach.default")
}
VIEWS |= {
    f"aten.{n}" for n in ("_unsafe_view.default", "squeeze.dim", "permute.default", "unbind.int", "as_strided.default", "split.Tensor")
}
SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default", "aten.lift_fresh.default"}
READS = ("tolist", "cpu", "numpy", "item")
PROMPT = torch.tensor([[3, 7, 3, 7, 3, 1, 2, 5, 3, 7, 3, 9, 4]])
VOCAB = 48


class HostReads(TorchDispatchMode):
    """Every syncing op and host read while active (with where it came from), and the number of ops dispatched."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.ops = 0  # dispatched ops that are not views (on a GPU, kernel launches)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += str(func) not in VIEWS
        if str(func) in SYNCING_OPS:
            self.reads.append((str(func), _caller()))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def patched(name):
            def read(tensor, *args, **kwargs):
                self.reads.append((name, _caller()))
                return originals[name](tensor, *args, **kwargs)

            return read

        for name in READS:
            setattr(torch.Tensor, name, patched(name))
        try:
            with self:
                yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "test_host_reads" not in f.filename]
    return f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=VOCAB, layers=4, seed=3)


def eagle(model) -> EagleDrafter:
    torch.manual_seed(0)
    return EagleDrafter(EagleNet(model, (1, 2, 4), torch.arange(VOCAB)).eval())


def steps_of(target, rows: list[tuple], warm: int = 3, measured: int = 6) -> list[HostReads]:
    """Run a batch of ``rows`` ((drafter, sampling)), ``warm`` steps unmeasured, then ``measured`` steps one by one."""
    batch = Batch(target, max_rows=len(rows))
    for i, (drafter, sampling) in enumerate(rows):
        batch.add(
            Sequence(
                PROMPT[:, : 9 + i], drafter=drafter, k=3, sampling=sampling, max_new_tokens=40, generator=torch.Generator().manual_seed(i)
            )
        )
    for _ in range(warm):
        batch.step()
    out = []
    for _ in range(measured):
        with HostReads().counting() as counter:
            batch.step()
        out.append(counter)
    assert len(batch.rows) == len(rows), "every row still decoding while measured"
    return out


GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
CASES = {
    "ar": lambda m: [(None, GREEDY)],
    "ngram": lambda m: [(NgramDrafter(3, 1), GREEDY)],
    "eagle": lambda m: [(eagle(m), GREEDY)],
    "ar-sampled": lambda m: [(None, SAMPLED)],
    "ngram-sampled": lambda m: [(NgramDrafter(3, 1), SAMPLED)],
    "eagle-sampled": lambda m: [(eagle(m), SAMPLED)],
    "batched": lambda m: [(None, GREEDY), (NgramDrafter(3, 1), GREEDY), (NgramDrafter(2, 1), SAMPLED), (None, SAMPLED)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_host_read_per_step(model, case):
    target = ModelAdapter(model)
    for counter in steps_of(target, CASES[case](model)):
        assert len(counter.reads) <= 1, f"{case}: {len(counter.reads)} host reads in one step: {counter.reads}"
        assert [name for name, _ in counter.reads] == ["tolist"] and counter.reads[0][1].endswith("in read")


def test_a_new_read_in_a_step_is_caught(model, monkeypatch):
    """The control: one ``int()`` of a device value added to the drafter's proposal makes two reads a step."""
    drafter = NgramDrafter(3, 1)
    propose = drafter.propose

    def reading(state, k):
        int(state.tokens[0, -1])  # a host read, as code that asks the device for a value would do
        return propose(state, k)

    monkeypatch.setattr(drafter, "propose", reading)
    monkeypatch.setattr(NgramDrafter, "reads_tokens", True)  # it says so: the loop writes the ids each step
    counts = [len(c.reads) for c in steps_of(ModelAdapter(model), [(drafter, GREEDY)], measured=2)]
    assert counts == [2, 2]


def test_ops_per_step_stay_within_budget(model):
    """Ops of a one-token AR step that are not views (each a kernel launch on a GPU) on a 4-layer float32 model: 26 a
    layer (norms, three projections, rotary, the cache write, attention, the MLP) and about 30 for the step itself
    (embedding, rotary tables, head, verification, committing). A change that adds ops to every step fails here."""
    counter = steps_of(ModelAdapter(model), [(None, GREEDY)], measured=1)[0]
    layers = 4
    assert counter.ops <= 28 * layers + 35, counter.ops


def test_step_buffers_keep_their_addresses(model):
    """The step's device buffers and the KV cache are allocated once: the same addresses from step to step (what a
    captured graph replays over)."""
    target = ModelAdapter(model)
    batch = Batch(target, max_rows=2)
    for i in range(2):
        batch.add(Sequence(PROMPT[:, : 9 + i], drafter=NgramDrafter(3, 1), k=3, max_new_tokens=30))
    batch.step()
    addresses = []
    for _ in range(5):
        batch.step()
        ws = batch.workspace
        addresses.append((ws.host.data_ptr(), ws.dev.data_ptr(), ws.uniforms.data_ptr(), batch.cache.k_all.data_ptr()))
    assert len(set(addresses)) == 1, addresses


def test_each_generator_lives_on_its_rows_device(tiny_model_dir):
    """Rows made by ``SpecDecoder.sequence()`` (Serve, generate_batch, distillation) draw on the model's device."""
    from decoding.config import SpecConfig
    from decoding.in_process import SpecDecoder

    dec = SpecDecoder(SpecConfig(model=str(tiny_model_dir), dtype="float32", temperature=1.0))
    seq = dec.sequence(dec.encode("the cat sat"), 4, seed=1)
    assert seq.generator.device == dec.device == next(dec.loaded.model.parameters()).device
