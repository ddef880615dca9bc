"""The kernels compile for an H100/H200 (sm_90) and fit its shared memory, without a GPU.

The interpreter tests cannot see type errors of the compiled path or shared-memory
overflows, so this compiles the launch configurations the launchers pick for the
heaviest cases with Triton's bundled ptxas. Compilation needs a process in which
TRITON_INTERPRET is unset, so the test reruns this file as a script.
"""

import json
import os
import subprocess
import sys

import pytest

SM90_MAX_SHARED_BYTES = 232448  # 227 KiB of opt-in dynamic shared memory per block


def _sig(fn, types: dict, consts: dict) -> dict:
    return {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}


def _attention(dt: str, d_pad: int, block_n: int, tree: bool):
    from vllm_dspark.kernels import verify_attention as va

    types = {n: "*" + dt for n in ("q_ptr", "kn_ptr", "vn_ptr", "kc_ptr", "vc_ptr", "out_ptr")}
    types.update(bt_ptr="*i32", ctx_ptr="*i32", cu_ptr="*i32", par_ptr="*i32", qk_scale="fp32")
    consts = dict(GROUP=8, BLOCK_M=64, BLOCK_N=block_n, D_PAD=d_pad, IS_TREE=tree,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
    return va._verify_attention_kernel, types, consts


def _head(dt: str, r_pad: int, block_v: int, probs: bool, reduced: bool = False):
    from vllm_dspark.kernels import sequential_head as sh

    types = dict(u_ptr="*" + dt, anchor_ptr="*i64", w1_ptr="*" + dt, w2_ptr="*" + dt, temp_ptr="*fp32",
                 seed_ptr="*i64", d2t_ptr="*i64", h_ptr="*" + dt, cw_ptr="*" + dt, ct_ptr="*fp32", conf_bias="fp32",
                 tok_ptr="*i64", tp_ptr="*fp32", conf_ptr="*fp32", probs_ptr="*fp32", pf_ptr="*fp32",
                 pi_ptr="*i64")
    consts = dict(BLOCK_R=16, BLOCK_V=block_v, R_PAD=r_pad, BLOCK_D=256, SPLITS_PAD=128, HAS_CONF=True,
                  CONF_MARKOV=True, WRITE_PROBS=probs, HAS_D2T=reduced,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
    return sh._sequential_head_step_kernel, types, consts


def _admission():
    from vllm_dspark.kernels import admission

    return admission._admission_kernel, dict(conf_ptr="*fp32", out_ptr="*i64"), dict(K_PAD=16, BLOCK=256)


# Heaviest configurations the launchers choose (block sizes as in their defaults).
CONFIGS = {
    "attention bf16 d128 chain": lambda: _attention("bf16", 128, 64, False),
    "attention fp32 d256 tree": lambda: _attention("fp32", 256, 32, True),
    "head bf16 r256 probs": lambda: _head("bf16", 256, 128, True),
    "head fp32 r256": lambda: _head("fp32", 256, 64, False),
    "head bf16 r32 probs reduced vocabulary": lambda: _head("bf16", 32, 128, True, reduced=True),
    "admission": _admission,
}


def _compile_all() -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    shared = {}
    for name, make in CONFIGS.items():
        fn, types, consts = make()
        compiled = triton.compile(ASTSource(fn, _sig(fn, types, consts), consts), target=GPUTarget("cuda", 90, 32))
        shared[name] = compiled.metadata.shared
    return shared


def test_kernels_compile_for_sm90(tmp_path) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(shared) == set(CONFIGS)
    for name, nbytes in shared.items():
        assert nbytes <= SM90_MAX_SHARED_BYTES, (name, nbytes)


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
