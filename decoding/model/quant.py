"""Weights as shipped: a GGUF's 4-bit blocks run natively by torch's packed int4 kernel, and int8 weight-only.

The bundled SmolLM2 GGUF stores its decoder layers as Q4_1 (groups of 32 weights along the input, each group
a float16 scale ``d`` and minimum ``m``: ``w = d * q + m`` with ``q`` in 0..15) and its tied embedding / LM head
as Q8_0 (groups of 32, a float16 scale: ``w = d * q`` with ``q`` in -128..127). Loading it through
transformers de-quantises every weight to float, so a bfloat16 step reads 270 MB of weights; reading the
blocks as they are reads a quarter of that.

torch's CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``) computes ``x @ W.T`` with
``W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n]`` for ``u`` in 0..15 (``g = k // 32``), accumulating in
float32. Q4_1 maps onto it exactly: ``u = q``, ``scale = d``, ``zero = m + 8 d``. Q8_0 does not fit in four
bits, but ``q = 16 hi + lo`` with ``lo = q & 15`` and ``hi = q >> 4`` in -8..7 does: the kernel runs the
concatenation ``[hi + 8 | lo]`` along the input (scales ``16 d`` and ``d``, zeros ``0`` and ``8 d``) against
``[x | x]``, which sums to ``d * q``. The kernel keeps scale and zero in the activations' dtype, so in
bfloat16 each group's ``d`` and ``m + 8 d`` are rounded to bfloat16 (8 significant bits; the weights of the
dense bfloat16 path are rounded the same way, one by one): :func:`reference_weight` is that weight exactly,
and ``tests/decoding/model/test_quant.py`` checks the kernel against it and against the GGUF's own numbers.

The kernel's cost grows with the input rows, so past ``max_rows`` rows a linear routes its input to the dense
weights of the same model (the GGUF's values de-quantised and rounded to the dtype), where a blocked GEMM reuses
each weight across rows. A lone projection whose weights sit in the cache favours the GEMM early (one thread,
bfloat16: a 3072x576 projection takes 98 us as int4 against 142 us dense at one row, 170 vs 171 at four and 335
vs 232 at eight), but a whole forward streams every weight from memory and the dense weights are four times the
bytes: the bundled model's step over a 300-token cache (2 threads) costs 19-23 ms from one to four tokens on the
packed path, and 31 / 36 / 46 / 55 ms at 5 / 8 / 12 / 16 tokens, against 47 / 45 / 62 / 60 ms on the dense one.
Verification blocks of up to 16 tokens therefore stay packed (``MAX_ROWS``); prefill chunks go dense. Where
``kernels.install()`` registered a faster kernel for the same weights (``kernels/cpu_int4.py`` on AVX512-BF16 CPUs:
bfloat16 dot products, the Q8_0 head in one 8-bit pass), a packed linear runs that (``PackedLinear.fast``).

``quant`` (a ``SpecConfig`` field):

* ``auto``: ``q4`` for a GGUF whose layers are Q4_1 run in bfloat16 on a CPU, else ``none``;
* ``none``: the dense weights in the run's dtype;
* ``q4``: the GGUF's own Q4_1/Q8_0 blocks; a model without them (a local HF directory) is quantised to
  Q4_1-style groups of 32 here (lossy against that model: the target *is* the quantised model then);
* ``int8``: symmetric per-output-channel int8 of the dense weights (``aten._weight_int8pack_mm``), any model.

A linear whose shape the kernels cannot take (output rows not a multiple of 16, inputs not a multiple of 32)
stays dense. CUDA has no packed-int4 path here: ``q4``/``int8`` on a GPU fail naming the field, and ``auto``
runs dense there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from decoding import accel
from decoding.errors import ConfigError

# what a load may ask for; decoding.config.QUANTS declares the same names torch-free for SpecConfig (as config.DTYPES
# and models.DTYPES do for dtypes): the model room reads no declaration, whose table reaches down to the drafters
QUANTS = ("auto", "none", "q4", "int8")
GROUP = 32  # Q4_1 / Q8_0 block size, and the int4 kernel's group size
MAX_ROWS = 16  # input rows up to which a forward on the packed kernels beats the dense GEMM here (module docstring)
Q4_1_BYTES, Q8_0_BYTES = 20, 34  # one block: float16 d, float16 m, 16 bytes of nibbles / float16 d, 32 int8


# ---- GGUF blocks -> integer weights and group parameters (numpy, exact) ---------------------------------------------


def q4_1_blocks(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's bytes [N, cols / 32 * 20] as (q uint8 [N, cols], d float32 [N, cols/32], m float32 [N, cols/32]).

    Within a block the low nibbles hold elements 0..15 and the high nibbles 16..31 (ggml's layout).

    >>> import gguf
    >>> w = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
    >>> q, d, m = q4_1_blocks(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), 64)
    >>> bool(np.array_equal((q.reshape(1, 2, 32) * d[..., None] + m[..., None]).reshape(1, 64),
    ...      gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1), gguf.GGMLQuantizationType.Q4_1)))
    True
    """
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, cols // GROUP, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, cols)
    return q, d, m


def q8_0_blocks(raw: np.ndarray, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 tensor's bytes [N, cols / 32 * 34] as (q int8 [N, cols], d float32 [N, cols/32])."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, cols // GROUP, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(n, cols)
    return q, d


def q4_1_from_dense(weight: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1-style groups of 32 for a dense weight [N, K] (scale and minimum rounded to float16, as a GGUF stores
    them): (q, d, m) as :func:`q4_1_blocks` returns them. Lossy: used for models that ship no 4-bit blocks."""
    w = weight.detach().float().cpu().numpy()
    n, k = w.shape
    groups = w.reshape(n, k // GROUP, GROUP)
    lo, hi = groups.min(-1), groups.max(-1)
    d = ((hi - lo) / 15.0).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)
    q = np.clip(np.rint((groups - m[..., None]) / safe[..., None]), 0, 15).astype(np.uint8).reshape(n, k)
    return q, d, m


# ---- packed linears --------------------------------------------------------------------------------------------------


def _kernel_shape_ok(out_features: int, in_features: int) -> bool:
    return out_features % 16 == 0 and in_features % GROUP == 0


def _no_kernel(linear) -> None:
    return None


@dataclass
class PackedLinear:
    """``x @ W.T`` by a packed weight-only kernel for inputs of up to ``max_rows`` rows, by ``dense`` beyond.

    ``kind`` is ``int4`` (``packed`` [N, K'/2] uint8 from torch's int4 packer, ``scale_zero`` [K'/32, N, 2]) or
    ``int8`` (``packed`` [N, K] int8, ``scale_zero`` [N] per-channel scales). ``repeat`` > 1: the kernel's input
    is ``repeat`` copies of x side by side (the Q8_0 head as a pair of 4-bit halves). ``fast``: a faster kernel for
    the same weights where one is registered (``int4_linear`` in ``decoding.accel``: ``kernels/cpu_int4.py``, AVX512-BF16
    CPUs), chosen once when the linear is made; a forward being compiled runs torch's kernel.
    """

    kind: str
    packed: torch.Tensor
    scale_zero: torch.Tensor
    dense: torch.Tensor  # [N, K] the same weights, dense, for wide inputs
    repeat: int = 1
    max_rows: int = MAX_ROWS
    group: int = GROUP  # the int4 kernel's group size (read by the fast layers, which call the kernels directly)
    fast: object = field(default=None, init=False, repr=False)  # x [M, K] -> [M, N] (repeats its own), or None: torch's kernel

    def __post_init__(self):
        self.fast = accel.dispatch("int4_linear", _no_kernel, self)

    @property
    def out_features(self) -> int:
        return self.dense.shape[0]

    def runs_fast(self, x: torch.Tensor, rows: int) -> bool:
        """Whether ``rows`` rows of ``x`` go to :attr:`fast`: up to ``accel.FAST_MAX_ROWS`` rows in the kernel's dtype,
        outside a forward being compiled (which calls torch's kernels)."""
        fits = self.fast is not None and rows <= accel.FAST_MAX_ROWS and x.dtype == self.scale_zero.dtype
        return fits and not torch.compiler.is_compiling()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [.., K] -> [.., N]
        rows = x.numel() // x.shape[-1]
        if self.runs_fast(x, rows):
            return self.fast(x.reshape(rows, x.shape[-1])).view(*x.shape[:-1], self.out_features)  # it reads repeats itself
        if rows > self.max_rows or x.dtype != self.scale_zero.dtype:
            return F.linear(x, self.dense)
        flat = x.reshape(rows, x.shape[-1])
        if self.repeat > 1:
            flat = flat.repeat(1, self.repeat)
        if self.kind == "int4":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.contiguous(), self.packed, GROUP, self.scale_zero)
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat.contiguous(), self.packed, self.scale_zero)
        return out.view(*x.shape[:-1], self.out_features)


def pack_q4(q: np.ndarray, d: np.ndarray, m: np.ndarray, dense: torch.Tensor, overwrite: bool = False) -> PackedLinear:
    """The int4 kernel's form of Q4_1 groups: u = q, scale = d, zero = m + 8 d (in the dense weight's dtype).

    ``overwrite``: the dense weight becomes the kernel's weight rounded to its dtype (a model quantised here:
    wide inputs must compute the same quantised model as narrow ones).
    """
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
    scale_zero = torch.from_numpy(np.stack([d.T, (m + 8.0 * d).T], axis=-1)).to(dense.dtype).contiguous()
    if overwrite:
        scale, zero = (scale_zero[..., i].float().T.repeat_interleave(GROUP, dim=1) for i in (0, 1))  # [N, K]
        with torch.no_grad():
            dense.copy_(((torch.from_numpy(q.astype(np.float32)) - 8.0) * scale + zero).to(dense.dtype))
    return PackedLinear("int4", packed, scale_zero, dense)


def pack_q8_as_q4(q: np.ndarray, d: np.ndarray, dense: torch.Tensor) -> PackedLinear:
    """Q8_0 groups as two 4-bit halves along the input: [hi + 8 | lo] with scales [16 d | d], zeros [0 | 8 d].

    >>> q = np.array([[-128, -1, 0, 7, 127] + [3] * 27], dtype=np.int8); hi, lo = q.astype(np.int32) >> 4, q.astype(np.int32) & 15
    >>> bool(np.array_equal(16 * hi + lo, q))
    True
    """
    wide = q.astype(np.int32)
    u = np.concatenate([(wide >> 4) + 8, wide & 15], axis=1)  # [N, 2K] in 0..15
    scale = np.concatenate([16.0 * d, d], axis=1)  # [N, 2K/32]
    zero = np.concatenate([np.zeros_like(d), 8.0 * d], axis=1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u), 1)
    scale_zero = torch.from_numpy(np.stack([scale.T, zero.T], axis=-1)).to(dense.dtype).contiguous()
    return PackedLinear("int4", packed, scale_zero, dense, repeat=2)


def pack_int8(dense: torch.Tensor, overwrite: bool = True) -> PackedLinear:
    """Symmetric per-output-channel int8 of a dense weight [N, K]: w ~ s[n] * q[n, k], |q| <= 127.

    ``overwrite``: the dense weight becomes the int8 values times their scale (rounded to its dtype), so wide inputs
    compute the same quantised model as narrow ones.
    """
    w = dense.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).to(dense.dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    if overwrite:
        with torch.no_grad():
            dense.copy_((q.float() * scale.float()[:, None]).to(dense.dtype))
    return PackedLinear("int8", q, scale, dense)


def pack_dense(dense: torch.Tensor, mode: str, overwrite: bool = True) -> PackedLinear | None:
    """A dense weight [N, K] quantised here in ``mode`` (``q4``: Q4_1-style groups, ``int8``: per channel); None where
    the kernels cannot take its shape. ``overwrite``: the dense weight becomes the quantised one (see ``pack_q4``)."""
    if not _kernel_shape_ok(*dense.shape):
        return None
    if mode == "int8":
        return pack_int8(dense, overwrite)
    return pack_q4(*q4_1_from_dense(dense), dense, overwrite=overwrite)


def reference_weight(linear: PackedLinear) -> torch.Tensor:
    """The float32 weight [N, K] the kernel computes with (its scales and zeros as stored), for tests and checks."""
    if linear.kind == "int8":
        return linear.packed.float() * linear.scale_zero.float()[:, None]
    n = linear.out_features
    k_wide = linear.scale_zero.shape[0] * GROUP
    eye = torch.eye(k_wide, dtype=torch.float32)
    # the kernel applied to the identity reads the weight back column by column; in float32 (the same scales and
    # zeros, widened exactly) so that the read-back is not rounded to the activations' dtype
    scale_zero = linear.scale_zero.float()
    cols = []
    for start in range(0, k_wide, 256):
        block = eye[start : start + 256]
        cols.append(torch.ops.aten._weight_int4pack_mm_for_cpu(block, linear.packed, GROUP, scale_zero))
    wide = torch.cat(cols).T  # [N, K']
    k = k_wide // linear.repeat
    return wide.view(n, linear.repeat, k).sum(1) if linear.repeat > 1 else wide


# ---- a model's quantised weights -----------------------------------------------------------------------------------


@dataclass
class QuantWeights:
    """Packed linears of a model: per decoder layer the fused ``qkv`` and ``gate_up`` and ``o``/``down``, and the LM head.

    A missing entry (a shape the kernel cannot take) runs dense. ``mode`` is ``q4`` or ``int8``; ``source``
    says where the 4-bit values came from (``gguf``: the file's own blocks; ``dense``: quantised here).
    """

    mode: str
    source: str
    layers: list[dict[str, PackedLinear]] = field(default_factory=list)
    head: PackedLinear | None = None

    @property
    def implementation(self) -> str:
        """e.g. ``q4-gguf``; ``-fast`` where the linears run a registered kernel (``PackedLinear.fast``): its timings
        differ from torch's kernel's, so the cost calibrations are kept apart."""
        fast = any(linear.fast is not None for layer in self.layers for linear in layer.values())
        return f"{self.mode}-{self.source}" + ("-fast" if fast else "")


def resolve_quant(quant: str, gguf_q4: bool, dtype: torch.dtype, device: torch.device) -> str:
    """The quantisation a load runs: ``auto`` picks ``q4`` for a GGUF with Q4_1 layers in bfloat16 on a CPU.

    >>> resolve_quant("auto", True, torch.bfloat16, torch.device("cpu")), resolve_quant("auto", True, torch.float32, torch.device("cpu"))
    ('q4', 'none')
    """
    if quant not in QUANTS:
        raise ConfigError("quant", f"unknown quantisation {quant!r}; choose from {', '.join(QUANTS)}")
    if quant == "auto":
        return "q4" if gguf_q4 and dtype == torch.bfloat16 and device.type == "cpu" else "none"
    if quant != "none":
        if device.type != "cpu":
            raise ConfigError("quant", f"quant={quant} runs torch's packed CPU kernels; on {device.type} use quant=none (or auto)")
        if dtype != torch.bfloat16:
            raise ConfigError("quant", f"quant={quant} runs in bfloat16 (torch's packed kernels are fast only there); use dtype=bfloat16")
    return quant


def _reverse_permute_rows(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo the GGUF converter's rotary row permutation of q/k (the same rows transformers' loader reorders)."""
    dim = a.shape[0] // heads // 2
    return a.reshape(heads, dim, 2, *a.shape[1:]).swapaxes(2, 1).reshape(a.shape)


def _gguf_tensors(path) -> dict:
    from gguf import GGUFReader

    return {t.name: t for t in GGUFReader(str(path)).tensors}


def gguf_has_q4_layers(path) -> bool:
    """Whether a GGUF file's decoder projections are Q4_1 blocks (what ``quant=q4`` runs natively)."""
    from gguf import GGMLQuantizationType

    tensors = _gguf_tensors(path)
    projections = [t for name, t in tensors.items() if name.startswith("blk.") and name.endswith(("attn_q.weight", "ffn_down.weight"))]
    return bool(projections) and all(t.tensor_type == GGMLQuantizationType.Q4_1 for t in projections)


_GGUF_NAMES = {
    "q": "attn_q",
    "k": "attn_k",
    "v": "attn_v",
    "o": "attn_output",
    "gate": "ffn_gate",
    "up": "ffn_up",
    "down": "ffn_down",
}


def _layer_dense(layer) -> dict[str, torch.Tensor]:
    a, m = layer.self_attn, layer.mlp
    mods = {"q": a.q_proj, "k": a.k_proj, "v": a.v_proj, "o": a.o_proj, "gate": m.gate_proj, "up": m.up_proj, "down": m.down_proj}
    return {name: mod.weight for name, mod in mods.items()}


def _check_values(name: str, q, d, m, dense: torch.Tensor) -> None:
    """The blocks must be the weights the model was loaded with (rounded to its dtype): else the mapping is wrong."""
    groups = torch.from_numpy(q.astype(np.float32)).view(q.shape[0], -1, GROUP)
    values = groups * torch.from_numpy(d)[..., None]
    if m is not None:
        values = values + torch.from_numpy(m)[..., None]
    values = values.view(q.shape).to(dense.dtype)
    if not torch.equal(values, dense.detach().cpu()):
        raise ConfigError("quant", f"the GGUF tensor {name} does not hold the weights the model was loaded with; use quant=none")


def quantize_model(hf_model, mode: str, gguf_path=None, overwrite: bool = True, head: bool = True) -> QuantWeights:
    """Packed linears for every decoder layer and (``head``) the LM head of ``hf_model`` (already loaded, dense).

    ``mode`` ``q4`` reads the blocks from ``gguf_path`` when given (checked against the loaded weights), else
    quantises the dense weights; ``int8`` quantises the dense weights. Weights quantised here overwrite their dense
    copies (``overwrite``): wide inputs then compute the same model as narrow ones. A drafter keeps its weights as
    trained (``overwrite=False``: it only proposes, so its wide inputs may compute the dense weights).
    """
    from decoding.model.fast_layers import fused_weights

    base = hf_model.model
    cfg = hf_model.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    tensors = _gguf_tensors(gguf_path) if (mode == "q4" and gguf_path is not None) else None
    source = "gguf" if tensors is not None else "dense"
    out = QuantWeights(mode=mode, source=source)

    def q4_parts(index: int, name: str, dense: torch.Tensor):  # the GGUF's blocks of one projection
        t = tensors[f"blk.{index}.{_GGUF_NAMES[name]}.weight"]
        q, d, m = q4_1_blocks(np.asarray(t.data), dense.shape[1])
        if name in ("q", "k"):
            rows = heads if name == "q" else kv_heads
            q, d, m = (_reverse_permute_rows(x, rows) for x in (q, d, m))
        _check_values(t.name, q, d, m, dense)
        return q, d, m

    for index, layer in enumerate(base.layers):
        dense = _layer_dense(layer)
        qkv, gate_up = fused_weights(layer)
        packed: dict[str, PackedLinear] = {}
        groups = {
            "qkv": (("q", "k", "v"), qkv),
            "o": (("o",), dense["o"]),
            "gate_up": (("gate", "up"), gate_up),
            "down": (("down",), dense["down"]),
        }
        for key, (names, matrix) in groups.items():
            if not _kernel_shape_ok(*matrix.shape):
                continue
            if tensors is None:
                packed[key] = pack_dense(matrix, mode, overwrite)
                continue
            parts = [q4_parts(index, name, dense[name]) for name in names]
            q, d, m = (np.concatenate([p[i] for p in parts], axis=0) for i in range(3))
            packed[key] = pack_q4(q, d, m, matrix)
        out.layers.append(packed)

    weight = hf_model.lm_head.weight
    if head and _kernel_shape_ok(*weight.shape):
        if tensors is None:
            out.head = pack_dense(weight, mode, overwrite)
        elif "output.weight" not in tensors and "token_embd.weight" in tensors:
            t = tensors["token_embd.weight"]  # tied: the LM head is the embedding
            from gguf import GGMLQuantizationType

            if t.tensor_type == GGMLQuantizationType.Q8_0:
                q, d = q8_0_blocks(np.asarray(t.data), weight.shape[1])
                _check_values(t.name, q, d, None, weight)
                out.head = pack_q8_as_q4(q, d, weight)
    return out


# ---- the packed weights on disk (a GGUF's blocks are read, checked and packed once per machine) ---------------------


def save_packed(weights: QuantWeights, path) -> None:
    """Write the packed tensors (not the dense ones: they are the model's) atomically as safetensors."""
    import json
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    tensors = {}
    for index, layer in enumerate(weights.layers):
        for key, linear in layer.items():
            tensors[f"{index}.{key}.packed"], tensors[f"{index}.{key}.scale_zero"] = linear.packed, linear.scale_zero
    if weights.head is not None:
        tensors["head.packed"], tensors["head.scale_zero"] = weights.head.packed, weights.head.scale_zero
    meta = {"mode": weights.mode, "source": weights.source, "head_repeat": str(weights.head.repeat if weights.head else 0)}
    meta["kinds"] = json.dumps({f"{i}.{k}": v.kind for i, layer in enumerate(weights.layers) for k, v in layer.items()})
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    os.replace(tmp, path)


def load_packed(hf_model, path) -> QuantWeights:
    """The packed weights :func:`save_packed` wrote for this model, their dense sides taken from the model."""
    import json

    from safetensors import safe_open

    from decoding.model.fast_layers import fused_weights

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    kinds = json.loads(meta["kinds"])
    out = QuantWeights(mode=meta["mode"], source=meta["source"])
    for index, layer in enumerate(hf_model.model.layers):
        qkv, gate_up = fused_weights(layer)
        dense = {"qkv": qkv, "o": layer.self_attn.o_proj.weight, "gate_up": gate_up, "down": layer.mlp.down_proj.weight}
        out.layers.append(
            {
                key: PackedLinear(kinds[f"{index}.{key}"], tensors[f"{index}.{key}.packed"], tensors[f"{index}.{key}.scale_zero"], matrix)
                for key, matrix in dense.items()
                if f"{index}.{key}" in kinds
            }
        )
    if "head.packed" in tensors:
        head = hf_model.lm_head.weight
        out.head = PackedLinear("int4", tensors["head.packed"], tensors["head.scale_zero"], head, int(meta["head_repeat"]))
    return out
