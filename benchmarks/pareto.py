"""The benchmark engineers run: vLLM's own `bench sweep serve` over serving configurations
x max concurrency, then `bench sweep plot_pareto`, then a Markdown summary.

    python benchmarks/pareto.py                                           # everything, committed drafter
    python benchmarks/pareto.py --prompts code --concurrency 1 4 16 --only no-spec "fixed-k1 (MTP-1-like)" dspark

Each configuration gets its own `vllm-dspark serve` (vLLM's server; started and stopped
by vLLM's sweep), each max concurrency one `vllm-dspark bench serve` run on a dataset of
eval prompts (`custom` format, the chat template applied by the client, output lengths
drawn from SmolLM2's own response lengths for that domain in the committed corpus, greedy,
`--ignore-eos`). Results stay as vLLM writes them, under
`benchmarks/results/bench_serve/<experiment>/`, plus vLLM's Pareto plot (tokens/s per user
against output tokens/s) and `summary.md`: per-user speed at matched load against fixed
k=1 (the MTP-1 analogue: our drafter verifying one token per step) and against no
speculation, acceptance length from vLLM's "Speculative Decoding" section, TTFT and TPOT,
and what the controller decided in each run (from the plugin's `/metrics`, stored beside
each result as `plugin_metrics-run=N.json` by the sweep's after-bench hook): the share of
steps that drafted, drafts verified per request and step, the learned step-time model.
The configurations are serve_frontier.py's (one home); prefix caching is off for the
reason given there.
"""

from __future__ import annotations

import argparse
import json
import lzma
import random
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_frontier import PROMPT_SETS, configurations  # noqa: E402

RESULTS = REPO / "benchmarks" / "results" / "bench_serve"
CORPUS = REPO / "examples" / "drafters" / "corpus" / "smollm2-generated.jsonl.xz"
# Which corpus domain gives each prompt set its output lengths.
LENGTH_DOMAIN = {"code": "code", "chat": "chat", "mixed": None}
ROWS = ["no-spec", "ngram-k3", "fixed-k1 (MTP-1-like)", "fixed-k3", "fixed-k7", "dspark", "dspark_async",
        "sla, 8 tok/s floor", "sla, 16 tok/s floor", "dspark + n-gram"]
BASELINE, MTP1 = "no-spec", "fixed-k1 (MTP-1-like)"
# Beside each `run=N.json`: the server's plugin counters right after that run.
PLUGIN_METRICS_PREFIX = "plugin_metrics-"


def write_dataset(prompt_set: str, out: Path, max_output: int, seed: int = 0) -> Path:
    """Eval prompts as a `custom` dataset; output lengths sampled from the corpus."""
    from vllm_dspark.evaluation.dataset import default_eval_dir

    domain = LENGTH_DOMAIN[prompt_set]
    with lzma.open(CORPUS, "rt") as handle:
        lengths = [r["response_tokens"] for r in map(json.loads, handle) if domain in (None, r["domain"])]
    rng = random.Random(seed)
    rows = []
    for name in PROMPT_SETS[prompt_set]:
        for line in (default_eval_dir() / name).read_text().splitlines():
            rows.append({"prompt": json.loads(line)["turns"][0], "output_tokens": min(max_output, rng.choice(lengths))})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def serve_params(names: list[str], drafter: str, reduced: str | None, k: int) -> dict[str, dict]:
    """`vllm serve` overrides per configuration, JSON values passed as strings."""
    available = configurations(reduced or drafter, k)
    missing = [n for n in names if n not in available]
    if missing:
        raise SystemExit(f"unknown configurations {missing}; known: {sorted(available)}")
    return {name: {key: json.dumps(value) for key, value in available[name].items()} for name in names}


def configuration_of(run: dict, params: dict[str, dict]) -> str | None:
    """The configuration a result belongs to: vLLM's sweep stores the serve overrides in
    each result (the bench overrides' name replaces the serve one's)."""
    for name, overrides in params.items():
        if all(run.get(key) == value for key, value in overrides.items()) and (
            overrides or "speculative_config" not in run
        ):
            return name
    return None


def snapshot_plugin_metrics(port: int, experiment: Path) -> Path:
    """The sweep's after-bench hook: the server's cumulative plugin metrics (`/metrics`),
    stored beside the result vLLM has just written (the newest run file), so that the
    summary can say what the controller decided during each run."""
    newest = max(experiment.glob("*/run=*.json"), key=lambda path: path.stat().st_mtime)
    with urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(("vllm_dspark_", "process_start_time_seconds")):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    out = newest.with_name(PLUGIN_METRICS_PREFIX + newest.name)
    out.write_text(json.dumps(values, indent=1) + "\n")
    return out


def _metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include `labels`."""
    total = 0.0
    for key, value in values.items():
        metric, _, rest = key.partition("{")
        if metric == name and all(f'{label}="{v}"' in rest for label, v in labels.items()):
            total += value
    return total


def controller_columns(snapshots: list[tuple[int, dict[str, float]]]) -> dict[int, tuple[str, str, str]]:
    """Per max concurrency of one configuration: the share of steps that drafted, drafts
    verified per request and step, and the learned step-time model at the end of the run.
    Counters are cumulative per server, so each run is the difference from the snapshot of
    the run before it on the same server (same process start)."""
    columns, previous = {}, {}
    for users, values in sorted(snapshots, key=lambda item: item[0]):
        if not any(key.startswith("vllm_dspark_") for key in values):
            continue
        base = previous if previous.get("process_start_time_seconds") == values.get("process_start_time_seconds") else {}

        def delta(name: str, **labels: str) -> float:
            return _metric(values, name, **labels) - _metric(base, name, **labels)

        steps = delta("vllm_dspark_draft_depth_steps_total")
        drafting = 1.0 - delta("vllm_dspark_draft_depth_steps_total", depth="0") / steps if steps else float("nan")
        requests = delta("vllm_dspark_verification_budget_count")
        verified = delta("vllm_dspark_verification_budget_sum") / requests if requests else float("nan")
        scale = _metric(values, "vllm_dspark_step_time_scale")
        offset_ms = 1000.0 * _metric(values, "vllm_dspark_step_overhead_seconds")
        columns[users] = (f"{100 * drafting:.0f}%", f"{verified:.2f}", f"{scale:.2f}x {offset_ms:+.0f} ms")
        previous = values
    return columns


def summarize(experiment: Path, params: dict[str, dict]) -> str:
    """Markdown table from the sweep's result files (and the plugin metrics beside them)."""
    runs: dict[str, dict[int, list[dict]]] = {}
    snapshots: dict[str, list[tuple[int, dict[str, float]]]] = {}
    for path in sorted(experiment.glob("*/run=*.json")):
        data = json.loads(path.read_text())
        name = configuration_of(data, params)
        if name is not None:
            users = int(data["max_concurrency"])
            runs.setdefault(name, {}).setdefault(users, []).append(data)
            metrics = path.with_name(PLUGIN_METRICS_PREFIX + path.name)
            if metrics.exists():
                snapshots.setdefault(name, []).append((users, json.loads(metrics.read_text())))

    def median(name: str, users: int, key: str) -> float:
        values = [r[key] for r in runs.get(name, {}).get(users, []) if r.get(key) is not None]
        return statistics.median(values) if values else float("nan")

    lines = ["| configuration | users | output tok/s | tok/s per user | vs fixed k=1 | vs no-spec | acceptance length "
             "| median TTFT ms | median TPOT ms | steps drafting | verified per request-step | steps vs profile |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, by_users in runs.items():
        controller = controller_columns(snapshots.get(name, []))
        for users in sorted(by_users):
            throughput = median(name, users, "output_throughput")
            per_user = throughput / users
            ratios = [per_user / (median(base, users, "output_throughput") / users) for base in (MTP1, BASELINE)]
            accept = median(name, users, "spec_decode_acceptance_length")
            lines.append(f"| {name} | {users} | {throughput:.1f} | {per_user:.2f} | {ratios[0]:.2f}x | {ratios[1]:.2f}x "
                         f"| {accept:.2f} | {median(name, users, 'median_ttft_ms'):.0f} | {median(name, users, 'median_tpot_ms'):.1f} | "
                         + " | ".join(controller.get(users, ("-", "-", "-"))) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="default: the converted SmolLM2 checkpoint")
    parser.add_argument("--drafter", default=str(REPO / "examples" / "drafters" / "smollm2-dspark-b7"))
    parser.add_argument("--reduced-drafter", default=None, help="serve this (reduced-vocabulary) drafter instead")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="mixed")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompts-per-user", type=int, default=4, help="requests per run = this x concurrency (>= 8)")
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--num-runs", type=int, default=1)
    parser.add_argument("--only", nargs="+", default=None, help="configurations (default: all of ROWS)")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--experiment", default=None, help="default: the prompt set")
    parser.add_argument("--snapshot-metrics", action="store_true",
                        help="(the sweep's after-bench hook) store the server's plugin metrics beside its newest run")
    args = parser.parse_args()
    experiment = args.experiment or args.prompts
    if args.snapshot_metrics:
        print(f"plugin metrics: {snapshot_plugin_metrics(args.port, RESULTS / experiment)}")
        return 0

    from vllm_dspark.targets.smollm2 import smollm2_checkpoint

    target = args.target or str(smollm2_checkpoint())
    dataset = write_dataset(args.prompts, RESULTS / experiment / "dataset.jsonl", args.max_output)
    params_dir = RESULTS / experiment
    swept = serve_params(args.only or ROWS, args.drafter, args.reduced_drafter, args.k)
    (params_dir / "serve_params.json").write_text(json.dumps(swept, indent=2) + "\n")
    (params_dir / "bench_params.json").write_text(json.dumps(
        [{"_benchmark_name": f"users-{c}", "max_concurrency": c, "num_prompts": max(8, args.prompts_per_user * c)}
         for c in args.concurrency], indent=2) + "\n")
    cli = f"{sys.executable} -m vllm_dspark.cli"
    serve = (f"{cli} serve {target} --port {args.port} --dtype float32 --max-model-len 2048 --enforce-eager "
             f"--no-enable-prefix-caching --max-num-seqs {max(args.concurrency)}")
    bench = (f"{cli} bench serve --backend vllm --model {target} --port {args.port} --dataset-name custom "
             f"--dataset-path {dataset} --temperature 0 --ignore-eos --seed 0")
    subprocess.run([sys.executable, "-m", "vllm_dspark.cli", "bench", "sweep", "serve", "--serve-cmd", serve,
                    "--bench-cmd", bench, "--serve-params", str(params_dir / "serve_params.json"),
                    "--bench-params", str(params_dir / "bench_params.json"), "--after-bench-cmd",
                    f"{sys.executable} {Path(__file__).resolve()} --snapshot-metrics --port {args.port} --experiment {experiment}",
                    "--num-runs", str(args.num_runs), "-o", str(RESULTS), "-e", experiment, "--resume",
                    "--server-ready-timeout", "600"], check=True)
    subprocess.run([sys.executable, "-m", "vllm_dspark.cli", "bench", "sweep", "plot_pareto", str(RESULTS / experiment),
                    "--user-count-var", "max_concurrency"], check=False)
    # Every configuration, not only those swept now: the summary covers earlier runs too.
    table = summarize(RESULTS / experiment, serve_params(ROWS, args.drafter, args.reduced_drafter, args.k))
    (RESULTS / experiment / "summary.md").write_text(
        f"# `vllm bench serve` sweep: {args.prompts} prompts\n\nTarget {target}, drafter "
        f"{args.reduced_drafter or args.drafter}, K = {args.k}; medians over {args.num_runs} run(s).\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
