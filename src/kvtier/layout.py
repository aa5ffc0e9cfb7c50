"""KV layout: the shape and dtype of one model's KV cache as kvtier stores it.

The canonical chunk tensor is ``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``
(axis 1: 0 = keys, 1 = values), C-contiguous, in the layout's dtype. A latent layout (multi-head latent
attention, MLA: one vector per token and layer, no key / value split) has one part on axis 1 and one head:
``(num_layers, 1, num_tokens, 1, head_dim)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from kvtier.errors import InputError

# dtype name -> bytes per element. Names follow torch (``str(torch.float32)`` minus ``torch.``).
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of a model's KV cache shard.

    Attributes:
        num_layers: attention layers holding KV.
        num_kv_heads: KV heads held by this shard (after the tensor-parallel split).
        head_dim: elements per head.
        dtype: element type name, one of ``DTYPE_SIZES``.
        tp_size: tensor-parallel world size the shard belongs to.
        tp_rank: this shard's tensor-parallel rank.
        group: which layers these are and how the engine keeps their KV, for a model whose layers form several
            KV cache groups (sliding-window and full attention: ``connectors.vllm_groups``), e.g.
            ``"sliding_window/512/0,6,12"`` (attention kind / window / the layer indexes along the layout's layer
            axis, in that order). ``""`` (the default) means every layer of the model in layer order, full KV.
        latent: MLA's latent KV (vLLM's ``MLAAttentionSpec``: ``head_size_v`` 0): one vector of ``head_dim``
            elements per token and layer, ``num_kv_heads`` 1, ``kv_parts`` 1. False (the default): keys and values.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    tp_size: int = 1
    tp_rank: int = 0
    group: str = ""
    latent: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InputError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise InputError(f"KVLayout.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if not isinstance(self.group, str):
            raise InputError(f"KVLayout.group must be a str, got {self.group!r}")
        if self.dtype not in DTYPE_SIZES:
            raise InputError(f"KVLayout.dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_SIZES)}")
        if not isinstance(self.latent, bool) or (self.latent and self.num_kv_heads != 1):
            raise InputError(f"KVLayout.latent must be a bool, and a latent (MLA) layout has one KV head; got "
                             f"latent={self.latent!r}, num_kv_heads={self.num_kv_heads}")

    @property
    def layout_id(self) -> str:
        """16 hex chars identifying dtype, layers, KV heads, head dim, the TP split and the KV cache group.

        Two layouts share an id only when their chunks are byte-compatible, so an fp8 run
        never reads a bf16 chunk, and a sliding-window group's chunk is never read as another group's.
        """
        text = f"v1|{self.dtype}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|{self.tp_size}|{self.tp_rank}"
        if self.group:  # appended only when set: the ids of single-group layouts stay what they were
            text += f"|{self.group}"
        if self.latent:
            text += "|latent"
        return xxhash.xxh3_64_hexdigest(text.encode())

    @property
    def element_size(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def kv_parts(self) -> int:
        """Entries of the chunk's axis 1: 2 (keys, values), or 1 for a latent (MLA) layout."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """KV bytes for one token across all layers, keys and values (or the latent vector)."""
        return self.num_layers * self.kv_parts * self.num_kv_heads * self.head_dim * self.element_size

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """``(num_layers, kv_parts, num_tokens, num_kv_heads, head_dim)``: ``kv_parts`` is 2, or 1 when latent."""
        return (self.num_layers, self.kv_parts, num_tokens, self.num_kv_heads, self.head_dim)

    def chunk_bytes(self, num_tokens: int) -> int:
        """Payload size in bytes of a chunk of ``num_tokens`` tokens."""
        return self.bytes_per_token * num_tokens

    def numpy_dtype(self) -> np.dtype:
        """A numpy dtype of the same element size (bf16 and fp8 travel as raw uint16 / uint8)."""
        return {4: np.dtype(np.float32), 2: np.dtype(np.uint16), 1: np.dtype(np.uint8)}[self.element_size] \
            if self.dtype != "float16" else np.dtype(np.float16)

    def to_dict(self) -> dict:
        """The fields as a dict (``group`` and ``latent`` only when set, so other layouts keep their old form)."""
        data = asdict(self)
        if not self.group:
            del data["group"]
        if not self.latent:
            del data["latent"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "KVLayout":
        """Build from ``to_dict()`` output. Raises InputError on unknown or missing fields."""
        try:
            return cls(**data)
        except TypeError as exc:
            raise InputError(f"invalid KV layout {data!r}: {exc}") from exc

    @classmethod
    def from_model(cls, model, dtype=None) -> "KVLayout":
        """The layout of a loaded transformers causal LM (its ``config`` gives layers, KV heads and head dim).

        Args:
            model: a ``PreTrainedModel``.
            dtype: torch dtype or dtype name of the KV (default: the model's parameter dtype).

        Raises:
            InputError: a dtype kvtier does not store.
        """
        name = str(model.dtype if dtype is None else dtype).removeprefix("torch.")
        return cls.from_hf_config(model.config, name)

    @classmethod
    def from_hf_config(cls, config, dtype: str = "float32", tp_size: int = 1, tp_rank: int = 0) -> "KVLayout":
        """Layout of a transformers model config (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``)."""
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if heads % tp_size:
            raise InputError(f"{heads} KV heads cannot be split over tp_size={tp_size}")
        return cls(config.num_hidden_layers, heads // tp_size, head_dim, dtype, tp_size, tp_rank)

    def validate_kv(self, kv, num_tokens: int) -> None:
        """Check that ``kv`` (torch tensor or numpy array) is ``chunk_shape(num_tokens)`` in this dtype.

        Raises:
            InputError: naming the expected and the actual shape or dtype.
        """
        shape = tuple(kv.shape)
        if shape != self.chunk_shape(num_tokens):
            raise InputError(
                f"KV tensor shape {shape} does not match the layout: expected "
                f"(num_layers, kv_parts, num_tokens, num_kv_heads, head_dim) = {self.chunk_shape(num_tokens)}"
            )
        got = str(kv.dtype).removeprefix("torch.")
        ok = got == self.dtype or (got == "uint16" and self.element_size == 2) or (got == "uint8" and self.element_size == 1)
        if not ok:
            raise InputError(f"KV tensor dtype {got} does not match the layout dtype {self.dtype}; convert it first")
