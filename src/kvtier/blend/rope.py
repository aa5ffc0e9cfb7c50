"""RoPE re-rotation: move stored K from the positions it was computed at to new ones.

A segment's KV is stored as computed at positions ``0 .. n-1`` (the document alone). Rotary position embedding
rotates each pair of K's channels by ``position * inv_freq[i]``; rotations compose, so K computed at position
``p`` and rotated by ``offset`` equals K computed at ``p + offset`` (exact up to floating-point rounding).
V carries no position and is reused as stored. That holds for RoPE whose frequencies do not depend on the
sequence length and whose cos/sin are not scaled: ``rope_type`` ``default``, ``linear`` and ``llama3``
(Llama, SmolLM2, Mistral, Qwen2/3). Anything else is refused with ``BlendUnsupportedError``.

Layout (HF Llama ``rotate_half``, the pairing the model itself rotates with): channel ``i`` pairs with
``i + head_dim/2``, ``cos``/``sin`` are ``cat(freqs, freqs)``.
"""

from __future__ import annotations

import torch

from kvtier.errors import BlendUnsupportedError

EXACT_ROPE_TYPES = ("default", "linear", "llama3")


class RopeRotator:
    """Re-rotates K for one model: ``inv_freq`` ``[head_dim / 2]`` (float64), taken from the model's own rotary
    module (so rope_theta and rope scaling are the ones the model computes with)."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq.detach().to(torch.float64).cpu()

    @classmethod
    def for_model(cls, model) -> "RopeRotator":
        """The rotator of a transformers causal LM (``model.model.rotary_emb``).

        Raises:
            BlendUnsupportedError: naming the model type, when the model has no rotary module, uses a RoPE whose
                rotation depends on the sequence length or scales cos/sin (dynamic, YaRN, LongRoPE), mixes local
                and global rotary embeddings (Gemma-3), or uses sliding-window attention.
        """
        config = model.config
        model_type = getattr(config, "model_type", type(model).__name__)
        inner = getattr(model, "model", None)
        rotary = getattr(inner, "rotary_emb", None)
        if rotary is None or not hasattr(rotary, "inv_freq") or hasattr(inner, "rotary_emb_local"):
            raise BlendUnsupportedError(
                f"model type {model_type!r} has no single rotary position embedding kvtier can re-rotate; blending "
                "needs a Llama-family model (Llama, SmolLM2, Mistral, Qwen2/3); falling back to prefix reuse")
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in EXACT_ROPE_TYPES or float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
            raise BlendUnsupportedError(
                f"model type {model_type!r} uses rope_type {rope_type!r}, whose rotation is not a fixed "
                f"per-position rotation; blending re-rotates only {', '.join(EXACT_ROPE_TYPES)}")
        if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
            raise BlendUnsupportedError(f"model type {model_type!r} uses sliding-window attention; blending needs "
                                        "full attention on every layer")
        return cls(rotary.inv_freq)

    def cos_sin(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[len(offsets), head_dim]`` (float64) of rotations by ``offsets`` positions."""
        freqs = offsets.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def rotate(self, k: torch.Tensor, offset: int) -> torch.Tensor:
        """K rotated by ``offset`` positions (a new tensor, ``k``'s dtype).

        Args:
            k: rotated keys ``(..., num_tokens, num_kv_heads, head_dim)`` (kvtier's layout: e.g. ``kv[:, 0]`` of
                ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``), computed at positions ``p``.
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
        """Write ``src`` (keys ``(..., head_dim)`` computed at positions ``p``) rotated by ``offset`` positions
        into ``dst`` (same shape, any strides, e.g. a transposed view of a cache buffer): the keys at ``p + offset``.

        The angles are computed in float64 and the rotation in float32 (the model's precision for float32 K;
        bfloat16/float16 K is widened first), without temporaries of ``src``'s size for float32.
        Mutates ``dst`` only; ``dst`` must not overlap ``src``.
        """
        if offset == 0:
            dst.copy_(src)
            return
        cos, sin = self.cos_sin(torch.tensor([offset]))
        half = cos.shape[-1] // 2
        c, s = cos[0, :half].to(torch.float32), sin[0, :half].to(torch.float32)  # cos/sin are cat(f, f): one half
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
