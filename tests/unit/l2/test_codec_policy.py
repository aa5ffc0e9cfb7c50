"""CodecPolicy: write codecs per L2 adapter, lossy codecs allowed per model (issue 20 part B, identity)."""

import pytest

from kvtier.codecs.policy import CodecPolicy
from kvtier.errors import ConfigError, UnknownCodecError


def test_lossless_is_always_allowed_and_lossy_only_where_listed():
    policy = CodecPolicy(["lz4", "fp8_e4m3+zstd"], {"smollm2-*": ["fp8_e4m3+zstd"], "gemma*": ["int8"]})
    assert policy.allowed("any-model", "lz4") and policy.allowed("any-model", "none")
    assert policy.allowed("smollm2-135m@abc", "fp8_e4m3+zstd")
    assert not policy.allowed("smollm2-135m@abc", "fp8_e4m3")  # another codec name: not listed
    assert not policy.allowed("llama@1", "fp8_e4m3+zstd")
    policy.check_writer("smollm2-135m@abc")
    with pytest.raises(ConfigError, match="'adapter 1' writes lossy codec 'fp8_e4m3\\+zstd'.*'llama@1'"):
        policy.check_writer("llama@1")
    assert [c.name for c in policy.distinct()] == ["lz4", "fp8_e4m3+zstd"]


def test_default_is_lossless_only():
    policy = CodecPolicy(["int8"], labels=["s3"])
    assert not policy.allowed("m", "int8")
    with pytest.raises(ConfigError, match="'s3' writes lossy codec 'int8'"):
        policy.check_writer("m")


def test_bad_names_are_clear_startup_errors():
    with pytest.raises(UnknownCodecError, match="L2 adapter 'disk': unknown codec 'zst'.*'none'"):
        CodecPolicy(["zst"], labels=["disk"])
    with pytest.raises(ConfigError, match="'lz4' is lossless"):
        CodecPolicy(["none"], {"*": ["lz4"]})
    with pytest.raises(UnknownCodecError, match=r"lossy_codecs_allowed\['\*'\]: unknown codec 'fp9'"):
        CodecPolicy(["none"], {"*": ["fp9"]})
    with pytest.raises(ConfigError, match="without options .*'int8'"):  # options would silently allow every int8
        CodecPolicy(["none"], {"smol*": ["int8:group=4"]})


def test_one_encode_per_distinct_codec():
    policy = CodecPolicy(["zstd", "zstd", "none"])
    assert [c.name for c in policy.distinct()] == ["zstd", "none"]
