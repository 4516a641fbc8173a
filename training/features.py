"""The target's hidden states for training, computed as training draws each window (prefill speed), never stored.

Training examples from the self-distillation data (``training.distill_data``) hold token ids only: ``tokens`` [T]
(prompt + answer) and ``answer_from`` (the first answer position). :meth:`TargetFeatures.example` picks a window
of rows, runs the frozen target over the text up to the window's end (the whole left context, as drafting sees
it) and returns the example in the form the objectives read (``training.objectives``): ``start`` and
``hidden`` {layer l: [rows, H] float32}, layer l being the hidden state after l layers (the model's depth: its
last layer, before the final norm).

>>> # feats = TargetFeatures(load_model("smollm2-135m", "bfloat16").model, layers=[2, 15, 30])
>>> # ex = feats.example({"tokens": ids, "answer_from": 40}, window=256, generator=g)
"""

from __future__ import annotations

import torch

from decoding.model.adapter import ModelAdapter
from training.objectives import Windows


class TargetFeatures:
    """Runs ``target_hf`` (any dtype or quantisation: the target as it runs) to get the ``layers`` a recipe needs."""

    def __init__(self, target_hf, layers: list[int], max_context: int | None = None):
        self.adapter = ModelAdapter(target_hf)
        self.layers = sorted(set(int(x) for x in layers))
        # the target sees at most this many tokens up to the window's end (None: the whole text before it); longer
        # texts start later (positions counted from there): cheaper features for long prompts, a mild approximation
        self.max_context = max_context
        self.tokens_run = 0  # target positions computed so far (training's share of the target's work)

    def window(self, ex: dict, window: int, generator: torch.Generator | None) -> tuple[int, int]:
        """Rows [start, end) of an example: all of it when it fits, else ``window`` rows that reach into the answer
        (random with ``generator``, else the last ones: evaluation is deterministic).

        >>> TargetFeatures.window(None, {"tokens": torch.zeros(10), "answer_from": 6}, 16, None)
        (0, 10)
        >>> TargetFeatures.window(None, {"tokens": torch.zeros(100), "answer_from": 60}, 16, None)
        (84, 100)
        """
        total = ex["tokens"].shape[0]
        if total <= window:
            return 0, total
        lo = min(max(0, ex.get("answer_from", 0) - 2), total - window)  # the first window that reaches the answer
        start = total - window
        if generator is not None and start > lo:
            start = int(torch.randint(lo, start + 1, (1,), generator=generator))
        return start, start + window

    def span(self, ex: dict, window: int, generator: torch.Generator | None) -> tuple[int, int, int]:
        """(lo, start, end): the window's rows [start, end) and the first token the target reads (``max_context``)."""
        start, end = self.window(ex, window, generator)
        lo = 0 if self.max_context is None else max(0, min(start, end - self.max_context))
        return lo, start, end

    @torch.inference_mode()
    def _hidden(self, texts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """{layer: [B, L, H]} of ``texts`` run as one batch, right-padded to the longest (causal: the padding after a
        text changes none of its rows)."""
        a = self.adapter
        width = max(t.shape[0] for t in texts)
        ids = torch.zeros(len(texts), width, dtype=torch.long)
        for b, t in enumerate(texts):
            ids[b, : t.shape[0]] = t
        captured = dict.fromkeys(self.layers)
        a.forward(a.new_cache(len(texts), width), 0, input_ids=ids.to(a.device), captured=captured)
        self.tokens_run += sum(t.shape[0] for t in texts)
        return captured

    def example(self, ex: dict, window: int, generator: torch.Generator | None = None, device: torch.device | None = None) -> dict:
        """The window's example with the target's hidden states (float32, on ``device``) of its rows."""
        lo, start, end = self.span(ex, window, generator)
        tokens = ex["tokens"][lo:end]
        hidden = {layer: h[0, start - lo :].float().clone().to(device) for layer, h in self._hidden([tokens]).items()}
        out = {**ex, "tokens": tokens.to(device), "start": start - lo, "hidden": hidden}
        if "answer_from" in ex:
            out["answer_from"] = ex["answer_from"] - lo
        return out

    def batch(
        self, examples: list[dict], window: int, generator: torch.Generator | None = None, device: torch.device | None = None
    ) -> Windows:
        """The windows of ``examples`` (drawn in order from ``generator``, as :meth:`example` draws them one by one) as
        one :class:`~training.objectives.Windows` batch, the target run once over all of them."""
        spans = [self.span(ex, window, generator) for ex in examples]
        captured = self._hidden([ex["tokens"][lo:end] for ex, (lo, _, end) in zip(examples, spans, strict=True)])
        windows = []
        for b, (ex, (lo, start, end)) in enumerate(zip(examples, spans, strict=True)):
            hidden = {layer: h[b, start - lo : end - lo].float().to(device) for layer, h in captured.items()}
            windows.append(
                {
                    "tokens": ex["tokens"][lo:end].to(device),
                    "start": start - lo,
                    "hidden": hidden,
                    "answer_from": ex.get("answer_from", 0) - lo,
                }
            )
        return Windows.of(windows)


def examples_from_rows(rows: list[dict], min_answer: int = 2) -> list[dict]:
    """Training examples from self-distillation rows (``training.distill_data.read_rows``): prompt + answer ids as one
    ``tokens`` tensor, ``answer_from`` the prompt's length; rows with fewer than ``min_answer`` answer tokens, or
    skipped, are left out."""
    out = []
    for r in rows:
        if r["finish_reason"] == "skipped" or len(r["answer_ids"]) < min_answer:
            continue
        tokens = torch.tensor(list(r["prompt_ids"]) + list(r["answer_ids"]), dtype=torch.long)
        out.append({"tokens": tokens, "answer_from": len(r["prompt_ids"]), "id": r["id"], "kind": r["kind"]})
    return out


def distill_training_set(data_dir, max_sequences: int | None = None, eval_sequences: int = 64) -> tuple[list[dict], list[dict]]:
    """(train, held-out) examples from a ``specray distill`` data directory: its ``train`` split (the first
    ``max_sequences`` of them, in shard order, which interleaves the task kinds) and ``eval_sequences`` of its
    ``heldout`` split."""
    from training.distill_data import read_rows

    columns = ["id", "kind", "split", "prompt_ids", "answer_ids", "finish_reason"]
    rows = read_rows(data_dir, columns=columns)
    train = examples_from_rows([r for r in rows if r["split"] == "train"])
    held = examples_from_rows([r for r in rows if r["split"] == "heldout"])
    if max_sequences is not None:
        train = train[:max_sequences]
    stride = max(1, len(held) // max(1, eval_sequences))  # spread over the kinds
    return train, held[::stride][:eval_sequences]
