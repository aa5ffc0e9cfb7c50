"""``kvtier demo``: multi-round QA over a long document on a real model, showing TTFT with kvtier (``run``: the
flow, in this process and a second one; ``cli``: the command and its table)."""
