"""Time the DSpark Triton kernels against their PyTorch references (and SDPA for attention).

The sequential head's reference is the model's own loop (`heads.sequential_draft`), as
the dispatcher runs it without the kernel.

On CUDA: realistic shapes (Qwen3-8B-like attention, a 49,152-word Markov head), median
times, achieved bandwidth / FLOP rate and the fraction of the H200's ceilings; each case
also checks the kernel against the reference. Writes benchmarks/results/bench_kernels.{json,md}.

`--dry-run` runs every case at tiny shapes on the CPU, the kernels through the Triton
interpreter, to check the wiring; it writes bench_kernels.dryrun.{json,md}, whose times
mean nothing and are marked as such.
"""

import sys

if "--dry-run" in sys.argv:
    import vllm_dspark.kernels.interpret as _interpret  # must precede the first triton import

    _interpret.load_interpreted_kernels()

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Optional  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from vllm_dspark.config import DrafterConfig  # noqa: E402
from vllm_dspark.kernels import admission, dispatch, sequential_head, verify_attention  # noqa: E402
from vllm_dspark.model.drafter import DSparkDrafter  # noqa: E402

H200_COPY_BYTES_PER_S = 4.3e12
H200_BF16_FLOP_PER_S = 790e12
RESULTS_DIR = Path(__file__).resolve().parent / "results"
COMMITTED_DRAFTER = Path(__file__).resolve().parents[1] / "examples" / "drafters" / "smollm2-dspark-b7"
# Largest kernel-vs-reference difference accepted per kernel (16-bit attention outputs).
TOLERANCE = {"verify_attention": 3e-2, "sequential_head": 1e-3, "admission": 0.0}


def measure(fn: Callable[[], object], device: torch.device, budget_s: float, max_reps: int) -> float:
    """Median milliseconds per call after one warm-up, within a time budget per case."""
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _row(kernel: str, case: str, shape: str, t_kernel: float, t_ref: float, err: float,
         bytes_moved: float, flops: float, t_sdpa: Optional[float] = None) -> dict:
    bw = bytes_moved / (t_kernel * 1e-3)
    rate = flops / (t_kernel * 1e-3)
    return {
        "kernel": kernel, "case": case, "shape": shape,
        "kernel_ms": t_kernel, "reference_ms": t_ref, "sdpa_ms": t_sdpa,
        "speedup_vs_reference": t_ref / t_kernel,
        "bytes": bytes_moved, "flops": flops,
        "tb_per_s": bw / 1e12, "tflop_per_s": rate / 1e12,
        "frac_copy_bw": bw / H200_COPY_BYTES_PER_S, "frac_bf16_flops": rate / H200_BF16_FLOP_PER_S,
        "max_abs_err": err, "ok": err <= TOLERANCE[kernel],
    }


# ------------------------------------------------------------------------------- attention


def _attention_inputs(num_req, q_lens, ctx, heads, kv_heads, head_dim, block_size, dtype, device, tree):
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.tensor(q_lens, dtype=torch.int32)
    cu = torch.zeros(num_req + 1, dtype=torch.int32)
    cu[1:] = lens.cumsum(0)
    total = int(cu[-1])
    blocks_per = math.ceil(ctx / block_size)
    pool = num_req * blocks_per
    table = torch.randperm(pool, generator=g).to(torch.int32).view(num_req, blocks_per)
    parents = None
    if tree:  # a random tree per request, nodes in topological order
        parents = torch.cat([
            torch.cat([torch.tensor([-1]), (torch.rand(n - 1, generator=g) * torch.arange(1, n)).long()])
            for n in q_lens]).to(torch.int32)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    return dict(
        q=rnd(total, heads, head_dim), k_new=rnd(total, kv_heads, head_dim), v_new=rnd(total, kv_heads, head_dim),
        key_cache=rnd(pool, block_size, kv_heads, head_dim), value_cache=rnd(pool, block_size, kv_heads, head_dim),
        block_table=table.to(device), context_lens=torch.full((num_req,), ctx, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device), tree_parents=None if parents is None else parents.to(device),
    )


def _sdpa_fn(case: dict, q_len: int, ctx: int, block_size: int) -> Callable[[], torch.Tensor]:
    """SDPA on K/V already gathered into dense [R, H, ctx + n, D] (gather not timed): a floor for
    what a padded, unpaged baseline costs. Only for chains with equal lengths."""
    num_req = case["block_table"].shape[0]
    pos = torch.arange(ctx, device=case["q"].device)
    blocks = case["block_table"][:, pos // block_size].long()

    def dense(cache, new):
        old = cache[blocks, pos % block_size]  # [R, ctx, Hkv, D]
        return torch.cat([old, new.view(num_req, q_len, *new.shape[1:])], dim=1).transpose(1, 2)

    k, v = dense(case["key_cache"], case["k_new"]), dense(case["value_cache"], case["v_new"])
    q = case["q"].view(num_req, q_len, *case["q"].shape[1:]).transpose(1, 2)
    mask = torch.ones(q_len, ctx + q_len, dtype=torch.bool, device=q.device).tril(diagonal=ctx)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def bench_attention(device, dry: bool, budget_s: float) -> list:
    if dry:
        cases = [("chain", 3, [4, 4, 4], 20, 4, 2, 64, 16, torch.float16, False),
                 ("tree", 2, [5, 3], 20, 3, 1, 80, 16, torch.float32, True)]
    else:
        cases = [("chain K+1=8, ctx 2048", 64, [8] * 64, 2048, 32, 8, 128, 16, torch.bfloat16, False),
                 ("chain K+1=8, ctx 4096, R=128", 128, [8] * 128, 4096, 32, 8, 128, 16, torch.bfloat16, False),
                 ("chain mixed 1..8, ctx 1024", 128, [1 + i % 8 for i in range(128)], 1024, 32, 8, 128, 16,
                  torch.bfloat16, False),
                 ("tree 32 nodes, ctx 2048", 32, [32] * 32, 2048, 32, 8, 128, 16, torch.bfloat16, True),
                 ("SmolLM2 chain, GQA 3, d 64", 64, [8] * 64, 1024, 9, 3, 64, 16, torch.bfloat16, False)]
    rows = []
    for name, num_req, q_lens, ctx, heads, kv_heads, d, bs, dtype, tree in cases:
        case = _attention_inputs(num_req, q_lens, ctx, heads, kv_heads, d, bs, dtype, device, tree)
        max_q = max(q_lens)
        out = verify_attention.verify_attention_triton(**case, max_q=max_q)
        ref = verify_attention.verify_attention_reference(**case)
        err = (out.float() - ref.float()).abs().max().item()
        t_k = measure(lambda: verify_attention.verify_attention_triton(**case, max_q=max_q), device, budget_s, 200)
        t_r = measure(lambda: verify_attention.verify_attention_reference(**case), device, budget_s, 20)
        t_s = None
        if not tree and len(set(q_lens)) == 1:
            t_s = measure(_sdpa_fn(case, q_lens[0], ctx, bs), device, budget_s, 200)
        esize = case["q"].element_size()
        total_q = sum(q_lens)
        kv_bytes = 2 * num_req * ctx * kv_heads * d * esize + 2 * total_q * kv_heads * d * esize
        bytes_moved = kv_bytes + 2 * total_q * heads * d * esize  # + q read, out written
        flops = sum(4 * n * heads * d * (ctx + n) for n in q_lens)
        shape = f"R={num_req} q={total_q} ctx={ctx} H={heads}/{kv_heads} d={d} {str(dtype)[6:]}"
        rows.append(_row("verify_attention", name, shape, t_k, t_r, err, bytes_moved, flops, t_s))
    return rows


# ------------------------------------------------------------------------------- sequential head


def bench_sequential_head(device, dry: bool, budget_s: float) -> list:
    if dry:
        cases = [("sampled+greedy", 4, 3, 300, 16, 32, torch.float32, False),
                 ("with probs", 3, 2, 200, 32, 16, torch.float16, True)]
    else:
        cases = [("R=64 K=7 sampled", 64, 7, 49152, 256, 4096, torch.bfloat16, False),
                 ("R=64 K=7 + prob rows", 64, 7, 49152, 256, 4096, torch.bfloat16, True),
                 ("R=128 K=15 r=64", 128, 15, 49152, 64, 576, torch.bfloat16, False)]
    rows = []
    for name, num_req, k, vocab, rank, hid, dtype, probs in cases:
        g = torch.Generator(device="cpu").manual_seed(0)

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)

        args = dict(
            base_logits=rnd(num_req, k, vocab, scale=2.0), anchor=torch.randint(0, vocab, (num_req,)).to(device),
            w1=rnd(vocab, rank, scale=0.1), w2=rnd(vocab, rank, scale=0.1),
            temperature=torch.tensor([0.0, 1.0] * num_req)[:num_req].to(device),
            seeds=torch.arange(num_req, dtype=torch.int64, device=device),
            hidden=rnd(num_req, k, hid), conf_weight=rnd(hid + rank, scale=0.05), conf_bias=0.1,
            conf_temps=torch.ones(k, device=device), return_probs=probs,
        )
        out = sequential_head.sequential_head_triton(**args)
        ref = dispatch.sequential_head(**args, use_kernel=False)
        err = (out.token_probs - ref.token_probs).abs().max().item()
        mismatches = int((out.tokens != ref.tokens).sum())
        t_k = measure(lambda: sequential_head.sequential_head_triton(**args), device, budget_s, 100)
        t_r = measure(lambda: dispatch.sequential_head(**args, use_kernel=False), device, budget_s, 20)
        esize = torch.tensor([], dtype=dtype).element_size()
        row_tiles = math.ceil(num_req / 16)
        bytes_moved = (num_req * k * vocab * esize + row_tiles * k * vocab * rank * esize
                       + num_req * k * hid * esize + (2 * num_req * k * vocab * 4 if probs else 0))
        flops = 2 * num_req * k * vocab * rank
        shape = f"R={num_req} K={k} V={vocab} r={rank} d={hid} {str(dtype)[6:]}"
        row = _row("sequential_head", name, shape, t_k, t_r, err, bytes_moved, flops)
        row["token_mismatches"] = mismatches
        row["ok"] = row["ok"] and mismatches == 0
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------- admission


def bench_admission(device, dry: bool, budget_s: float) -> list:
    cases = [(8, 4, 10)] if dry else [(128, 8, 512), (512, 8, 2048), (1024, 16, 4096)]
    rows = []
    for num_req, k, budget in cases:
        conf = torch.rand(num_req, k, generator=torch.Generator().manual_seed(0)).to(device)
        out = admission.admission_lengths_triton(conf, budget)
        ref = admission.admission_lengths_reference(conf, budget)
        err = float((out != ref).sum())
        t_k = measure(lambda: admission.admission_lengths_triton(conf, budget), device, budget_s, 200)
        t_r = measure(lambda: admission.admission_lengths_reference(conf, budget), device, budget_s, 200)
        slots = num_req * k
        # Work is slots^2 pairwise comparisons; count them as "flops" to give a rate.
        rows.append(_row("admission", f"budget {budget}", f"R={num_req} K={k}", t_k, t_r, err,
                         conf.numel() * conf.element_size() + num_req * 8, slots * slots))
    return rows


# ------------------------------------------------------------------------------- drafter stage


def bench_drafter_stage(device, dry: bool, budget_s: float) -> list:
    """What a greedy drafting step's sequential stage costs the served drafter, LM head
    included: the committed SmolLM2 drafter's shapes (random weights) with its reduced
    4,096-word vocabulary and widened to the full 49,152 words, each through the PyTorch
    loop (`DSparkDrafter.draft`) and through the fused kernel (what the proposer runs on
    CUDA), whose tokens must equal its reference's."""
    committed = DrafterConfig.from_dir(COMMITTED_DRAFTER)
    if dry:  # tiny shapes; only the sizes the LM head and the heads read
        committed = committed.model_copy(update=dict(hidden_size=32, vocab_size=300, draft_vocab_size=64,
                                                     markov_rank=8, mask_token_id=299))
    dtype = torch.float32 if dry else torch.bfloat16
    k = committed.block_size
    rows = []
    for label, vocab in (("full", None), ("reduced", committed.draft_vocab_size)):
        torch.manual_seed(0)
        drafter = DSparkDrafter(committed.model_copy(update=dict(draft_vocab_size=vocab))).to(device, dtype)
        w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
        conf = drafter.confidence_head.proj
        conf_weight, conf_bias = conf.weight.detach().view(-1), float(conf.bias.detach())
        d2t = drafter.draft_to_target()
        for num_req in ((1, 3) if dry else (1, 16, 64)):
            g = torch.Generator(device="cpu").manual_seed(num_req)
            hidden = torch.randn(num_req, k, committed.hidden_size, generator=g).to(device, dtype)
            anchors = torch.randint(0, committed.vocab_size, (num_req,), generator=g).to(device)
            greedy = torch.zeros(num_req, device=device)
            seeds = torch.zeros(num_req, dtype=torch.int64, device=device)
            conf_temps = drafter.confidence_temperatures(k, hidden).float()

            def fused(use_kernel: bool = True) -> object:  # measured within this iteration only
                return dispatch.sequential_head(drafter.lm_head(hidden), anchors, w1, w2, greedy, seeds,
                                                hidden=hidden, conf_weight=conf_weight, conf_bias=conf_bias,
                                                conf_temps=conf_temps, use_kernel=use_kernel, draft_to_target=d2t)

            with torch.no_grad():  # the kernel's reference widens the heads' weights to float32, as it does
                mismatches = int((fused().tokens != fused(use_kernel=False).tokens).sum())
                loop_ms = measure(lambda: drafter.draft(hidden, anchors), device, budget_s, 100)
                fused_ms = measure(fused, device, budget_s, 100)
            rows.append({"vocabulary": label, "requests": num_req, "K": k, "hidden": committed.hidden_size,
                         "rank": committed.markov_rank, "draft_vocab": drafter.config.draft_vocab,
                         "loop_ms": loop_ms, "fused_ms": fused_ms, "token_mismatches": mismatches,
                         "ok": mismatches == 0})
    return rows


# ------------------------------------------------------------------------------- report


def write_markdown(path: Path, meta: dict, rows: list, stage: list) -> None:
    lines = [f"# Kernel benchmark ({meta['mode']})", ""]
    if meta["mode"] == "dry-run":
        lines += ["**Dry run on CPU through the Triton interpreter: times are not GPU measurements.**", ""]
    lines += [f"device: {meta['device']}; torch {meta['torch']}; triton {meta['triton']}; {meta['date']}", "",
              "| kernel | case | shape | kernel ms | reference ms | SDPA ms | speedup | TB/s | % copy BW "
              "| TFLOP/s | % bf16 peak | max abs err | matches reference |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sdpa = "" if r["sdpa_ms"] is None else f"{r['sdpa_ms']:.3f}"
        lines.append(
            f"| {r['kernel']} | {r['case']} | {r['shape']} | {r['kernel_ms']:.3f} | {r['reference_ms']:.3f} | "
            f"{sdpa} | {r['speedup_vs_reference']:.1f}x | {r['tb_per_s']:.3f} | {100 * r['frac_copy_bw']:.1f} | "
            f"{r['tflop_per_s']:.2f} | {100 * r['frac_bf16_flops']:.2f} | {r['max_abs_err']:.2e} | "
            f"{'yes' if r['ok'] else 'NO'} |")
    lines += ["", "Bytes count each input read once and each output written once (attention: KV context, new "
              "K/V, q, out; head: base logits, W2 once per 16-request tile per step, hidden states, probability "
              "rows written and re-read); the Markov W2 (25 MB at r=256) can stay in the 60 MB L2. Admission's "
              "FLOP column counts pairwise comparisons. SDPA runs on K/V pre-gathered into dense tensors "
              "(gather not timed)."]
    lines += ["", "## Drafter sequential stage, greedy, LM head included",
              "", "The committed SmolLM2 drafter's shapes with random weights, with its reduced draft vocabulary "
              "and widened to the full one: the PyTorch loop (`DSparkDrafter.draft`) against the fused kernel "
              "(what the proposer runs on CUDA), median ms per drafting step.", "",
              "| draft vocabulary | requests | K | d | r | PyTorch loop ms | fused kernel ms | speedup "
              "| kernel tokens = reference tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for r in stage:
        match = "yes" if r["ok"] else f"NO ({r['token_mismatches']} differ)"
        lines.append(f"| {r['vocabulary']} ({r['draft_vocab']}) | {r['requests']} | {r['K']} | {r['hidden']} "
                     f"| {r['rank']} | {r['loop_ms']:.3f} | {r['fused_ms']:.3f} | {r['loop_ms'] / r['fused_ms']:.1f}x "
                     f"| {match} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU through the Triton interpreter")
    parser.add_argument("--budget-s", type=float, default=1.0, help="timing budget per measured function")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.dry_run:
        device = torch.device("cpu")
        budget = 0.0
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device; use --dry-run to check the wiring on CPU")
        device = torch.device("cuda")
        budget = args.budget_s
    meta = {
        "mode": "dry-run" if args.dry_run else "cuda",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"cpu ({platform.processor() or 'x86'})",
        "torch": torch.__version__, "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "ceilings": {"copy_bytes_per_s": H200_COPY_BYTES_PER_S, "bf16_flop_per_s": H200_BF16_FLOP_PER_S},
    }
    t0 = time.perf_counter()
    rows = []
    for bench in (bench_attention, bench_sequential_head, bench_admission):
        rows += bench(device, args.dry_run, budget)
        print(f"{bench.__name__}: done at {time.perf_counter() - t0:.1f}s", flush=True)
    stage = bench_drafter_stage(device, args.dry_run, budget)
    meta["wall_s"] = time.perf_counter() - t0
    stem = "bench_kernels.dryrun" if args.dry_run else "bench_kernels"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"meta": meta, "results": rows, "drafter_stage": stage}, indent=2) + "\n")
    write_markdown(args.out_dir / f"{stem}.md", meta, rows, stage)
    print((args.out_dir / f"{stem}.md").read_text())
    failed = [f"{r['kernel']} / {r['case']}" for r in rows if not r["ok"]]
    failed += [f"drafter stage, {r['vocabulary']} vocabulary, R={r['requests']}" for r in stage if not r["ok"]]
    if failed:
        print("kernel differs from reference beyond tolerance:", "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
