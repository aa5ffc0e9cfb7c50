"""Lossy transforms: ``fp8_e4m3`` and ``int8`` (one byte per element plus scales) and ``bf16`` (fp32 -> bf16).

``fp8_e4m3`` / ``int8`` (for float32, bfloat16 and float16 layouts) divide each element by a scale and round to
``torch.float8_e4m3fn`` (saturated at +-448) or to a symmetric int8 (-127..127). Scales are the absolute maximum
of a group over 448 / 127, rounded to float16. Option ``scale``:

- ``token``: one scale per (layer, K/V, token, KV head), over ``head_dim`` elements (2 bytes per ``head_dim``).
- ``channel``: one scale per (layer, K/V, token group, KV head, channel), over ``group`` tokens
  (option ``group``, default 0: the whole chunk).
- ``kivi``: keys per channel and values per token, as KIVI (Liu et al., 2024) found best: keys have outlier
  channels, values do not.

Option ``sink`` (default 0): the chunk's first ``sink`` tokens are also stored unquantized, in the layout dtype,
and decoded as they were. The first tokens of a prompt are attention sinks (Xiao et al., 2023): most attention
goes to them, so their rounding error reaches every later token; kept exact, int8's greedy answers match raw KV
as often as bf16's do (docs/codecs.md). A codec sees one chunk, not its place in the prompt, so every chunk keeps
its first tokens (``sink / chunk_size`` more bytes).

Defaults: ``fp8_e4m3`` per ``token`` (the lowest KL for fp8, whose 3 mantissa bits, not its range, limit it);
``int8`` ``kivi`` over groups of 4 tokens with 1 sink token (``scale=kivi,group=4,sink=1``: greedy answers as
often identical to raw KV's as bf16's, on two prompt sets; per-channel key scales keep the outlier channels from
flattening the rest, and small groups follow the keys' drift along the chunk). It costs about 1.27 bytes per
element (1.57x against bf16 KV instead of 1.96x for ``group=0,sink=0``).

Encoded bytes: the quantized chunk ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)`` (1 byte each), then
the key scales, then the value scales (float16, C order of their shapes below), then the sink tokens
``(num_layers, 2, min(sink, num_tokens), num_kv_heads, head_dim)`` in the layout dtype. A group whose maximum
is 0 gets scale 1; scales are clamped to [2**-14, 65504] (float16's normal range).

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


def _scale_shape(mode: str, group: int, layout: KVLayout, num_tokens: int) -> tuple[int, ...]:
    if mode == "token":
        return (layout.num_layers, num_tokens, layout.num_kv_heads, 1)
    size = group or num_tokens
    groups = math.ceil(num_tokens / size) if num_tokens else 0
    return (layout.num_layers, groups, layout.num_kv_heads, layout.head_dim)


class _OneByte(Transform):
    """Scaled one-byte quantization; subclasses set ``QMAX`` and ``_to_bytes`` / ``_from_bytes``."""

    OPTIONS = {"scale": "token", "group": 0, "sink": 0}
    QMAX = 1.0

    def _to_bytes(self, y):
        raise NotImplementedError

    def _from_bytes(self, q: np.ndarray):
        """1-D uint8 codes (numpy, maybe read-only) -> a new float32 torch tensor of their values (before scaling);
        converted in numpy first, so torch never wraps a read-only array."""
        raise NotImplementedError

    def _params(self) -> dict:
        return {"scale": str(self.options["scale"]), "group": int(self.options["group"]),
                "sink": int(self.options["sink"])}

    def encoded_size(self, params, layout, num_tokens):
        elements = layout.num_layers * 2 * num_tokens * layout.num_kv_heads * layout.head_dim
        return elements + 2 * sum(math.prod(_scale_shape(m, int(params["group"]), layout, num_tokens))
                                  for m in _part_modes(params["scale"])) + _sink_bytes(params, layout, num_tokens)

    def encode(self, kv, layout):
        torch = _torch()
        if layout.dtype not in _FLOAT_DTYPES:
            raise InputError(f"{self.name} encodes {_FLOAT_DTYPES} KV, not {layout.dtype}")
        params = self._params()
        num_tokens = kv.shape[2]
        elements = kv.numel()
        out = np.empty(self.encoded_size(params, layout, num_tokens), dtype=np.uint8)
        quantized = torch.from_numpy(out[:elements]).view(kv.shape)
        offset = elements
        for part, mode in enumerate(_part_modes(params["scale"])):
            x = kv[:, part].float()
            scale = self._scales(x, mode, params["group"])
            shape = _scale_shape(mode, params["group"], layout, num_tokens)
            nbytes = 2 * math.prod(shape)
            torch.from_numpy(out[offset:offset + nbytes].view(np.float16)).view(shape).copy_(scale)
            offset += nbytes
            y = x / _expand(scale.float(), mode, params["group"], num_tokens)
            quantized[:, part] = self._to_bytes(y.clamp_(-self.QMAX, self.QMAX))
        sink = _sink_tokens(params, num_tokens)
        if sink:  # the chunk's first tokens as they were (after the scales: the quantized part keeps its offsets)
            out[offset:] = kv[:, :, :sink].contiguous().view(torch.uint8).reshape(-1).numpy()
        return out, params, 1

    def _scales(self, x, mode: str, group: int):
        """float16 scales of ``x`` (num_layers, num_tokens, heads, head_dim) float32, shaped ``_scale_shape``."""
        torch = _torch()
        magnitude = x.abs()
        if mode == "token":
            amax = magnitude.amax(dim=-1, keepdim=True)
        else:
            layers, tokens, heads, dim = x.shape
            size = group or tokens
            groups = math.ceil(tokens / size) if tokens else 0
            if groups * size != tokens:  # zeros never raise a maximum of magnitudes
                magnitude = torch.nn.functional.pad(magnitude, (0, 0, 0, 0, 0, groups * size - tokens))
            amax = magnitude.reshape(layers, groups, size, heads, dim).amax(dim=2) if groups else \
                magnitude.new_empty((layers, 0, heads, dim))
        if not bool(torch.isfinite(amax).all()):
            raise InputError(f"{self.name}: the KV holds NaN or inf, which a scaled quantization cannot encode; "
                             "store it with a lossless codec")
        scale = torch.where(amax > 0, amax / self.QMAX, torch.ones_like(amax))
        return scale.clamp_(2.0 ** -14, 65504.0).to(torch.float16)

    def decode(self, data, params, layout, num_tokens, out=None):
        torch = _torch()
        shape = layout.chunk_shape(num_tokens)
        elements = math.prod(shape)
        if out is None:
            out = torch.empty(shape, dtype=getattr(torch, layout.dtype))
        values = self._from_bytes(data[:elements]).view(shape)
        offset = elements
        for part, mode in enumerate(_part_modes(params["scale"])):
            scale_shape = _scale_shape(mode, int(params["group"]), layout, num_tokens)
            nbytes = 2 * math.prod(scale_shape)
            scale = torch.from_numpy(data[offset:offset + nbytes].view(np.float16).astype(np.float32)).view(scale_shape)
            offset += nbytes
            out[:, part] = values[:, part].mul_(_expand(scale, mode, int(params["group"]), num_tokens))
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


def _expand(scale, mode: str, group: int, num_tokens: int):
    """Scales broadcastable against (num_layers, num_tokens, heads, head_dim)."""
    if mode == "token" or not num_tokens:
        return scale
    return scale.repeat_interleave(group or num_tokens, dim=1)[:, :num_tokens]


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
    OPTIONS = {"scale": "kivi", "group": 4, "sink": 1}  # measured best for int8 (bench_codecs, docs/codecs.md)
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
