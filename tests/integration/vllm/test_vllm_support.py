"""Assertions shared by the vLLM integration tests (the processes they start are in ``kvtier_harness.vllm``)."""

from __future__ import annotations

TOLERANCE = 1e-4


def cached_tokens(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def assert_same_reply(got: dict, want: dict, label: str) -> None:
    """Same greedy text, and the same top-3 tokens with log-probabilities within TOLERANCE, per step."""
    g, w = got["choices"][0], want["choices"][0]
    assert g["text"] == w["text"], f"{label}: greedy text differs: {g['text']!r} vs {w['text']!r}"
    for step, (gt, wt) in enumerate(zip(g["logprobs"]["top_logprobs"], w["logprobs"]["top_logprobs"])):
        assert gt.keys() == wt.keys(), f"{label}: step {step} top tokens {sorted(gt)} != {sorted(wt)}"
        for tok, value in wt.items():
            assert abs(gt[tok] - value) <= TOLERANCE, f"{label}: step {step} token {tok!r}: {gt[tok]} vs {value}"


def by_prompt(result: dict, repeat: int = 0) -> dict[int, dict]:
    return {r["prompt"]: r for r in result["results"] if r["repeat"] == repeat}


def assert_same_output(got: dict, want: dict, label: str, num_steps: int = 4) -> None:
    """Same greedy tokens, and the same top-k token ids with log-probabilities within TOLERANCE, per step."""
    assert got["token_ids"][:num_steps] == want["token_ids"][:num_steps], f"{label}: greedy tokens differ"
    for step, (g, w) in enumerate(zip(got["logprobs"][:num_steps], want["logprobs"][:num_steps])):
        assert set(g) == set(w), f"{label}: step {step} top token ids {sorted(g)} != {sorted(w)}"
        for tok, value in w.items():
            assert abs(g[tok] - value) <= TOLERANCE, f"{label}: step {step} token {tok}: {g[tok]} vs {value}"
