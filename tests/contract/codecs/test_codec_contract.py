"""The codec contract, run over every codec: lossless ones return the very bytes, lossy ones stay within their
error bound, and damaged input, a size the layout does not give, or an unknown name raise clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.kv_chunks import kv_like, raw_bytes

from kvtier.codecs import get_codec
from kvtier.errors import CodecError, ConfigError, InputError, UnknownCodecError
from kvtier.layout import KVLayout

LOSSLESS = ["none", "zstd", "zstd:shuffle=none", "zstd:level=3", "zstd:level=-3", "lz4", "lz4:shuffle=none",
            "lz4:acceleration=8", "blosc_zstd", "blosc_zstd:level=5", "blosc_lz4"]
# spec -> bound on max |decoded - original| as a share of the part's (layer, K/V) largest magnitude, and on the
# relative L2 error ||decoded - original|| / ||original||
LOSSY = {
    "fp8_e4m3": (0.07, 0.05), "fp8_e4m3:scale=channel": (0.07, 0.05), "fp8_e4m3:scale=kivi,group=16": (0.07, 0.05),
    "int8": (0.01, 0.02), "int8:scale=channel,group=4": (0.01, 0.02), "int8:scale=kivi": (0.01, 0.02),
    "int8:center=1,group=16,span=16": (0.01, 0.02), "int8:scale=channel,center=1,sink=0": (0.01, 0.02),
    "fp8_e4m3:scale=kivi,center=1,group=64,sink=1,span=8": (0.07, 0.05),
    "fp8_e4m3+zstd": (0.07, 0.05), "int8+lz4": (0.01, 0.02), "fp8_e4m3+blosc_zstd": (0.07, 0.05),
    "bf16": (0.004, 0.004), "bf16+zstd": (0.004, 0.004),
}
ALL = LOSSLESS + list(LOSSY)
DTYPES = ["float32", "bfloat16", "float16"]


def layout_of(dtype: str) -> KVLayout:
    return KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype)


def accepts(spec: str, dtype: str) -> bool:
    return not spec.startswith("bf16") or dtype == "float32"


def cases():
    return [pytest.param(spec, dtype, id=f"{spec}-{dtype}") for spec in ALL for dtype in DTYPES if accepts(spec, dtype)]


def encode(spec: str, dtype: str, num_tokens: int, seed: int = 0):
    layout = layout_of(dtype)
    kv = kv_like(layout, num_tokens, seed)
    return layout, kv, get_codec(spec).encode(raw_bytes(kv), layout, num_tokens)


def as_tensor(data: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(data)).view(like.dtype).view(like.shape)


@pytest.mark.parametrize("spec, dtype", cases())
@pytest.mark.parametrize("num_tokens", [0, 1, 37, 64])
def test_round_trip(spec, dtype, num_tokens):
    layout, kv, encoded = encode(spec, dtype, num_tokens)
    codec = get_codec(spec)
    decoded = codec.decode(encoded.data, encoded.params, layout, num_tokens)
    assert decoded.dtype == np.uint8 and decoded.nbytes == layout.chunk_bytes(num_tokens)
    if codec.lossless:
        assert np.array_equal(decoded, raw_bytes(kv))
        return
    if num_tokens == 0:
        return
    max_share, rel_bound = LOSSY[spec]
    original, result = kv.float(), as_tensor(decoded, kv).float()
    error = (result - original).abs()
    part_max = original.abs().amax(dim=(2, 3, 4), keepdim=True)
    assert bool((error <= max_share * part_max).all()), f"largest error share {(error / part_max).max():.4f}"
    assert float(error.norm() / original.norm()) <= rel_bound
    if num_tokens > 1:
        assert not torch.equal(result, original)  # a lossy codec that returned the input would hide a wiring bug


@pytest.mark.parametrize("spec", ["none", "zstd", "lz4", "bf16", "fp8_e4m3", "int8:scale=channel"])
def test_lossless_flag(spec):
    assert get_codec(spec).lossless == (spec in LOSSLESS)


@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_codecs_keep_any_bytes(spec):
    """Incompressible bytes, NaN and inf patterns included, come back unchanged."""
    layout = layout_of("bfloat16")
    data = np.random.default_rng(1).integers(0, 256, layout.chunk_bytes(20), dtype=np.uint8)
    encoded = get_codec(spec).encode(data, layout, 20)
    assert np.array_equal(get_codec(spec).decode(encoded.data, encoded.params, layout, 20), data)


@pytest.mark.parametrize("spec, dtype", cases())
def test_a_damaged_byte_is_an_error(spec, dtype):
    layout, _, encoded = encode(spec, dtype, 40)
    damaged = bytearray(memoryview(encoded.data).cast("B"))
    damaged[len(damaged) // 2] ^= 0x5A
    with pytest.raises(CodecError, match="checksum"):
        get_codec(spec).decode(bytes(damaged), encoded.params, layout, 40)


@pytest.mark.parametrize("spec, dtype", cases())
def test_truncated_bytes_are_an_error(spec, dtype):
    layout, _, encoded = encode(spec, dtype, 40)
    with pytest.raises(CodecError):
        get_codec(spec).decode(bytes(memoryview(encoded.data).cast("B"))[:-3], encoded.params, layout, 40)


@pytest.mark.parametrize("spec, dtype", cases())
def test_a_decoded_size_the_layout_does_not_give_is_an_error(spec, dtype):
    """The bytes are intact (the checksum passes) but belong to a chunk of another length or layout."""
    layout, _, encoded = encode(spec, dtype, 40)
    codec = get_codec(spec)
    for tokens in (39, 41):
        with pytest.raises(CodecError, match="bytes"):
            codec.decode(encoded.data, encoded.params, layout, tokens)
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype)
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(encoded.data, encoded.params, other, 40)


@pytest.mark.parametrize("spec, dtype", cases())
def test_a_damaged_byte_without_verification_is_never_a_wrong_size(spec, dtype):
    """With the checksum skipped (a caller that checked the record already), decoding still returns the layout's
    size or raises CodecError, never something else."""
    layout, _, encoded = encode(spec, dtype, 40)
    damaged = bytearray(memoryview(encoded.data).cast("B"))
    for position in (0, len(damaged) // 3, len(damaged) - 1):
        damaged[position] ^= 0xFF
        try:
            decoded = get_codec(spec).decode(bytes(damaged), encoded.params, layout, 40, verify=False)
        except CodecError:
            continue
        assert decoded.nbytes == layout.chunk_bytes(40)


@pytest.mark.parametrize("spec", ["zstd", "fp8_e4m3+zstd", "int8"])
def test_params_from_another_codec_are_an_error(spec):
    layout, _, encoded = encode(spec, "float32", 16)
    params = {k: v for k, v in encoded.params.items() if k == "xxh3"}
    with pytest.raises(CodecError, match="params lack"):
        get_codec(spec).decode(encoded.data, params, layout, 16)
    with pytest.raises(CodecError):
        get_codec(spec).decode(encoded.data, "not a dict", layout, 16)


def test_an_unknown_option_value_in_params_is_an_error():
    layout, _, encoded = encode("int8+zstd", "float32", 16)
    params = {**encoded.params, "int8": {**encoded.params["int8"], "scale": "row"},
              "zstd": {**encoded.params["zstd"]}}
    with pytest.raises(CodecError, match="scale mode"):
        get_codec("int8+zstd").decode(encoded.data, params, layout, 16)
    params = {**encoded.params, "zstd": {"shuffle": "bit"}}
    with pytest.raises(CodecError, match="shuffle"):
        get_codec("int8+zstd").decode(encoded.data, params, layout, 16)


@pytest.mark.parametrize("written, reader", [("zstd:shuffle=none,level=5", "zstd"), ("lz4:acceleration=4", "lz4"),
                                             ("int8:scale=kivi,group=8", "int8"), ("fp8_e4m3:scale=channel+lz4",
                                                                                    "fp8_e4m3+lz4")])
def test_the_decoder_follows_the_params_not_its_own_options(written, reader):
    layout, _, encoded = encode(written, "bfloat16", 30)
    expected = get_codec(written).decode(encoded.data, encoded.params, layout, 30)
    assert np.array_equal(get_codec(reader).decode(encoded.data, encoded.params, layout, 30), expected)
    assert get_codec(written).name == get_codec(reader).name


@pytest.mark.parametrize("spec, dtype", cases())
@pytest.mark.parametrize("num_tokens", [0, 37])
def test_decode_into_a_buffer(spec, dtype, num_tokens):
    """Decoding into a caller's buffer (an L1 slot) gives the bytes a plain decode gives, in that buffer."""
    layout, _, encoded = encode(spec, dtype, num_tokens, seed=3)
    codec = get_codec(spec)
    expected = codec.decode(encoded.data, encoded.params, layout, num_tokens)
    out = bytearray(b"\xa5" * layout.chunk_bytes(num_tokens))  # not zeros: every byte must be written
    result = codec.decode(encoded.data, encoded.params, layout, num_tokens, out=out)
    assert bytes(out) == expected.tobytes()
    assert not num_tokens or np.shares_memory(result, np.frombuffer(out, np.uint8))
    with pytest.raises(InputError, match="decode target"):
        codec.decode(encoded.data, encoded.params, layout, num_tokens, out=bytearray(layout.chunk_bytes(num_tokens) + 4))


@pytest.mark.parametrize("spec", ALL)
def test_a_payload_of_the_wrong_size_is_refused(spec):
    layout = layout_of("float32")
    with pytest.raises(InputError, match="needs"):
        get_codec(spec).encode(np.zeros(layout.chunk_bytes(4) - 4, np.uint8), layout, 4)


@pytest.mark.parametrize("spec", ["fp8_e4m3", "int8:scale=channel", "fp8_e4m3:scale=kivi+zstd"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_lossy_codecs_refuse_non_finite_kv(spec, bad):
    layout = layout_of("float32")
    kv = kv_like(layout, 8)
    kv[1, 0, 3, 1, 5] = bad
    with pytest.raises(InputError, match="NaN or inf"):
        get_codec(spec).encode(raw_bytes(kv), layout, 8)


@pytest.mark.parametrize("spec, dtype", [("bf16", "bfloat16"), ("bf16+zstd", "float16"), ("fp8_e4m3", "float8_e4m3fn"),
                                         ("int8", "float8_e5m2")])
def test_a_transform_refuses_a_dtype_it_cannot_shrink(spec, dtype):
    layout = layout_of(dtype)
    with pytest.raises(InputError, match=dtype):
        get_codec(spec).encode(np.zeros(layout.chunk_bytes(2), np.uint8), layout, 2)


def test_all_zero_kv_round_trips_exactly_even_when_lossy():
    layout = layout_of("bfloat16")
    zeros = np.zeros(layout.chunk_bytes(5), np.uint8)
    for spec in ("fp8_e4m3", "int8:scale=channel"):
        encoded = get_codec(spec).encode(zeros, layout, 5)
        assert np.array_equal(get_codec(spec).decode(encoded.data, encoded.params, layout, 5), zeros)


@pytest.mark.parametrize("name", ["gzip", "fp8", "zstd+gzip", "", "ZSTD"])
def test_an_unknown_codec_names_the_choices(name):
    with pytest.raises(UnknownCodecError, match="fp8_e4m3") as info:
        get_codec(name)
    assert "zstd" in str(info.value) and "lz4" in str(info.value) and "none" in str(info.value)
    assert isinstance(info.value, ConfigError)


@pytest.mark.parametrize("spec, match", [("zstd:level=99", "level"), ("zstd:speed=3", "options are"),
                                         ("lz4:shuffle=bit", "shuffle"), ("int8:scale=row", "scale"),
                                         ("zstd+fp8_e4m3", "followed by"), ("fp8_e4m3+int8", "followed by"),
                                         ("zstd+lz4", "followed by"), ("bf16:group=4", "options are"),
                                         ("int8:group=-1", "group")])
def test_bad_options_and_orders_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        get_codec(spec)


@pytest.mark.parametrize("spec", ["int8", "fp8_e4m3:sink=8", "int8:scale=token,sink=100"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sink_tokens_come_back_exactly(spec, dtype):
    """The chunk's first ``sink`` tokens (attention sinks) are stored unquantized: bit-identical after decoding,
    while the rest is quantized; a chunk shorter than ``sink`` is kept whole."""
    num_tokens = 37
    layout, kv, encoded = encode(spec, dtype, num_tokens, seed=5)
    sink = min(get_codec(spec).transform.options["sink"], num_tokens)
    decoded = as_tensor(get_codec(spec).decode(encoded.data, encoded.params, layout, num_tokens), kv)
    assert sink > 0 and torch.equal(decoded[:, :, :sink], kv[:, :, :sink])
    assert torch.equal(decoded, kv) == (sink == num_tokens)


def test_records_written_before_sink_tokens_still_decode():
    """Parameters without ``sink`` (records of an earlier kvtier) mean no sink tokens, not an error."""
    layout, kv, encoded = encode("int8:sink=0", "float32", 20)
    params = {**encoded.params, "int8": {k: v for k, v in encoded.params["int8"].items() if k != "sink"}}
    old = get_codec("int8:sink=0").decode(encoded.data, params, layout, 20)
    assert np.array_equal(old, get_codec("int8:sink=0").decode(encoded.data, encoded.params, layout, 20))


def test_names_and_specs():
    codec = get_codec(" fp8_e4m3:scale=kivi + zstd:level=3 ")
    assert codec.name == "fp8_e4m3+zstd"
    assert codec.spec == "fp8_e4m3:center=0,group=0,scale=kivi,sink=0,span=0+zstd:level=3,shuffle=byte"
    assert get_codec("none").name == "none" and get_codec("none").lossless
