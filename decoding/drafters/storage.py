"""How a trained drafter's weights are stored: each matrix as its change from the target tensor it started from,
quantised in small groups; vectors and integer tensors as they are.

Every trained part starts as a copy of part of its target (Kangaroo's adapter as the layer after its exit layer, the
distilled draft as the first layers, EAGLE's layer as the last one, a trimmed head as the target's head rows of its
tokens) and training moves it a little: for the drafters shipped with SmolLM2-135M the change is 2-20% of a
matrix's norm. So a matrix W is stored as its *base* B (the module as its recipe builds it from the target, rounded
to bfloat16: the same for a float32 or a bfloat16 load of the target) plus the change D = W - B in ``bits``-bit
symmetric groups of ``group`` values with a float16 scale each:

    D[i] ~ (q[i] - (2^bits - 1) / 2) * scale[g],   q in 0 .. 2^bits - 1,   g = i // group

The small changes (``bits``) are stored on the *normal* grid (``grid="normal"``, the default): the 2^bits values that
minimise the squared error of a normally distributed value (Lloyd-Max; at 2 bits +-0.453 and +-1.510), in units of
the group's root mean square (its float16 scale):

    D[i] ~ NORMAL_LEVELS[bits][q[i]] * scale[g],   scale[g] = rms of group g

Training's changes are bell-shaped, and the uniform grid spends two of its four values on the group's largest
change and its mirror: the eagle head shipped with SmolLM2-135M agreed 0.448 with its target as trained (held-out
top-1), 0.390 on the uniform grid and 0.424 on the normal one, in the same 3.2 MB (a grid fitted to each matrix by
k-means, its squared error lower still, 0.399: it shrinks the largest changes). The layout records each matrix's
grid; an artifact written before it has none and reads as uniform.

A 2-bit change is far finer than a 4-bit weight (its error is a fraction of the change, not of the weight). A
change that is not small (over ``max_change`` of the matrix's norm: EAGLE's input layers learn a new map over
their identity start) gets ``large_bits``, and a matrix with no base (a randomly initialised part, Hydra's first
layers) ``own_bits``. The target is checked: the artifact records a hash of the bases it was stored against, and a target
whose tensors differ (another model, other weights) fails to load with one line, never a silent wrong drafter.

>>> x = torch.tensor([[0.30, -0.10, 0.05, -0.30], [1.0, 0.0, 0.0, -0.5]])
>>> codes, scale = quantize(x, bits=2, group=4)
>>> codes.dtype, codes.numel(), scale.numel()                   # 8 values, 2 bits each: 2 bytes; a scale per group
(torch.uint8, 2, 2)
>>> dequantize(codes, scale, 2, 4, x.shape)
tensor([[ 0.2999, -0.1000,  0.1000, -0.2999],
        [ 0.9998,  0.3333,  0.3333, -0.3333]])
>>> codes, scale = quantize(x, bits=2, group=4, grid="normal")       # the same bytes; the scale is the group's rms
>>> dequantize(codes, scale, 2, 4, x.shape, grid="normal")
tensor([[ 0.3313, -0.0993,  0.0993, -0.3313],
        [ 0.8444, -0.2532, -0.2532, -0.2532]])
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

BITS = (1, 2, 4, 8)
# the values of a normally distributed value (unit variance) that minimise its squared error, 2^bits of them (Lloyd-Max)
NORMAL_LEVELS = {
    1: (-0.7979, 0.7979),
    2: (-1.5104, -0.4528, 0.4528, 1.5104),
    4: (-2.7326, -2.0690, -1.6180, -1.2562, -0.9424, -0.6568, -0.3881, -0.1284)
    + (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326),
}
LAYOUT_KEY = "specray.layout"  # the weights file's metadata: {tensor: how it is stored}
BASE_KEY = "specray.base"  # the hash of the bases the matrices were stored against


def has_grid(grid: str, bits: int) -> bool:
    """Whether values of ``bits`` bits can be stored on ``grid`` (the normal grid has levels for 1, 2 and 4 bits)."""
    return grid == "uniform" or (grid == "normal" and bits in NORMAL_LEVELS)


class StorageError(ValueError):
    """A weights file that does not decode (corrupt, truncated, or stored against other base tensors)."""


@dataclass(frozen=True)
class Storage:
    """How ``save_artifact`` stores matrices: a small change from its base (``|D| <= max_change * |W|``) in ``bits``
    per value, on ``grid`` (``normal``: the values that fit a bell-shaped change best; ``uniform``: evenly spaced up to
    the group's largest); a large change (a part that learned a new map, such as EAGLE's input layers over their identity
    start) in ``large_bits``; a matrix with no base in ``own_bits``; ``group`` values share a float16 scale. The
    defaults keep the four drafters shipped for SmolLM2-135M within 12 MB together, at a held-out agreement 0.01-0.03
    below the weights as trained (docs/drafters.md).

    >>> Storage().bytes_per_value(2), Storage(group=128).bytes_per_value(8)
    (0.28125, 1.015625)
    >>> Storage(bits=3)
    Traceback (most recent call last):
    ...
    ValueError: bits: must be one of 1, 2, 4, 8, got 3
    """

    bits: int = 2
    large_bits: int = 4
    own_bits: int = 8
    max_change: float = 0.25
    group: int = 64
    grid: str = "normal"

    def __post_init__(self):
        for name in ("bits", "large_bits", "own_bits"):
            if getattr(self, name) not in BITS:
                raise ValueError(f"{name}: must be one of {', '.join(map(str, BITS))}, got {getattr(self, name)}")
        if not isinstance(self.group, int) or self.group < 8 or self.group % 8:
            raise ValueError(f"group: must be a multiple of 8, got {self.group}")
        if not 0 <= self.max_change <= 1:
            raise ValueError(f"max_change: must be in [0, 1], got {self.max_change}")
        if not has_grid(self.grid, self.bits):
            raise ValueError(f"grid: must be uniform, or normal with bits of 1, 2 or 4, got {self.grid} with {self.bits} bits")

    def bytes_per_value(self, bits: int) -> float:
        return bits / 8 + 2 / self.group

    def to_dict(self) -> dict:
        scheme = "matrices as symmetric groups of their change from the target's tensors, float16 scales"
        fields = {"bits": self.bits, "large_bits": self.large_bits, "own_bits": self.own_bits, "max_change": self.max_change}
        return {**fields, "group": self.group, "grid": self.grid, "scheme": scheme}

    @classmethod
    def from_dict(cls, d: dict) -> Storage:
        fields = ("bits", "large_bits", "own_bits", "max_change", "group", "grid")
        return cls(**{"grid": "uniform", **{k: v for k, v in d.items() if k in fields}})  # written before grids: uniform


def quantize(x: torch.Tensor, bits: int, group: int, grid: str = "uniform") -> tuple[torch.Tensor, torch.Tensor]:
    """x (any shape, float) -> (codes uint8 [ceil(n / group) * group * bits / 8], scale float16 [ceil(n / group)]).

    ``uniform``: symmetric round-to-nearest per group, ``value = (q - (2^bits - 1) / 2) * scale`` with
    ``scale = 2 * max|x| / (2^bits - 1)`` (rounded to float16 before the codes are chosen against it): a group's
    largest values are kept. Scales clipped to minimise the squared error round 3-5% less off at 2 bits, but they
    cut the largest changes training made, and cost held-out agreement (0.013 against 0.002 for the Kangaroo adapter
    at exit layer 6). ``normal``: ``value = NORMAL_LEVELS[bits][q] * scale``, ``scale`` the group's root mean square,
    each value to its nearest level.
    """
    q, scale = _codes(x, bits, group, grid)
    return pack(q.flatten(), bits), scale


def _codes(x: torch.Tensor, bits: int, group: int, grid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize`'s choice, unpacked: (codes uint8 [G, group], scale float16 [G])."""
    if not has_grid(grid, bits):
        raise ValueError(f"grid: no {grid} grid of {bits} bits")
    flat = x.detach().float().flatten()
    groups = torch.nn.functional.pad(flat, (0, (-flat.numel()) % group)).view(-1, group)  # [G, group]
    levels = 2**bits - 1
    if grid == "normal":
        scale = groups.pow(2).mean(1).sqrt().to(torch.float16)  # [G]
        s = scale.float()[:, None].clamp_min(1e-30)
        grid_values = torch.tensor(NORMAL_LEVELS[bits], device=groups.device)
        edges = (grid_values[1:] + grid_values[:-1]) / 2  # a value goes to the level whose interval holds it
        return torch.bucketize((groups / s).contiguous(), edges).to(torch.uint8), scale
    scale = (2 * groups.abs().amax(1) / levels).to(torch.float16)  # [G]
    s = scale.float()[:, None]
    q = torch.where(s > 0, torch.round(groups / s.clamp_min(1e-30) + levels / 2), torch.full_like(groups, levels // 2))
    return q.clamp(0, levels).to(torch.uint8), scale


def _values(q: torch.Tensor, scale: torch.Tensor, bits: int, grid: str) -> torch.Tensor:
    """Codes [G, group] and their scales [G] -> the float32 values they stand for, [G, group]."""
    values = torch.tensor(NORMAL_LEVELS[bits], device=q.device)[q.long()] if grid == "normal" else q.float() - (2**bits - 1) / 2
    return values * scale.float()[:, None]


def dequantize(codes: torch.Tensor, scale: torch.Tensor, bits: int, group: int, shape, grid: str = "uniform") -> torch.Tensor:
    """The float32 tensor of ``shape`` that :func:`quantize` stored as ``codes`` and ``scale`` on ``grid``."""
    if not has_grid(grid, bits):
        raise StorageError(f"no {grid} grid of {bits} bits")
    n = 1
    for d in shape:
        n *= int(d)
    q = unpack(codes, bits).view(-1, group)  # [G, group]
    if q.shape[0] != scale.numel() or q.numel() < n or q.numel() - n >= group:
        raise StorageError(f"{codes.numel()} bytes of {bits}-bit codes and {scale.numel()} scales do not hold {list(shape)}")
    return _values(q, scale, bits, grid).flatten()[:n].view(*shape)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [n] (each < 2^bits, n a multiple of 8 / bits) -> bytes [n * bits / 8], the first code in the low bits.

    >>> pack(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist()   # 1 + 2*4 + 3*16 + 0*64
    [57]
    """
    per = 8 // bits
    q = q.view(-1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (q << shifts).sum(1).to(torch.uint8)


def unpack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [m] -> codes [m * 8 / bits] (inverse of :func:`pack`).

    >>> unpack(torch.tensor([57], dtype=torch.uint8), 2).tolist()
    [1, 2, 3, 0]
    """
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return ((codes.to(torch.int32)[:, None] >> shifts) & (2**bits - 1)).to(torch.uint8).flatten()


def is_matrix(t: torch.Tensor) -> bool:
    """Stored quantised: floating tensors of two or more dimensions (vectors and ids are stored as they are)."""
    return t.is_floating_point() and t.dim() >= 2


def base_hash(bases: dict[str, torch.Tensor]) -> str:
    """A hash of the bases (bfloat16 bytes, by name): equal for the target it was stored against, in any dtype."""
    h = hashlib.sha1()
    for name in sorted(bases):
        h.update(name.encode())
        h.update(bases[name].detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _plan(t: torch.Tensor, base: torch.Tensor | None, storage: Storage) -> tuple[torch.Tensor, int, str, torch.Tensor | None]:
    """How :func:`encode` stores one matrix ``t``: (the values it quantises, their bits, their grid, the base they are a
    change from, rounded to bfloat16, or None). A change at least as large as the matrix stores the matrix itself. On
    ``t``'s device (:func:`encode` passes CPU tensors; :func:`as_stored` on a GPU rounds there)."""
    w = t.detach().float()
    if base is not None:
        base = base.detach().to(device=w.device, dtype=torch.bfloat16)
        change = w - base.float()
        if change.norm() < w.norm():
            bits = storage.bits if change.norm() <= storage.max_change * w.norm() else storage.large_bits
            return change, bits, storage.grid if bits == storage.bits else "uniform", base  # the small changes on the grid
    return w, storage.own_bits, "uniform", None


def as_stored(t: torch.Tensor, base: torch.Tensor | None, storage: Storage) -> torch.Tensor:
    """The float32 matrix that an artifact in ``storage`` loads back for ``t`` stored against ``base``: :func:`decode`
    of :func:`encode`, one matrix at a time (training as stored computes with it). On ``t``'s device: on a GPU a step's
    rounding stays there (its reductions may round the last bit of a scale otherwise than the CPU's, so a rare code
    differs from what the CPU stores).

    >>> w, base = torch.tensor([[0.30, -0.10, 0.05, -0.30] * 2]), torch.tensor([[0.25, -0.10, 0.0, -0.25] * 2])
    >>> tensors, meta = encode({"w": w}, {"w": base}, Storage(group=8))
    >>> torch.equal(as_stored(w, base, Storage(group=8)), decode(tensors, meta, {"w": base})["w"])
    True
    """
    x, bits, grid, used = _plan(t, base, storage)
    q, scale = _codes(x, bits, storage.group, grid)  # what encode packs, unpacked
    y = _values(q, scale, bits, grid).flatten()[: x.numel()].view(x.shape)
    return y + used.float() if used is not None else y


def encode(state: dict[str, torch.Tensor], bases: dict[str, torch.Tensor], storage: Storage) -> tuple[dict, dict]:
    """A module's state -> (tensors to write, metadata). ``bases``: for each matrix that has one, the tensor it started
    from (rounded to bfloat16 here; a change at least as large as the matrix stores the matrix itself)."""
    tensors, layout, used = {}, {}, {}
    for name, t in state.items():
        t = t.detach().cpu()
        if not is_matrix(t):
            ids = not t.is_floating_point() and t.numel() and -(2**31) <= int(t.min()) and int(t.max()) < 2**31
            tensors[name] = t.to(torch.int32).contiguous() if ids else t.contiguous()
            layout[name] = {"plain": str(t.dtype).removeprefix("torch.")}
            continue
        x, bits, grid, base = _plan(t, bases.get(name), storage)
        if base is not None:
            used[name] = base
        codes, scale = quantize(x, bits, storage.group, grid)
        tensors[name + ".q"], tensors[name + ".scale"] = codes, scale
        layout[name] = {"bits": bits, "group": storage.group, "shape": list(t.shape), "base": name in used}
        if grid != "uniform":
            layout[name]["grid"] = grid
    return tensors, {LAYOUT_KEY: json.dumps(layout, sort_keys=True), BASE_KEY: base_hash(used)}


def bits_used(metadata: dict) -> dict[str, int]:
    """How many matrices a weights file stores at each width: {"2": 20, "4": 1, ...}."""
    counts: dict[str, int] = {}
    for entry in (layout_of(metadata) or {}).values():
        if "bits" in entry:
            counts[str(entry["bits"])] = counts.get(str(entry["bits"]), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))


def layout_of(metadata: dict | None) -> dict | None:
    """The per-tensor layout of a weights file's metadata (None: a dense file, every tensor as it is)."""
    if not metadata or LAYOUT_KEY not in metadata:
        return None
    try:
        layout = json.loads(metadata[LAYOUT_KEY])
    except json.JSONDecodeError as e:
        raise StorageError(f"its layout is not JSON ({e})") from None
    if not isinstance(layout, dict):
        raise StorageError("its layout is not a table of tensors")
    return layout


def decode(tensors: dict[str, torch.Tensor], metadata: dict | None, bases: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state a module loads (matrices float32) from what :func:`encode` wrote; ``bases`` as at encoding, for
    the matrices whose layout says ``base`` (their hash must match the one recorded)."""
    layout = layout_of(metadata)
    if layout is None:
        return dict(tensors)
    need = {n for n, e in layout.items() if e.get("base")}
    missing = sorted(need - set(bases))
    if missing:
        raise StorageError(f"it stores {missing[0]} against a base this drafter does not have")
    if base_hash({n: bases[n] for n in need}) != metadata.get(BASE_KEY):
        raise StorageError("it was stored against other base tensors: the target's weights differ from the ones it was trained on")
    out = {}
    try:
        for name, e in layout.items():
            if "plain" in e:
                t = tensors[name]
                out[name] = t if t.is_floating_point() else t.to(getattr(torch, e["plain"]))
                continue
            bits, grid = int(e["bits"]), e.get("grid", "uniform")  # no grid: written before grids, uniform
            x = dequantize(tensors[name + ".q"], tensors[name + ".scale"], bits, int(e["group"]), e["shape"], grid)
            out[name] = x + bases[name].detach().cpu().to(torch.bfloat16).float() if e["base"] else x
    except KeyError as e:
        raise StorageError(f"the tensor {e.args[0]} its layout names is missing") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise StorageError(f"its layout does not describe its tensors ({e})") from None
    return out
