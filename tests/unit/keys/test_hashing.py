"""Prefix hashes reproduce vLLM's block hashes (reference events-and-hashing.md §2.4)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from kvtier import hashing
from kvtier.errors import ConfigError, InputError
from kvtier.hashing import ALGORITHMS, DEFAULT_ALGORITHM, as_token_array, event_id, prefix_hashes, root_hash

TOKENS = [1, 2, 3, 4, 5, 6, 7, 8]

# (seed, algorithm) -> (block0 event id, block1 event id), from §2.4
VECTORS = {
    ("0", "sha256"): (10362225831949560093, 12472515041799373675),
    ("0", "sha256_cbor"): (2164874634404590027, 17270480062156288726),
    ("0", "xxhash"): (5138823041740264343, 1324190186712315504),
    ("0", "xxhash_cbor"): (1560721706249274670, 16652244415917022755),
    ("42", "sha256"): (649359390096368487, 14757019014570657544),
    ("42", "sha256_cbor"): (5988051177307384287, 11214766589215907092),
    ("42", "xxhash"): (2767512630621280259, 4018757380743825132),
    ("42", "xxhash_cbor"): (8335022083850143378, 14438435007848620520),
    ("vllm-none-hash", "sha256"): (1882140585328457242, 15284023028817948126),
    ("vllm-none-hash", "sha256_cbor"): (9561501211280363793, 15292913576410714033),
}


@pytest.mark.parametrize("seed,algorithm", sorted(VECTORS))
def test_event_ids_match_vllm(seed, algorithm):
    got = [event_id(h) for h in prefix_hashes(TOKENS, 4, algorithm, seed)]
    assert tuple(got) == VECTORS[(seed, algorithm)]


def test_full_digests_and_root_hashes():
    assert root_hash("sha256_cbor", "0").hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    assert root_hash("xxhash", "0").hex() == "6fb31cc38bba6066183f7f2104b9c051"
    assert root_hash("xxhash_cbor", "0").hex() == "1ebe36576dcb573f26b99533a20aaeca"
    cbor = prefix_hashes(TOKENS, 4, "sha256_cbor", "0")
    assert [h.hex() for h in cbor] == [
        "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
        "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6"]
    pick = prefix_hashes(TOKENS, 4, "sha256", "0")
    assert [h.hex() for h in pick] == [
        "762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
        "9e62b5a7ec298f33cb4c7d9e00b659874bb2432d23ad6879ad1746592a2b036b"]


def test_legacy_64bit_chain():
    assert int.from_bytes(root_hash("sha256_cbor_64bit", "0"), "big") == 17921330210090130494
    got = [event_id(h) for h in prefix_hashes(TOKENS, 4, "sha256_cbor_64bit", "0")]
    assert got == [795349079050919324, 1097524857542371387]


# each encoder runs on prompts of any length (short ones take the block-by-block encoder unless the table's
# threshold is lowered to 0): both must give the same bytes
BOTH_ENCODERS = pytest.mark.parametrize("table", [True, False], ids=["table", "block_by_block"])


def use_table(monkeypatch, table: bool) -> None:
    threshold = 0 if table else 10**9
    monkeypatch.setattr(hashing, "_CBOR_TABLE_MIN_TOKENS", threshold)
    monkeypatch.setattr(hashing, "_PICKLE_TABLE_MIN_TOKENS", threshold)


@BOTH_ENCODERS
@pytest.mark.parametrize("algorithm", ["sha256_cbor", "xxhash_cbor"])
def test_fast_cbor_path_equals_cbor2(algorithm, table, monkeypatch):
    """The vectorised token encoder must equal cbor2 for every integer width."""
    use_table(monkeypatch, table)
    import hashlib

    import cbor2
    import xxhash
    rng = np.random.default_rng(0)
    tokens = np.concatenate([rng.integers(0, 24, 50), rng.integers(24, 256, 50), rng.integers(256, 65536, 50),
                             rng.integers(65536, 2**32, 50), rng.integers(2**32, 2**40, 56)])
    rng.shuffle(tokens)
    h = hashlib.sha256 if algorithm == "sha256_cbor" else None
    parent = root_hash(algorithm, "s")
    expected = []
    for i in range(0, 256, 32):
        data = cbor2.dumps((parent, tuple(int(t) for t in tokens[i:i + 32]), None), canonical=True)
        parent = h(data).digest() if h else xxhash.xxh3_128_digest(data)
        expected.append(parent)
    assert prefix_hashes(tokens, 32, algorithm, "s") == expected


def test_default_algorithm_is_vllm_032s_default():
    assert DEFAULT_ALGORITHM == "sha256"  # vLLM 0.32 CacheConfig.prefix_caching_hash_algo; checked against vLLM
    assert prefix_hashes(TOKENS, 4, seed="vllm-none-hash") == prefix_hashes(TOKENS, 4, "sha256", "vllm-none-hash")


@BOTH_ENCODERS
@pytest.mark.parametrize("algorithm", ["sha256", "xxhash"])
def test_fast_pickle_path_equals_pickle_dumps(algorithm, table, monkeypatch):
    """The vectorised pickle encoder must give the bytes of pickle.dumps(..., protocol=5) for every token
    width (BININT1/BININT2/BININT), block lengths 1-3 (TUPLE1-3) and more (MARK ... TUPLE), partial blocks,
    and blocks with extra keys in between (those go through pickle itself)."""
    use_table(monkeypatch, table)
    import hashlib
    import pickle

    import xxhash
    digest = (lambda b: hashlib.sha256(b).digest()) if algorithm == "sha256" else xxhash.xxh3_128_digest
    rng = np.random.default_rng(7)
    for trial in range(200):
        block_size = int(rng.integers(1, 48))
        high = int(rng.choice([24, 256, 65536, 2**31, 2**40, 2**48, 2**56, 2**63]))
        tokens = rng.integers(0, high, int(rng.integers(0, 300))).tolist()
        partial = bool(trial % 2)
        n = len(tokens) // block_size + (1 if partial and len(tokens) % block_size else 0)
        extra = [("lora", "a", "/p") if rng.random() < 0.2 else None for _ in range(n)]
        extra = [None if e is None else (e,) for e in extra]
        parent, expected = root_hash(algorithm, "s"), []
        for i in range(n):
            block = tuple(tokens[i * block_size:(i + 1) * block_size])
            parent = digest(pickle.dumps((parent, block, extra[i]), protocol=5))
            expected.append(parent)
        assert prefix_hashes(tokens, block_size, algorithm, "s", extra, include_partial=partial) == expected, trial


def test_token_ids_beyond_int32_hash_as_pickle_long1():
    import hashlib
    import pickle
    edges = [2**31 - 1, 2**31, 2**39 - 1, 2**39, 2**47 - 1, 2**47, 2**55 - 1, 2**55, 2**63 - 1]
    tokens = [1, *edges, 300, 70_000, 5]
    parent = root_hash("sha256", "s")
    want = hashlib.sha256(pickle.dumps((parent, tuple(tokens), None), protocol=5)).digest()
    assert prefix_hashes(tokens, len(tokens), "sha256", "s") == [want]
    big = np.arange(6000, dtype=np.int64) + 2**62  # a long block of 10-byte LONG1 tokens
    want = hashlib.sha256(pickle.dumps((parent, tuple(big.tolist()), None), protocol=5)).digest()
    assert prefix_hashes(big, 6000, "sha256", "s") == [want]


def test_blocks_partial_and_extra_keys():
    tokens = list(range(10))
    assert len(prefix_hashes(tokens, 4)) == 2
    with_tail = prefix_hashes(tokens, 4, include_partial=True)
    assert len(with_tail) == 3 and with_tail[:2] == prefix_hashes(tokens, 4)
    salted = prefix_hashes(tokens, 4, extra_keys=[("salt",), None])
    assert salted[0] != prefix_hashes(tokens, 4)[0]
    # chaining: the second chunk depends on the first
    assert prefix_hashes([9, 9, 9, 9] + tokens[4:8], 4)[1] != prefix_hashes(tokens, 4)[1]
    assert prefix_hashes(tokens[4:8], 4, parent=prefix_hashes(tokens, 4)[0]) == prefix_hashes(tokens, 4)[1:]


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], [1.5, 2.0], [-1, 2], "abc", np.array([True, False]),
                                 np.array([1.0, 2.0]), np.zeros((2, 2), np.int64)])
def test_bad_tokens_rejected(bad):
    with pytest.raises(InputError):
        as_token_array(bad)


def test_bad_chunk_size_and_algorithm():
    for size in (0, -4, 2.5):
        with pytest.raises(InputError, match="block_size"):
            prefix_hashes([1, 2, 3], size)
    with pytest.raises(ConfigError, match="sha256"):
        prefix_hashes([1, 2, 3], 1, algorithm="md5")


def test_same_hashes_in_other_processes_regardless_of_pythonhashseed():
    code = ("from kvtier.hashing import prefix_hashes, ALGORITHMS;"
            "print([h.hex() for a in ALGORITHMS for h in prefix_hashes(list(range(64)), 16, a)])")
    outputs = set()
    for seed in (None, "0", "12345"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if seed is not None:
            env["PYTHONHASHSEED"] = seed
        outputs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True).stdout)
    here = str([h.hex() for a in ALGORITHMS for h in prefix_hashes(list(range(64)), 16, a)]) + "\n"
    assert outputs == {here}
