"""Lossy transforms: ``fp8_e4m3`` and ``int8`` (one byte per element plus scales) and ``bf16`` (fp32 -> bf16).

``fp8_e4m3`` / ``int8`` (for float32, bfloat16 and float16 layouts) divide each element (less its group's offset,
with ``center``) by a scale and round to ``torch.float8_e4m3fn`` (saturated at +-448) or to a symmetric int8
(-127..127), both round-to-nearest-even. Scales are the largest magnitude of a group over 448 / 127, rounded to
float16. Option ``scale``:

- ``token``: one scale per (layer, K/V, token, KV head) and ``span`` consecutive elements of ``head_dim``
  (option ``span``, default 0: the whole ``head_dim``).
- ``channel``: one scale per (layer, K/V, token group, KV head, channel), over ``group`` tokens
  (option ``group``, default 0: the whole chunk).
- ``kivi``: keys per channel and values per token, as KIVI (Liu et al., 2024) found best: keys have outlier
  channels, values do not.

Option ``center`` (0 / 1, default 0): every channel group (keys under ``kivi``) is quantized around its midrange,
stored as a float16 offset next to its scale, so the grid spans the group's spread, not 0..|offset|. Keys after
RoPE sit far from 0 in their slowly rotating channels, with a small spread over a few tokens: centered, int8's key
error falls to about that of keeping the keys exact (KL against raw KV 2-3x lower, docs/codecs.md), and fp8's
halves. KIVI quantizes asymmetrically (min / max) for the same reason.

Option ``sink`` (default 0): the chunk's first ``sink`` tokens are also stored unquantized, in the layout dtype,
and decoded as they were; they are left out of their groups' scales and offsets. The first tokens of a prompt are
attention sinks (Xiao et al., 2023): most attention goes to them, so their rounding error reaches every later
token. A codec sees one chunk, not its place in the prompt, so every chunk keeps its first tokens (``sink /
chunk_size`` more bytes).

Defaults: ``fp8_e4m3`` per ``token`` (3 mantissa bits, not the scales, limit it); ``int8``
``scale=kivi,group=16,sink=1,center=1,span=16``: about 1.19 bytes per element (1.67x against bf16 KV); greedy
32-token answers identical to raw KV's in 92-96 % of 50 prompts in transformers (bf16 alone: 94-98 %) and 96 %
through vLLM, mean KL 2.6-3.7x below ``group=4`` without ``center`` (benchmarks/RESULTS.md).
Records name their options, so a record written with other options (or before ``center`` / ``span``) decodes
as written.

Encoded bytes: the quantized chunk ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` (1 byte each), then
the key scales (and, centered, the key offsets), then the value scales (and offsets) (float16, C order of their
shapes below), then the sink tokens ``(num_layers, 2, min(sink, num_tokens), num_kv_heads, head_dim)`` in the
layout dtype. A group whose largest magnitude is 0 gets scale 1; scales are clamped to [2**-14, 65504] (float16's
normal range). Shapes: ``token`` (num_layers, num_tokens, num_kv_heads, ceil(head_dim / span)); ``channel``
(num_layers, ceil(num_tokens / group), num_kv_heads, head_dim).

``bf16`` (float32 layouts only) rounds to bfloat16 (torch's round-to-nearest-even); 2 bytes per element.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from kvtier.codecs.base import Transform
from kvtier.errors import CodecError, InputError
from kvtier.layout import KVLayout

SCALE_MODES = ("token", "channel", "kivi")
_FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _torch():
    from kvtier.tensors import require_torch

    return require_torch()


def _part_modes(mode: str) -> tuple[str, str]:
    """(key mode, value mode) of a scale option."""
    if mode == "kivi":
        return "channel", "token"
    if mode not in SCALE_MODES:
        raise CodecError(f"unknown scale mode {mode!r}; this kvtier knows {SCALE_MODES}")
    return mode, mode


def _scale_shape(mode: str, params: dict, layout: KVLayout, num_tokens: int) -> tuple[int, ...]:
    if mode == "token":
        span = int(params.get("span", 0)) or layout.head_dim  # ``span``: 0 in records written before it
        return (layout.num_layers, num_tokens, layout.num_kv_heads, math.ceil(layout.head_dim / span))
    size = int(params["group"]) or num_tokens
    groups = math.ceil(num_tokens / size) if num_tokens else 0
    return (layout.num_layers, groups, layout.num_kv_heads, layout.head_dim)


class _OneByte(Transform):
    """Scaled one-byte quantization; subclasses set ``QMAX`` and ``_to_bytes`` / ``_from_bytes``."""

    OPTIONS = {"scale": "token", "group": 0, "sink": 0, "center": 0, "span": 0}
    QMAX = 1.0

    def _to_bytes(self, y):
        raise NotImplementedError

    def _from_bytes(self, q: np.ndarray):
        """1-D uint8 codes (numpy, maybe read-only) -> a new float32 torch tensor of their values (before scaling);
        converted in numpy first, so torch never wraps a read-only array."""
        raise NotImplementedError

    def _params(self) -> dict:
        return {"scale": str(self.options["scale"]), "group": int(self.options["group"]),
                "sink": int(self.options["sink"]), "center": int(self.options["center"]),
                "span": int(self.options["span"])}

    def encoded_size(self, params, layout, num_tokens):
        elements = layout.num_layers * 2 * num_tokens * layout.num_kv_heads * layout.head_dim
        return elements + sum(_part_bytes(mode, params, layout, num_tokens) for mode in _part_modes(params["scale"])) \
            + _sink_bytes(params, layout, num_tokens)

    def encode(self, kv, layout):
        torch = _torch()
        if layout.dtype not in _FLOAT_DTYPES:
            raise InputError(f"{self.name} encodes {_FLOAT_DTYPES} KV, not {layout.dtype}")
        if layout.latent:  # its scales are per key / value part; a latent vector is neither
            raise InputError(f"{self.name} quantizes keys and values; a latent (MLA) layout is stored with a "
                             "lossless codec (none, lz4, zstd)")
        params = self._params()
        num_tokens = kv.shape[2]
        elements = kv.numel()
        sink = _sink_tokens(params, num_tokens)
        if sink and not bool(torch.isfinite(kv[:, :, :sink]).all()):  # the scales below leave the sinks out
            raise self._non_finite()
        out = np.empty(self.encoded_size(params, layout, num_tokens), dtype=np.uint8)
        quantized = torch.from_numpy(out[:elements]).view(kv.shape)
        offset = elements
        for part, mode in enumerate(_part_modes(params["scale"])):
            x = kv[:, part].float()
            stats = self._scales(x, mode, params, sink)
            group, span = int(params["group"]), int(params["span"])
            shape = _scale_shape(mode, params, layout, num_tokens)
            for stat in stats:  # the scales, then (centered channel groups) the offsets
                nbytes = 2 * math.prod(shape)
                torch.from_numpy(out[offset:offset + nbytes].view(np.float16)).view(shape).copy_(stat)
                offset += nbytes
            y = x.clone() if x.dtype == kv.dtype else x  # never written: ``kv`` may be read-only
            if len(stats) == 2:
                _per_group_(y, stats[1].float(), mode, group, span, torch.Tensor.sub_)
            _per_group_(y, stats[0].float(), mode, group, span, torch.Tensor.div_)
            quantized[:, part] = self._to_bytes(y.clamp_(-self.QMAX, self.QMAX))
        if sink:  # the chunk's first tokens as they were (after the scales: the quantized part keeps its offsets)
            out[offset:] = kv[:, :, :sink].contiguous().view(torch.uint8).reshape(-1).numpy()
        return out, params, 1

    def _non_finite(self) -> InputError:
        return InputError(f"{self.name}: the KV holds NaN or inf, which a scaled quantization cannot encode; "
                          "store it with a lossless codec")

    def _scales(self, x, mode: str, params: dict, sink: int) -> tuple:
        """float16 scales of ``x`` (num_layers, num_tokens, heads, head_dim) float32, shaped ``_scale_shape``,
        and, for a centered channel mode, the groups' float16 midranges (the offsets), of the same shape. Channel
        groups leave the ``sink`` first tokens out (they are stored exactly): a sink's magnitude never coarsens
        its group's grid."""
        torch = _torch()
        if mode == "token":
            span = int(params["span"]) or x.shape[-1]
            amax = _pad_to(x.abs(), 3, span, 0.0).unflatten(3, (-1, span)).amax(dim=-1)
            offsets = None
        else:
            size = int(params["group"]) or x.shape[1]
            if int(params.get("center", 0)):
                lo = _group_reduce(x, sink, size, float("inf"), torch.amin)
                hi = _group_reduce(x, sink, size, float("-inf"), torch.amax)
                empty = lo > hi  # every token of the group is a sink: nothing to scale
                if not bool((torch.isfinite(lo) & torch.isfinite(hi) | empty).all()):
                    raise self._non_finite()
                lo, hi = lo.masked_fill_(empty, 0.0), hi.masked_fill_(empty, 0.0)
                offsets = ((lo + hi) / 2).clamp_(-65504.0, 65504.0).to(torch.float16)
                middle = offsets.float()  # the grid is centered on the offset as stored
                amax = torch.maximum(hi - middle, middle - lo)
            else:
                amax = _group_reduce(x.abs(), sink, size, 0.0, torch.amax)
                offsets = None
        if not bool(torch.isfinite(amax).all()):
            raise self._non_finite()
        scale = torch.where(amax > 0, amax / self.QMAX, torch.ones_like(amax)).clamp_(2.0 ** -14, 65504.0)
        return (scale.to(torch.float16),) if offsets is None else (scale.to(torch.float16), offsets)

    def decode(self, data, params, layout, num_tokens, out=None):
        torch = _torch()
        shape = layout.chunk_shape(num_tokens)
        elements = math.prod(shape)
        if out is None:
            out = torch.empty(shape, dtype=getattr(torch, layout.dtype))
        values = self._from_bytes(data[:elements]).view(shape)
        offset = elements
        group, span = int(params["group"]), int(params.get("span", 0))
        for part, mode in enumerate(_part_modes(params["scale"])):
            scale_shape = _scale_shape(mode, params, layout, num_tokens)
            part_values = values[:, part]
            for op in (torch.Tensor.mul_, torch.Tensor.add_)[:_stats_per_part(mode, params)]:  # scales, offsets
                nbytes = 2 * math.prod(scale_shape)
                stat = torch.from_numpy(data[offset:offset + nbytes].view(np.float16).astype(np.float32))
                _per_group_(part_values, stat.view(scale_shape), mode, group, span, op)
                offset += nbytes
            out[:, part] = part_values
        sink = _sink_tokens(params, num_tokens)
        if sink:
            kept = torch.from_numpy(data[offset:].copy())  # a copy: ``data`` may be read-only
            out[:, :, :sink] = kept.view(out.dtype).view(layout.chunk_shape(sink))
        return out


def _sink_tokens(params: dict, num_tokens: int) -> int:
    """How many leading tokens of the chunk are kept unquantized (``sink``; 0 in records written before it)."""
    return min(int(params.get("sink", 0)), num_tokens)


def _sink_bytes(params: dict, layout: KVLayout, num_tokens: int) -> int:
    return layout.chunk_bytes(_sink_tokens(params, num_tokens))


def _stats_per_part(mode: str, params: dict) -> int:
    """float16 arrays a part stores: its scales, plus its offsets for a centered channel mode (``center``: 0 in
    records written before it)."""
    return 2 if mode == "channel" and int(params.get("center", 0)) else 1


def _part_bytes(mode: str, params: dict, layout: KVLayout, num_tokens: int) -> int:
    return 2 * math.prod(_scale_shape(mode, params, layout, num_tokens)) * _stats_per_part(mode, params)


def _pad_to(t, dim: int, size: int, value: float):
    """``t`` padded along ``dim`` (at the end) with ``value`` to a multiple of ``size``."""
    extra = -t.shape[dim] % size
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return _torch().nn.functional.pad(t, pad, value=value)


def _group_reduce(x, sink: int, size: int, neutral: float, reduce):
    """``reduce`` (amin / amax) of ``x`` (num_layers, num_tokens, heads, head_dim) over groups of ``size``
    tokens, with the first ``sink`` tokens (and the padding of the last group) set to ``neutral``: shape
    (num_layers, groups, heads, head_dim)."""
    if not x.shape[1]:
        return x.new_empty((x.shape[0], 0, *x.shape[2:]))
    if sink:
        x = x.clone()
        x[:, :sink] = neutral
    return reduce(_pad_to(x, 1, size, neutral).unflatten(1, (-1, size)), dim=2)


def _per_group_(t, stat, mode: str, group: int, span: int, op) -> None:
    """Apply ``op(view, stat)`` (``torch.Tensor.mul_`` / ``div_`` / ``add_`` / ``sub_``, in place) to ``t`` (num_layers,
    num_tokens, heads, head_dim) with each group's ``stat`` (scales or offsets, ``_scale_shape``): the groups are
    views of ``t``, so the statistics broadcast without being expanded to ``t``'s size. A shorter last group
    (the chunk's last tokens, or head_dim's last elements) gets its own call."""
    dim = 1 if mode == "channel" else 3
    n = t.shape[dim]
    if not n:
        return
    size = (group if mode == "channel" else span) or n
    full = n - n % size
    if full:
        view = t.narrow(dim, 0, full).unflatten(dim, (full // size, size))
        op(view, stat.narrow(dim, 0, full // size).unsqueeze(dim + 1))
    if full < n:
        op(t.narrow(dim, full, n - full), stat.narrow(dim, full // size, 1))


class Fp8E4M3(_OneByte):
    name = "fp8_e4m3"
    QMAX = 448.0  # the largest finite float8_e4m3fn

    def _to_bytes(self, y):
        return y.to(_torch().float8_e4m3fn).view(_torch().uint8)

    def _from_bytes(self, q):
        # a 256-entry table: 9x faster here than torch's float8 -> float32 conversion
        torch = _torch()
        return torch.index_select(_fp8_table(), 0, torch.from_numpy(q.astype(np.int32)))


@functools.cache
def _fp8_table():
    """float32 value of every float8_e4m3fn code (the two NaN codes, never written, as 0)."""
    torch = _torch()
    codes = torch.arange(256, dtype=torch.int32)
    table = codes.to(torch.uint8).view(torch.float8_e4m3fn).float()
    return table.masked_fill_((codes & 0x7F) == 0x7F, 0.0)


class Int8(_OneByte):
    name = "int8"
    OPTIONS = {"scale": "kivi", "group": 16, "sink": 1, "center": 1, "span": 16}  # bench_codecs, docs/codecs.md
    QMAX = 127.0

    def _to_bytes(self, y):
        torch = _torch()
        return y.round_().to(torch.int8).view(torch.uint8)

    def _from_bytes(self, q):
        return _torch().from_numpy(q.view(np.int8).astype(np.float32))


class Bf16(Transform):
    name = "bf16"

    def encoded_size(self, params, layout, num_tokens):
        return layout.chunk_bytes(num_tokens) // 2

    def encode(self, kv, layout):
        torch = _torch()
        if layout.dtype != "float32":
            raise InputError(f"bf16 halves float32 KV; this layout is {layout.dtype} (use a lossless codec or fp8_e4m3)")
        return kv.to(torch.bfloat16).view(torch.int16).numpy().reshape(-1).view(np.uint8), {}, 2

    def decode(self, data, params, layout, num_tokens, out=None):
        torch = _torch()
        if out is None:
            widened = data.view(np.uint16).astype(np.uint32)
            widened <<= 16  # a bfloat16 is the high half of the float32 of the same value
            return torch.from_numpy(widened.view(np.float32)).view(layout.chunk_shape(num_tokens))
        widened = out.view(-1).numpy().view(np.uint32)
        np.left_shift(data.view(np.uint16), 16, out=widened, dtype=np.uint32)
        return out
