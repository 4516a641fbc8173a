"""Benchmark workloads: Spec-Bench style prompt files.

A prompt file is JSON Lines, one question per line, in Spec-Bench's format::

    {"question_id": 81, "category": "writing", "turns": ["Compose ...", "Rewrite ..."]}

The first turn is the prompt (it gets the model's chat template when it is
encoded). ``with_later_turns`` adds, after each multi-turn question, one prompt
per later turn: the conversation so far (every earlier turn with the model's own
greedy answer to it) and then that turn, as Spec-Bench measures MT-bench.
``select`` keeps the asked categories and the first ``limit`` questions of each,
in file order.

>>> ps = parse_prompts(['{"question_id": 1, "category": "qa", "turns": ["Why?"]}', ""], source="q.jsonl")
>>> ps[0].question_id, ps[0].category, ps[0].prompt
(1, 'qa', 'Why?')
>>> parse_prompts(['{"question_id": 1}'], source="q.jsonl")
Traceback (most recent call last):
...
evaluation.workloads.WorkloadError: q.jsonl:1: missing field 'category'
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# data/spec_bench/question.jsonl at the repository root (decoding/ sits at the root)
DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "spec_bench" / "question.jsonl"


class WorkloadError(ValueError):
    """A bad prompt file or selection; the message names the file (and line) at fault."""


@dataclass(frozen=True)
class Prompt:
    question_id: int | str
    category: str
    turns: tuple[str, ...]
    turn: int = 1  # which turn this prompt asks (1-based); the earlier ones come before it, with their answers

    @property
    def prompt(self) -> str:
        return self.turns[self.turn - 1]

    @property
    def prompt_id(self) -> int | str:
        """The question id, with ``-t<turn>`` after it for a later turn (a row's key in the traces)."""
        return self.question_id if self.turn == 1 else f"{self.question_id}-t{self.turn}"

    def earlier(self) -> Prompt:
        """The prompt of the turn before this one."""
        return Prompt(self.question_id, self.category, self.turns, self.turn - 1)

    def messages(self, answers: list[str]) -> list[dict]:
        """The conversation up to this turn: each earlier turn and ``answers[i]``, the answer to turn i + 1."""
        if len(answers) != self.turn - 1:
            raise ValueError(f"turn {self.turn} needs {self.turn - 1} earlier answer(s), got {len(answers)}")
        msgs = []
        for question, answer in zip(self.turns[: self.turn - 1], answers, strict=True):
            msgs += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return msgs + [{"role": "user", "content": self.prompt}]


def with_later_turns(prompts: list[Prompt]) -> list[Prompt]:
    """Each prompt followed by one prompt per later non-empty turn of its question.

    >>> ps = parse_prompts(['{"question_id": 7, "category": "c", "turns": ["a", "b"]}'])
    >>> [(p.prompt_id, p.prompt) for p in with_later_turns(ps)]
    [(7, 'a'), ('7-t2', 'b')]
    """
    out = []
    for p in prompts:
        out.append(p)
        out += [Prompt(p.question_id, p.category, p.turns, t) for t in range(2, len(p.turns) + 1) if p.turns[t - 1].strip()]
    return out


def parse_line(line: str, source: str, lineno: int) -> Prompt:
    where = f"{source}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise WorkloadError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question_id", "category", "turns"):
        if key not in obj:
            raise WorkloadError(f"{where}: missing field {key!r}")
    qid, category, turns = obj["question_id"], obj["category"], obj["turns"]
    if isinstance(qid, bool) or not isinstance(qid, int | str):
        raise WorkloadError(f"{where}: question_id must be an integer or a string, got {qid!r}")
    if not isinstance(category, str) or not category:
        raise WorkloadError(f"{where}: category must be a non-empty string, got {category!r}")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise WorkloadError(f"{where}: turns must be a non-empty list of strings")
    if not turns[0].strip():
        raise WorkloadError(f"{where}: the first turn is empty")
    return Prompt(qid, category, tuple(turns))


def parse_prompts(lines: Iterable[str], source: str = "<prompts>") -> list[Prompt]:
    """Parse JSON Lines; blank lines are skipped; ids must be unique."""
    out: list[Prompt] = []
    seen: dict[int | str, int] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        p = parse_line(line, source, lineno)
        if p.question_id in seen:
            raise WorkloadError(f"{source}:{lineno}: duplicate question_id {p.question_id!r} (first on line {seen[p.question_id]})")
        seen[p.question_id] = lineno
        out.append(p)
    if not out:
        raise WorkloadError(f"{source}: no prompts in the file")
    return out


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Read a Spec-Bench style JSONL file (default: the bundled Spec-Bench questions)."""
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    if not path.is_file():
        raise WorkloadError(f"{path}: " + ("a directory, not a prompt file" if path.is_dir() else "prompt file does not exist"))
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: cannot read the prompt file ({e})") from None
    return parse_prompts(text.splitlines(), source=str(path))


def categories(prompts: Iterable[Prompt]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(p.category for p in prompts))


def select(prompts: list[Prompt], wanted: Iterable[str] | None = None, limit: int | None = None, source: str = "prompts") -> list[Prompt]:
    """Keep the ``wanted`` categories (all when None) and at most ``limit`` prompts of each.

    >>> ps = parse_prompts([f'{{"question_id": {i}, "category": "{c}", "turns": ["t"]}}' for i, c in enumerate("aabbb")])
    >>> [p.question_id for p in select(ps, ["b"], limit=2)]
    [2, 3]
    >>> select(ps, ["z"])
    Traceback (most recent call last):
    ...
    evaluation.workloads.WorkloadError: prompts: unknown category 'z'; known categories: a, b
    """
    known = categories(prompts)
    wanted = list(dict.fromkeys(wanted)) if wanted else known
    for c in wanted:
        if c not in known:
            raise WorkloadError(f"{source}: unknown category {c!r}; known categories: {', '.join(known)}")
    if limit is not None and limit < 1:
        raise WorkloadError(f"limit must be >= 1, got {limit}")
    taken = {c: 0 for c in wanted}
    out = []
    for p in prompts:
        if p.category in taken and (limit is None or taken[p.category] < limit):
            taken[p.category] += 1
            out.append(p)
    return out


# ---- long contexts (TriForce) ---------------------------------------------------------------------------
LONG_CONTEXT_SOURCES = ("summarization", "rag")


def split_document(p: Prompt) -> tuple[str, str | None]:
    """(document, question) of a Spec-Bench summarization or RAG prompt.

    >>> split_document(Prompt(1, "summarization", ("Summarize: The cat sat.",)))
    ('The cat sat.', None)
    >>> split_document(Prompt(2, "rag", ("Cats sit. Dogs run.\\nWhat do cats do?",)))
    ('Cats sit. Dogs run.', 'What do cats do?')
    """
    text = p.prompt.strip()
    if p.category == "summarization":
        return text.removeprefix("Summarize:").strip(), None
    doc, _, question = text.rpartition("\n")
    return (doc.strip(), question.strip()) if doc.strip() else (text, None)


def long_context_prompt(prompts: list[Prompt], tokens: int, count_tokens, index: int = 0) -> Prompt:
    """A prompt of at most ``tokens`` tokens (as ``count_tokens(text)`` counts them, chat template included):
    Spec-Bench summarization and RAG documents concatenated, then a question about the first one.

    Prompt ``index`` starts at the index-th document, alternating the two categories; the
    question is the first RAG document's own question, so the answer sits at the far end
    of the context. The last document is cut (at a word boundary) to fill the budget.

    >>> ps = [Prompt(1, "rag", ("Cats sit. " * 5 + "\\nWhat do cats do?",)), Prompt(2, "summarization", ("Summarize: Dogs run. " * 9,))]
    >>> p = long_context_prompt(ps, 40, lambda text: len(text.split()))
    >>> p.category, len(p.prompt.split()) <= 40, p.prompt.endswith("What do cats do?")
    ('ctx-40', True, True)
    """
    docs = {c: [split_document(p) for p in prompts if p.category == c] for c in LONG_CONTEXT_SOURCES}
    if not docs["rag"] or not docs["summarization"]:
        raise WorkloadError("long-context prompts need summarization and rag prompts in the prompt file")
    n = max(len(d) for d in docs.values())
    order = [docs[c][(index + i) % len(docs[c])] for i in range(n) for c in ("rag", "summarization")]
    question = order[0][1]

    def text(parts: list[str]) -> str:
        body = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(parts))
        return f"{body}\n\nUsing the documents above, answer: {question}"

    parts: list[str] = []
    for doc, _ in order * (1 + tokens // 200):  # enough repetitions for any budget
        if count_tokens(text(parts + [doc])) <= tokens:
            parts.append(doc)
            continue
        words = doc.split(" ")
        lo, hi = 0, len(words)  # the longest prefix of the document that still fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if count_tokens(text(parts + [" ".join(words[:mid])])) <= tokens else (lo, mid - 1)
        if lo:
            parts.append(" ".join(words[:lo]))
        break
    if not parts:
        raise WorkloadError(f"a long-context prompt of {tokens} tokens has no room for a document")
    return Prompt(f"ctx{tokens}-{index}", f"ctx-{tokens}", (text(parts),))


def split_held_out(prompts: list[Prompt], fraction: float) -> tuple[list[Prompt], list[Prompt]]:
    """(tuning, held-out): about ``fraction`` of every category's prompts, spread through it, held out; disjoint.

    A category with a single prompt keeps it for tuning; ``fraction`` 0 holds out nothing.

    >>> ps = parse_prompts([f'{{"question_id": {i}, "category": "{c}", "turns": ["t"]}}' for i, c in enumerate("aaaab")])
    >>> [[p.question_id for p in part] for part in split_held_out(ps, 0.5)]
    [[0, 2, 4], [1, 3]]
    """
    if not 0 <= fraction < 1:
        raise WorkloadError(f"the held-out fraction must be in [0, 1), got {fraction}")
    seen: dict[str, int] = {}
    tuning, held = [], []
    for p in prompts:
        i = seen[p.category] = seen.get(p.category, -1) + 1
        (held if int((i + 1) * fraction) > int(i * fraction) else tuning).append(p)
    return tuning, held
