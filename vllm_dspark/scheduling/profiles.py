"""Where the engine throughput curve SPS(B) comes from: a table, a file or the profile cache.

The one home of `"sps_profile": "auto"`: the profile `vllm-dspark profile --cache` stored
for this model, dtype, hardware and vLLM version. The profiler (`engine_profile.py`)
writes where `cached_profile_path` says; the scheduler reads through `resolve_sps_curve`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

from vllm_dspark.config import AUTO_PROFILE, ConfigError, PluginOptions
from vllm_dspark.scheduling.sps import SpsCurve

logger = logging.getLogger(__name__)


def hardware_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except ImportError:
        pass
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    return f"{platform.machine()} x{os.cpu_count()}"


def profile_key(model: str, dtype: str) -> dict[str, str]:
    from vllm_dspark.integration.compat import installed_vllm_version

    return {
        "model": str(Path(model).resolve()) if Path(model).exists() else model,
        "dtype": dtype,
        "hardware": hardware_name(),
        "vllm_version": installed_vllm_version(),
    }


def cached_profile_path(key: dict[str, str]) -> Path:
    """Where the plugin looks for a profile of this engine (`"sps_profile": "auto"`)."""
    cache = Path(os.environ.get("VLLM_DSPARK_CACHE", Path.home() / ".cache" / "vllm-dspark"))
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    return cache / "profiles" / f"sps-{digest}.json"


def load_cached_profile(path: Path, model: str) -> SpsCurve:
    """The cached profile at `path`, or a clear error saying how to replace a corrupt one."""
    try:
        return SpsCurve.load(path)
    except ValueError as error:
        raise ConfigError(
            f"the cached SPS profile {path} is unusable ({error}); delete it or rerun "
            f"`vllm-dspark profile --model {model} --out FILE --cache`"
        ) from error


def resolve_sps_curve(options: PluginOptions, model: str, dtype: str) -> SpsCurve | None:
    """The curve the options name; for "auto" the cached profile of this engine, or None
    (with a warning saying how to make one) when there is none yet."""
    if options.sps_profile != AUTO_PROFILE:
        return options.sps_curve()
    key = profile_key(model, dtype)
    path = cached_profile_path(key)
    if path.is_file():
        logger.info("vllm_dspark: SPS profile for this engine from %s", path)
        return load_cached_profile(path, model)
    logger.warning(
        "vllm_dspark: no cached SPS profile for %s (looked for %s): run "
        "`vllm-dspark profile --model %s --out FILE --cache`", key, path, model,
    )
    return None
