"""vllm-dspark: DSpark speculative decoding as a vLLM plugin.

`register` is the `vllm.general_plugins` entry point; vLLM calls it once in every
process it starts. Importing this package alone does not import vLLM or torch.
"""

__version__ = "0.1.0"

METHOD = "vllm_dspark"


def register() -> None:
    """Teach vLLM the `vllm_dspark` speculative method (idempotent); refuse a vLLM
    release outside the supported range (see `integration/compat.py`)."""
    from vllm_dspark.integration import compat

    compat.check_vllm_version()
    from vllm_dspark.integration import vllm_patches

    vllm_patches.apply()
