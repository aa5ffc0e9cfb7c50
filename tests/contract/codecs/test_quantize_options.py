"""What the one-byte quantizers' options do (``center``, ``span``, sink tokens left out of the scales), and records
written by an earlier kvtier still decoding to the very bytes they decoded to then."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from support.kv_chunks import kv_like, raw_bytes

from kvtier.codecs import get_codec
from kvtier.errors import ConfigError, InputError
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
RECORDS = Path(__file__).parent / "data" / "lossy_records_2026_12.json"


def round_trip(spec: str, kv: torch.Tensor, layout: KVLayout = LAYOUT) -> torch.Tensor:
    codec = get_codec(spec)
    encoded = codec.encode(raw_bytes(kv), layout, kv.shape[2])
    decoded = codec.decode(encoded.data, encoded.params, layout, kv.shape[2])
    return torch.from_numpy(np.array(decoded)).view(kv.dtype).view(kv.shape)


def encoded_bytes(spec: str, num_tokens: int = 64, layout: KVLayout = LAYOUT) -> int:
    kv = kv_like(layout, num_tokens)
    return get_codec(spec).encode(raw_bytes(kv), layout, num_tokens).nbytes


@pytest.mark.parametrize("transform", ["int8", "fp8_e4m3"])
def test_center_quantizes_a_channel_around_its_offset(transform):
    """Keys whose channels sit far from 0 with a small spread (as slowly rotating RoPE channels do): centered on the
    group's midrange, the grid spans the spread instead of 0..offset, and the error falls with it."""
    kv = kv_like(LAYOUT, 64, seed=2)
    spread = torch.randn(kv[:, 0].shape, generator=torch.Generator().manual_seed(2))
    kv[:, 0] = spread * 0.05 + torch.linspace(-30.0, 30.0, LAYOUT.head_dim)
    plain = (round_trip(f"{transform}:scale=kivi,group=16,sink=0,center=0", kv) - kv)[:, 0].abs().max()
    centered = (round_trip(f"{transform}:scale=kivi,group=16,sink=0,center=1", kv) - kv)[:, 0].abs().max()
    assert centered < plain / 20, (float(centered), float(plain))


def test_center_stores_an_offset_per_channel_group():
    """One float16 offset next to every channel group's scale: 2 bytes per channel per group of keys."""
    groups = 64 // 16
    extra = LAYOUT.num_layers * groups * LAYOUT.num_kv_heads * LAYOUT.head_dim * 2
    assert encoded_bytes("int8:group=16,sink=0,center=1") - encoded_bytes("int8:group=16,sink=0,center=0") == extra
    # under scale=token there are no channel groups: nothing to center, nothing stored
    assert encoded_bytes("int8:scale=token,center=1") == encoded_bytes("int8:scale=token")


def test_span_gives_each_part_of_a_token_its_own_scale():
    """A value outlier coarsens only the span of head_dim it falls in; with span=0 it coarsens the whole token."""
    kv = kv_like(LAYOUT, 32, seed=4)
    kv[:, 1, :, :, 5] *= 50.0  # one outlier channel in the first 16 of every value vector
    rest = slice(16, None)
    whole = (round_trip("int8:span=0", kv) - kv)[:, 1, ..., rest].abs().max()
    spans = (round_trip("int8:span=16", kv) - kv)[:, 1, ..., rest].abs().max()
    assert spans < whole / 10, (float(spans), float(whole))
    tokens = LAYOUT.num_layers * 32 * LAYOUT.num_kv_heads
    assert encoded_bytes("int8:span=16", 32) - encoded_bytes("int8:span=0", 32) == tokens * (64 // 16 - 1) * 2


def test_a_span_that_does_not_divide_head_dim_leaves_a_shorter_last_span():
    kv = kv_like(LAYOUT, 9, seed=6)
    result = round_trip("int8:scale=token,span=24,sink=0", kv)  # spans of 24, 24 and 16 elements
    assert float((result - kv).abs().max()) <= 0.01 * float(kv.abs().max())


def test_sink_tokens_do_not_set_their_groups_scales():
    """A sink token with keys 1000x the others' (kept exact anyway) leaves the rest of its group on a fine grid."""
    kv = kv_like(LAYOUT, 16, seed=8)
    kv[:, :, 0] *= 1000.0
    error = (round_trip("int8:scale=channel,group=16,sink=1", kv) - kv)[:, :, 1:].abs().max()
    assert torch.equal(round_trip("int8:scale=channel,group=16,sink=1", kv)[:, :, 0], kv[:, :, 0])
    assert float(error) <= 0.01 * float(kv[:, :, 1:].abs().max())


@pytest.mark.parametrize("spec", ["int8:center=1,sink=3", "fp8_e4m3:scale=channel,center=1,group=2,sink=5"])
def test_groups_made_only_of_sink_tokens_decode(spec):
    """A group that holds nothing but sink tokens has nothing to scale; its tokens come back exactly."""
    kv = kv_like(LAYOUT, 11, seed=9)
    result = round_trip(spec, kv)
    sink = get_codec(spec).transform.options["sink"]
    assert torch.equal(result[:, :, :sink], kv[:, :, :sink])
    assert float((result - kv).abs().max()) <= 0.07 * float(kv.abs().max())


@pytest.mark.parametrize("token", [0, 20])
def test_centered_codecs_refuse_non_finite_kv_in_sinks_and_groups(token):
    kv = kv_like(LAYOUT, 32)
    kv[1, 0, token, 1, 7] = float("nan")
    with pytest.raises(InputError, match="NaN or inf"):
        get_codec("int8:center=1,sink=1").encode(raw_bytes(kv), LAYOUT, 32)


@pytest.mark.parametrize("spec, match", [("int8:center=2", "center"), ("int8:span=-1", "span"),
                                         ("fp8_e4m3:center=yes", "center"),
                                         ("int8:scale=kivi,scale=token", "'scale' given twice"),
                                         ("none+zstd", "'none' stands alone"), ("none:level=1", "'none' stands alone")])
def test_bad_new_options_are_config_errors(spec, match):
    with pytest.raises(ConfigError, match=match):
        get_codec(spec)


def test_records_written_before_center_and_span_decode_as_they_did():
    """Records of fp8 / int8 codecs written by kvtier before these options (their params lack them; sink tokens
    were part of the scales then) decode to exactly the bytes that kvtier decoded them to."""
    for entry in json.loads(RECORDS.read_text()):
        layout = KVLayout(num_layers=entry["num_layers"], num_kv_heads=entry["num_kv_heads"],
                          head_dim=entry["head_dim"], dtype=entry["dtype"])
        assert "center" not in json.dumps(entry["params"])
        decoded = get_codec(entry["name"]).decode(base64.b64decode(entry["data"]), entry["params"], layout,
                                                  entry["num_tokens"])
        assert xxhash.xxh3_64_hexdigest(decoded) == entry["decoded_xxh3"], entry["spec"]
