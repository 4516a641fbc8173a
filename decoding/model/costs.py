"""What a target forward costs on this machine, by rows and tokens per row: measured once, then followed online.

Two decisions read it, so it is measured in one place: how many tokens a batch drafts this step (``k=auto``,
``decoding.loop.goodput.choose_width``) and how large a token tree a drafter offers
(``decoding.trees.hardware.TreeChooser``). :func:`forward_costs` measures a grid at first use (a few seconds on this
kind of CPU: the fastest of 3 timings a point, no width dearer than a wider one), keeps it in the process and under
``$SPECRAY_HOME/calibration`` per model, dtype, threads, device and forward implementation, and hands every caller the
same :class:`CostModel`; the loop folds each real step into it (:meth:`CostModel.observe`), so a tree chooser of the
same target reads the level and shape the steps measured.
"""

from __future__ import annotations

import bisect
import json
import logging
import threading
import time

import torch

from decoding.paths import specray_home
from decoding.timing import device_name, synchronize

# the grid the start-up calibration measures (rows x tokens per row)
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32)
# tokens per row the start-up calibration times. The int4 kernel of this kind of CPU works on 4 rows of a matrix at a
# time: SmolLM2's forward costs 8.7 ms at 1 token, 11.4-12.4 at 2-4, 15.2-16.2 at 5-8, 21.7 at 9; the ends of those
# steps are measured, so k=auto sees that a fourth or an eighth token costs little more than the one before it
CALIBRATION_WIDTHS = (1, 2, 3, 4, 5, 8, 9)  # SmolLM2-135M on 2 cores: one row 2.5 s, rows up to 32 25 s (once, then cached)
GPU_WIDTHS = (17, 33, 65)  # also measured on a GPU, where verifying 64 tokens costs about what one does
TREE_WIDTHS = (12, 16, 24, 32, 48, 64)  # one row also at these: token trees (nodes, the root included) up to 64
# how a grid is measured: the fastest of 3 rounds x 2 timings a point over 256 tokens, monotone in width,
# one row up to 64 tokens; a new grid or way of measuring is measured anew, not read from an old file
CALIBRATION_FORMAT = "m6"
BURST = 3  # forwards a width runs at a time in a round, the first one not timed
# a stored table is checked when a process first reads it: a plain step and one of CHECK_WIDTH tokens, timed again
CHECK_WIDTH, CHECK_TOLERANCE = 4, 0.1
log = logging.getLogger(__name__)
_COSTS: dict[tuple, CostModel] = {}
_COSTS_LOCK = threading.Lock()


def forward_costs(target, model: str, dtype: str, max_rows: int = 1, widths=CALIBRATION_WIDTHS, tree_widths=TREE_WIDTHS) -> CostModel:
    """The measured cost of ``target``'s forward (a ``ModelAdapter``) by rows and tokens, rows up to ``max_rows``.

    Measured once per model, dtype, threads, device and forward implementation, and kept in the process and under
    ``$SPECRAY_HOME/calibration`` (delete the file to measure again). Every caller with the same key gets the same
    object, which the loop refreshes from the steps it runs. A process that reads the file first times a plain step and
    one of ``CHECK_WIDTH`` tokens again (about 20 forwards) and measures the grid anew where the file no longer holds
    (:func:`stale`). ``widths`` and ``tree_widths``: a smaller grid where only short chains are weighed (a target
    worker's runs alone, ``decoding.schedules.two_sided.VerifySide.run``: a few seconds on a slow CPU, not minutes).
    """
    rows = tuple(r for r in CALIBRATION_ROWS if r <= max(1, max_rows))
    widths, tree_widths = tuple(widths), tuple(tree_widths)
    key = (model, dtype, torch.get_num_threads(), device_name(target.device), rows, target.implementation, widths, tree_widths)
    with _COSTS_LOCK:
        if key in _COSTS:
            return _COSTS[key]
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)[-80:]
        trees = "" if tree_widths == TREE_WIDTHS else "-t" + ".".join(map(str, tree_widths))
        grid = f"w{'.'.join(map(str, widths))}{trees}-{CALIBRATION_FORMAT}"
        path = specray_home() / "calibration" / f"{safe}-{dtype}-t{key[2]}-{key[3]}-r{rows[-1]}-{key[5]}-{grid}.json"
        try:
            cost = CostModel.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            cost = None
        if cost is not None:  # a plain step and a wider one timed again: does the file still hold on this machine?
            why = stale(cost, CostModel.measure(target, rows=(1,), widths=(1, CHECK_WIDTH), tree_widths=(), repeats=2, progress=False))
            if why:
                log.warning("specray: the stored forward costs %s do not hold on this machine now (%s): measuring again", path, why)
                cost = None
        if cost is None:
            log.info("specray: measuring the target's forward cost by rows and tokens (once per model, dtype, threads)")
            cost = CostModel.measure(target, rows=rows, widths=widths, tree_widths=tree_widths)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(cost.to_dict()))
            except OSError:
                pass  # a read-only home: measure again next time
        _COSTS[key] = cost
        return cost


class CostModel:
    """Seconds of one target forward over R rows of T tokens each.

    ``table`` holds measured points {(R, T): seconds}; other sizes are interpolated linearly in R and in T
    between the nearest measured ones (and extrapolated in proportion beyond them). :meth:`observe` folds in
    the time of real steps, so the model's level follows the machine (other load, longer contexts) as it runs.

    >>> c = CostModel({(1, 1): 1.0, (1, 3): 2.0, (3, 1): 3.0, (3, 3): 5.0})
    >>> c(2, 2)
    2.75
    """

    FRESH = 4  # a wider step within this many steps of a plain one corrects its shape (observe)

    def __init__(self, table: dict[tuple[int, int], float], smoothing: float = 0.2):
        if not table:
            raise ValueError("a cost model needs at least one measured point")
        self.table = dict(table)
        self.smoothing = smoothing
        self.rows = sorted({r for r, _ in table})
        self.widths = sorted({t for _, t in table})
        self.scale = 1.0  # observed / measured level (see observe)
        self.residual: dict[tuple[int, int], float] = {}  # (rows, width > 1) -> observed / predicted shape (see observe)
        self.since_plain = self.FRESH + 1  # steps since the last plain one (none yet)
        self._interpolated: dict[tuple[int, int], float] = {}  # the table does not change: each size interpolated once

    def __call__(self, rows: int, width: int) -> float:
        return self._interp(rows, width) * self.scale * self.residual.get((rows, width), 1.0)

    def _interp(self, rows: int, width: int) -> float:
        seconds = self._interpolated.get((rows, width))
        if seconds is None:  # k=auto asks for every width at every step: a dict read, not an interpolation, each time
            seconds = self._interpolated[(rows, width)] = self._interpolate(rows, width)
        return seconds

    def _interpolate(self, rows: int, width: int) -> float:
        def along(points, x, value):
            i = bisect.bisect_left(points, x)
            if i < len(points) and points[i] == x:
                return value(points[i])
            lo, hi = (points[i - 1], points[i]) if 0 < i < len(points) else ((points[-1], None) if i else (None, points[0]))
            if hi is None:
                return value(lo) * x / lo
            if lo is None:
                return value(hi) * x / hi if x > 0 else value(hi)
            w = (x - lo) / (hi - lo)
            return value(lo) * (1 - w) + value(hi) * w

        def at_rows(r):
            return along(self.widths, width, lambda t: self._point(r, t))

        return along(self.rows, rows, at_rows)

    def _point(self, rows: int, width: int) -> float:
        if (rows, width) in self.table:
            return self.table[(rows, width)]
        # an incomplete grid: the nearest measured point, scaled by tokens
        (r, t), s = min(self.table.items(), key=lambda kv: abs(kv[0][0] - rows) + abs(kv[0][1] - width))
        return s * (rows * width) / (r * t)

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """Fold in a real step. Every step moves the level (a moving average of observed / predicted): a longer
        context makes every width dearer, and a row that drafts at every step must not leave it stale. A wider step
        that comes within ``FRESH`` steps of a plain one (the level then is that of its context) also corrects the
        shape at its own size: how much more than a plain step it costs, as measured at start-up, which a calibration
        over a short context can get wrong (on this CPU a 128-token calibration put 8 tokens at 1.78x a plain step,
        where verifying them in generation cost 1.99x). A size whose cost was underestimated gets drafted, observed
        and corrected; one whose cost was overestimated is not drafted again, so one slow step (the collector,
        another process) moves a shape by at most 2%.

        >>> c = CostModel({(1, 1): 1.0, (1, 3): 2.0})
        >>> for _ in range(100):
        ...     c.observe(1, 1, 0.5); c.observe(1, 3, 1.5)
        >>> round(c(1, 1), 3), round(c(1, 3), 3), round(c(1, 2), 3)   # width 2 never seen: the calibrated shape
        (0.5, 1.5, 0.75)
        >>> d = CostModel({(1, 1): 1.0, (1, 2): 1.1})
        >>> for seconds in [1.1 * 1.01**i for i in range(40)]:      # drafting at every step while the context grows
        ...     d.observe(1, 2, seconds)
        >>> round(d(1, 2) / d(1, 1), 3), round(d(1, 2), 2)         # the growth went to the level, not to the shape
        (1.1, 1.56)
        """
        key = (rows, width)
        base, shape = self._interp(rows, width), self.residual.get(key, 1.0)
        self.scale += self.smoothing * (seconds / max(base * shape, 1e-12) - self.scale)
        self.since_plain = 0 if width <= 1 else self.since_plain + 1
        if width > 1 and self.since_plain <= self.FRESH:
            ratio = min(max(seconds / max(base * self.scale, 1e-12), shape * 0.9), shape * 1.1)
            self.residual[key] = shape + self.smoothing * (ratio - shape)

    def to_dict(self) -> dict:
        return {"points": [[r, t, s] for (r, t), s in sorted(self.table.items())]}

    @classmethod
    def from_dict(cls, data: dict) -> CostModel:
        return cls({(int(r), int(t)): float(s) for r, t, s in data["points"]})

    @classmethod
    def measure(
        cls,
        target,
        rows=CALIBRATION_ROWS,
        widths=CALIBRATION_WIDTHS,
        context: int = 256,
        repeats: int = 3,
        max_rows: int | None = None,
        tree_widths=TREE_WIDTHS,
        progress: bool = True,
    ) -> CostModel:
        """Time ``target`` (a ``ModelAdapter``) on every (rows, width) of the grid over a ``context``-token cache.

        Each point is the fastest of its timed forwards (the least disturbed by other work): ``repeats`` rounds, after
        one that warms up, each taking every width in another order, ``BURST`` forwards a width, the first of them
        untimed (after a 64-token forward a one-token one took 4.5-4.7 ms here, the fourth 3.7); and no point costs more
        than a wider one of its rows (:func:`monotone`). One timing a point put two tokens at 1.16x a plain step on this
        CPU, where they cost 1.08x over 30 timings; :meth:`observe` corrects an underestimate as soon as the width is
        drafted, but never an overestimate (a width it does not try). Timed point after point, the first points after
        the prefill ran slow: two tokens measured at 1.006x one (kept in the calibration file), where they cost
        1.09-1.15x in rounds and 1.06-1.15x inside generation, so SpS drafted one token at every step where it lost 6%
        (the premium never shows while a row drafts at every step: :meth:`observe` corrects a width's shape only near a
        plain step). One row is also timed at ``tree_widths``: the token trees a drafter sizes by this model
        (``decoding.trees.hardware``). The ``context`` is about a generation's (a prompt and an answer): over 128 tokens
        SmolLM2's 5 and 8 tokens cost 1.65-1.68x and 1.74-1.76x a plain step here, over 256 1.77x and 1.88x, and the
        steps of a run cost more than the 128-token grid said (k=auto's learned shapes: 1.06-1.13x it). ``progress``: a
        bar on a terminal (a model's first measurement takes a minute or two on a small CPU, and said nothing before).
        """
        from tqdm.auto import tqdm

        rows = [r for r in rows if max_rows is None or r <= max_rows] or [1]
        if widths is CALIBRATION_WIDTHS and torch.device(target.device).type == "cuda":
            widths = CALIBRATION_WIDTHS + GPU_WIDTHS  # where wide steps cost no more than narrow ones: measure them
        one_row = sorted(set(widths) | set(tree_widths))  # one row also verifies token trees of up to 64 nodes
        table = {}
        vocab = min(int(target.vocab_size), 1000)
        gen = torch.Generator().manual_seed(0)
        points = sum(len(one_row if r == 1 else widths) for r in rows) * (repeats + 1)  # a bar step: a width's burst
        desc = "measuring the forward's cost (once per model, dtype, threads)"
        bar = tqdm(total=points, desc=desc, leave=False, disable=None if progress else True)  # None: a terminal only
        for r in rows:
            these = one_row if r == 1 else widths
            cache = target.new_cache(r, context + max(these))
            ids = torch.randint(0, vocab, (r, context), generator=gen, device="cpu").to(target.device)
            target.forward(cache, 0, input_ids=ids)
            steps = {t: torch.randint(0, vocab, (r, t), generator=gen, device="cpu").to(target.device) for t in these}
            for i in range(repeats + 1):  # rounds over every width, each round in another order; the first warms up
                for t in these[i % len(these) :] + these[: i % len(these)]:
                    for j in range(BURST):  # the first forward of a width after another width's runs slow: not timed
                        synchronize(target.device)  # nothing of the previous forward in this one's time
                        t0 = time.perf_counter()
                        target.logits(target.forward(cache, [context] * r if r > 1 else context, input_ids=steps[t]))
                        synchronize(target.device)  # the device's time, not the time to queue its work
                        if i and j:
                            table[(r, t)] = min(table.get((r, t), float("inf")), time.perf_counter() - t0)
                    bar.update()
        bar.close()
        return cls(monotone(table))


def stale(stored: CostModel, fresh: CostModel, tolerance: float = CHECK_TOLERANCE) -> str | None:
    """Why a stored table does not describe the machine now, from a ``fresh`` measurement of a plain step and a wider
    one (None: it holds). A table measured while other work shared the machine stays wrong for good: on this CPU one
    measured beside a test run put a plain step at 4.65 ms and four tokens at 1.13x it, where alone they cost 3.4 ms
    and 1.42x, so k=auto saw a wider verification as nearly free and drafted where it lost. So: a plain step that now
    runs more than ``tolerance`` faster than stored (the table was measured under load), or, at the stored level, a
    wider step whose premium over a plain one moved by more than ``tolerance``. A machine busier now than when it was
    measured keeps its table: the quieter measurement is the truer one.

    >>> quiet = CostModel({(1, 1): 0.0034, (1, 4): 0.0048})
    >>> loaded = CostModel({(1, 1): 0.00465, (1, 4): 0.00526})
    >>> stale(loaded, quiet)
    'a plain step now 3.40 ms, stored 4.65 ms'
    >>> stale(quiet, loaded) is None, stale(quiet, CostModel({(1, 1): 0.0035, (1, 4): 0.0050})) is None
    (True, True)
    >>> stale(CostModel({(1, 1): 0.0034, (1, 4): 0.0039}), quiet)
    '4 tokens now 1.41x a plain step, stored 1.15x'
    """
    plain, now = stored._interp(1, 1), fresh._interp(1, 1)
    if now < plain * (1 - tolerance):
        return f"a plain step now {now * 1e3:.2f} ms, stored {plain * 1e3:.2f} ms"
    width = max(t for r, t in fresh.table if r == 1)
    was, new = stored._interp(1, width) / plain, fresh._interp(1, width) / now
    if now <= plain * (1 + tolerance) and abs(new / was - 1) > tolerance:
        return f"{width} tokens now {new:.2f}x a plain step, stored {was:.2f}x"
    return None


def monotone(table: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """Measured forward costs with no width dearer than a wider one of the same rows (each point the least of itself
    and every wider point): a timing's noise only ever adds, so the lower reading is the truer one.

    >>> monotone({(1, 1): 1.0, (1, 2): 1.6, (1, 3): 1.3, (1, 4): 1.5})
    {(1, 1): 1.0, (1, 2): 1.3, (1, 3): 1.3, (1, 4): 1.5}
    """
    out = dict(table)
    for (r, t), seconds in table.items():
        out[(r, t)] = min([seconds] + [s for (r2, t2), s in table.items() if r2 == r and t2 > t])
    return out
