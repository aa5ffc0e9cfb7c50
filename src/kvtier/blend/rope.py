"""RoPE re-rotation: move stored K from the positions it was computed at to new ones.

A segment's KV is stored as computed at positions ``0 .. n-1`` (the document alone). Rotary position embedding
rotates each pair of K's channels by ``position * inv_freq[i]``; rotations compose, so K computed at position
``p`` and rotated by ``offset`` equals K computed at ``p + offset`` (exact up to floating-point rounding).
V carries no position and is reused as stored. That holds for RoPE whose frequencies do not depend on the
sequence length and whose cos/sin are not scaled: ``rope_type`` ``default``, ``linear`` and ``llama3``
(Llama, SmolLM2, Mistral, Qwen2/3, Gemma-3). Anything else is refused with ``BlendUnsupportedError``.

Per layer: a model may give each layer type its own rotary frequencies and attention window (Gemma-3: sliding
layers ``rope_theta`` 10,000 over a 512-token window, full layers 1,000,000 over everything; transformers'
``config.layer_types``). The rotator keeps one row of frequencies per layer, each layer's type (the argument the
model's rotary module takes) and window, so the recompute masks each layer as the model does.

Layout (HF Llama / Gemma ``rotate_half``, the pairing the model itself rotates with): channel ``i`` pairs with
``i + head_dim/2``, ``cos``/``sin`` are ``cat(freqs, freqs)``.
"""

from __future__ import annotations

import torch

from kvtier.errors import BlendUnsupportedError

EXACT_ROPE_TYPES = ("default", "linear", "llama3")
SLIDING_LAYER_TYPE = "sliding_attention"  # transformers' layer type of a sliding-window layer


class RopeRotator:
    """Re-rotates K for one model, layer by layer.

    Attributes:
        inv_freq: ``[num_layers, head_dim / 2]`` float64, each layer's frequencies, taken from the model's own
            rotary module (so rope_theta and rope scaling are the ones the model computes with).
        layer_types: per layer, the ``layer_type`` the model's rotary module takes (None: a module with one set of
            frequencies, called without it).
        windows: per layer, its sliding attention window in tokens (a query sees the keys less than ``window``
            positions back, itself included), or None (full attention).
    """

    def __init__(self, inv_freq: torch.Tensor, layer_types=None, windows=None):
        freq = inv_freq.detach().to(torch.float64).cpu()
        self.inv_freq = freq if freq.dim() == 2 else freq[None]
        self.layer_types = list(layer_types) if layer_types is not None else [None] * self.inv_freq.shape[0]
        self.windows = list(windows) if windows is not None else [None] * len(self.layer_types)

    @classmethod
    def for_model(cls, model) -> "RopeRotator":
        """The rotator of a transformers causal LM (``model.model.rotary_emb``, ``config.layer_types``).

        Raises:
            BlendUnsupportedError: naming the model type, when the model has no rotary module kvtier can read, uses
                a RoPE whose rotation depends on the sequence length or scales cos/sin (dynamic, YaRN, LongRoPE), or
                a sliding window without saying which layers it applies to.
        """
        config = model.config
        model_type = getattr(config, "model_type", type(model).__name__)
        inner = getattr(model, "model", None)
        rotary = getattr(inner, "rotary_emb", None)
        num_layers = len(inner.layers) if hasattr(inner, "layers") else 0
        kinds = list(getattr(config, "layer_types", None) or [])
        if hasattr(inner, "rotary_emb_local"):  # older transformers' Gemma-3: a second module kvtier does not read
            rotary = None
        if rotary is not None and hasattr(rotary, "inv_freq"):
            types = [None] * num_layers
            freq = {None: (rotary.inv_freq, getattr(rotary, "rope_type", "default"),
                           getattr(rotary, "attention_scaling", 1.0))}
        elif rotary is not None and kinds and all(hasattr(rotary, f"{k}_inv_freq") for k in kinds):
            types = kinds  # one set of frequencies per layer type (Gemma-3)
            freq = {k: (getattr(rotary, f"{k}_inv_freq"), rotary.rope_type[k],
                        getattr(rotary, f"{k}_attention_scaling", 1.0)) for k in set(kinds)}
        else:
            raise BlendUnsupportedError(
                f"model type {model_type!r} has no rotary position embedding kvtier can re-rotate; blending needs "
                "a model with RoPE (Llama, SmolLM2, Mistral, Qwen2/3, Gemma-3); falling back to prefix reuse")
        for rope_type, scaling in ((f[1], f[2]) for f in freq.values()):
            if rope_type not in EXACT_ROPE_TYPES or float(scaling) != 1.0:
                raise BlendUnsupportedError(
                    f"model type {model_type!r} uses rope_type {rope_type!r}, whose rotation is not a fixed "
                    f"per-position rotation; blending re-rotates only {', '.join(EXACT_ROPE_TYPES)}")
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if window and not kinds:
            raise BlendUnsupportedError(f"model type {model_type!r} uses sliding-window attention without "
                                        "config.layer_types naming its sliding layers; blending cannot mask them")
        windows = [window if window and k == SLIDING_LAYER_TYPE else None for k in (kinds or [None] * num_layers)]
        return cls(torch.stack([freq[t][0] for t in types]), types, windows)

    def cos_sin(self, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[num_layers, head_dim / 2]`` (float32) of each layer's rotation by ``offset`` positions
        (one half of the model's ``cat(freqs, freqs)``); angles computed in float64."""
        angles = float(offset) * self.inv_freq
        return angles.cos().to(torch.float32), angles.sin().to(torch.float32)

    def rotate(self, k: torch.Tensor, offset: int) -> torch.Tensor:
        """K rotated by ``offset`` positions (a new tensor, ``k``'s dtype).

        Args:
            k: rotated keys of every layer ``(num_layers, num_tokens, num_kv_heads, head_dim)`` (kvtier's layout:
                ``kv[:, 0]`` of ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``; any order of the middle
                dimensions), computed at positions ``p``.
            offset: positions to add (an int; may be negative).

        Returns:
            the keys K would have at positions ``p + offset``; ``k`` itself when ``offset`` is 0.
        """
        if offset == 0:
            return k
        out = torch.empty_like(k)
        self.rotate_into(out, k, offset)
        return out

    def rotate_into(self, dst: torch.Tensor, src: torch.Tensor, offset: int) -> None:
        """Write ``src`` (every layer's keys ``(num_layers, a, b, head_dim)`` computed at positions ``p``) rotated by
        ``offset`` positions into ``dst`` (same shape, any strides, e.g. a transposed view of a cache buffer): the
        keys at ``p + offset``, each layer by its own frequencies.

        The angles are computed in float64 and the rotation in float32 (the model's precision for float32 K;
        bfloat16/float16 K is widened first), without temporaries of ``src``'s size for float32.
        Mutates ``dst`` only; ``dst`` must not overlap ``src``.
        """
        if offset == 0:
            dst.copy_(src)
            return
        cos, sin = self.cos_sin(offset)
        half = cos.shape[-1]
        c, s = cos[:, None, None, :], sin[:, None, None, :]  # [L, 1, 1, half]: broadcast over tokens and heads
        wide = src if src.dtype == torch.float32 else src.to(torch.float32)
        out = dst if dst.dtype == torch.float32 else torch.empty(dst.shape, dtype=torch.float32)
        x1, x2 = wide[..., :half], wide[..., half:]
        o1, o2 = out[..., :half], out[..., half:]
        torch.mul(x1, c, out=o1)  # rotate_half(x) = cat(-x2, x1)
        o1.addcmul_(x2, s, value=-1.0)
        torch.mul(x2, c, out=o2)
        o2.addcmul_(x1, s)
        if out is not dst:
            dst.copy_(out)
