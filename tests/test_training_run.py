"""extract-features, train (single process, resumed, torchrun, data-parallel exactness, device
choice), calibrate and their bad inputs, end to end on the tiny random target."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

from tests.tiny_models import TINY_VOCAB, make_drafter
from vllm_dspark.cli import main
from vllm_dspark.model.drafter import DSparkDrafter
from vllm_dspark.model.target_features import capture_target_states
from vllm_dspark.training import train as train_module
from vllm_dspark.training.blocks import BlockBatch, DrafterLoss
from vllm_dspark.training import distributed
from vllm_dspark.training.distributed import DeviceError, cpu_has_bf16_matmul, select_device, uses_bf16
from vllm_dspark.training.features import FeatureStore, OnTheFlyFeatures, heldout_score, read_index
from vllm_dspark.training.soft_labels import DEFAULT_TOPK

DRAFTER = ["--num-layers", "1", "--block-size", "4", "--markov-rank", "16"]
HELDOUT_FRAC = 0.25
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def write_records(path: Path, records: list[tuple[list[int], list[int]]]) -> Path:
    with open(path, "w") as f:
        for i, (prompt, response) in enumerate(records):
            f.write(json.dumps({"id": f"rec-{i}", "prompt_token_ids": prompt, "response_token_ids": response}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_data(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Responses sampled from the tiny target itself, as generate-data would produce."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(tiny_target)).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, TINY_VOCAB, (24, 6), generator=generator)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=36, do_sample=True, pad_token_id=0, eos_token_id=None)
    records = [(p.tolist(), o[6:].tolist()) for p, o in zip(prompts, out)]
    return write_records(tmp_path_factory.mktemp("data") / "train.jsonl", records)


@pytest.fixture(scope="module")
def features(tiny_target: Path, tiny_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("features")
    argv = ["extract-features", "--target", str(tiny_target), "--data", str(tiny_data), "--out", str(root / "train"),
            "--heldout-out", str(root / "heldout"), "--heldout-frac", str(HELDOUT_FRAC), "--shard-tokens", "300"]
    assert main(argv) == 0
    return root / "train", root / "heldout"


def train_argv(target: Path, features: Path, out: Path, *extra: str) -> list[str]:
    """CPU unless `extra` says otherwise: the exactness checks need its fp32 determinism."""
    return ["train", "--target", str(target), "--features", str(features), "--out", str(out),
            "--batch-seqs", "4", "--anchors-per-seq", "8", "--lr", "3e-3", "--seed", "0", "--device", "cpu", *extra]


def read_log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- features
def test_features_split_shards_and_values(tiny_target: Path, tiny_data: Path, features: tuple[Path, Path]) -> None:
    train_dir, heldout_dir = features
    ids = [json.loads(line)["id"] for line in tiny_data.read_text().splitlines()]
    train_ids = {e["id"] for e in read_index(train_dir)}
    heldout_ids = {e["id"] for e in read_index(heldout_dir)}
    assert heldout_ids == {i for i in ids if heldout_score(i) < HELDOUT_FRAC}
    assert train_ids == set(ids) - heldout_ids
    assert len(list(train_dir.glob("shard-*.safetensors"))) > 1  # bounded shards
    store = FeatureStore(train_dir)
    assert store.layer_ids == [0, 1, 2, 3]
    seq = store.get(0)
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(str(tiny_target)).eval()
    context, _ = capture_target_states(target, seq.input_ids.unsqueeze(0), store.layer_ids)
    # Stored in bf16: about 3 significant digits; probabilities in fp16.
    assert torch.allclose(seq.context, context[0], rtol=2e-2, atol=2e-2)
    with torch.no_grad():
        probs = torch.softmax(target(seq.input_ids.unsqueeze(0)).logits[0], -1)
    assert seq.soft_labels.k == DEFAULT_TOPK
    assert torch.allclose(seq.soft_labels.probs, probs.gather(-1, seq.soft_labels.ids), rtol=2e-3, atol=1e-4)
    assert torch.allclose(seq.soft_labels.probs, probs.topk(DEFAULT_TOPK, -1).values, rtol=2e-3, atol=1e-4)
    assert seq.loss_mask.sum() == len(seq.input_ids) - 6


def test_extract_resumes_without_redoing(tiny_target: Path, tiny_data: Path, features: tuple[Path, Path], capsys) -> None:
    train_dir, heldout_dir = features
    before = (train_dir / "index.jsonl").read_text()
    argv = ["extract-features", "--target", str(tiny_target), "--data", str(tiny_data), "--out", str(train_dir),
            "--heldout-out", str(heldout_dir), "--heldout-frac", str(HELDOUT_FRAC), "--shard-tokens", "300"]
    assert main(argv) == 0
    assert "0 new sequences" in capsys.readouterr().out
    assert (train_dir / "index.jsonl").read_text() == before


@pytest.mark.skipif(not cpu_has_bf16_matmul(), reason="no native bf16 on this CPU")
def test_extract_in_bf16_matches_fp32_and_is_kept_apart(tiny_target: Path, tiny_data: Path, features: tuple[Path, Path],
                                                        tmp_path: Path, capsys) -> None:
    """bf16 autocast changes the states by bf16 rounding only, and is recorded in the meta,
    so such features never mix into an fp32 directory."""
    base = ["extract-features", "--target", str(tiny_target), "--data", str(tiny_data), "--precision", "bf16"]
    code, err = run_cli([*base, "--out", str(features[0])], capsys)
    assert code == 1 and "target_precision" in err
    assert main([*base, "--out", str(tmp_path / "bf16")]) == 0
    fp32, bf16 = FeatureStore(features[0]), FeatureStore(tmp_path / "bf16")
    assert (fp32.meta["target_precision"], bf16.meta["target_precision"]) == ("fp32", "bf16")
    first = next(i for i, e in enumerate(bf16.entries) if e["id"] == fp32.entries[0]["id"])
    a, b = fp32.get(0), bf16.get(first)
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.allclose(a.context, b.context, rtol=5e-2, atol=5e-2) and not torch.equal(a.context, b.context)
    assert (a.soft_labels.probs - b.soft_labels.probs).abs().max() < 5e-2


# ---------------------------------------------------------------- training
@pytest.mark.parametrize("device, precision", [
    ("cpu", "auto"),
    pytest.param("cpu", "bf16", marks=pytest.mark.skipif(not cpu_has_bf16_matmul(), reason="no native bf16 on this CPU")),
    pytest.param("cuda", "auto", marks=needs_cuda),
])
def test_short_training_lowers_loss(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path, device: str,
                                    precision: str, capsys) -> None:
    out = tmp_path / "drafter"
    argv = train_argv(tiny_target, features[0], out, *DRAFTER, "--steps", "40", "--save-every", "0",
                      "--save-dtype", "bfloat16", "--device", device, "--precision", precision)
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.split("train: ", 1)[1])
    assert summary["device"] == device
    assert summary["precision"] == ("fp32" if (device, precision) == ("cpu", "auto") else "bf16")
    log = read_log(out)
    assert len(log) == 40
    first = sum(r["total"] for r in log[:5]) / 5
    last = sum(r["total"] for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert sum(r["tv"] for r in log[-5:]) < sum(r["tv"] for r in log[:5])
    stored = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in stored and "embed_tokens.weight" not in stored  # shared with the target
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    drafter = DSparkDrafter.from_pretrained(out, tiny_target)
    assert drafter.fc.weight.dtype == torch.float32 and drafter.config.torch_dtype == "bfloat16"
    assert torch.equal(drafter.fc.weight, stored["fc.weight"].float())


def test_reduced_vocabulary_drafter_trains(tiny_target: Path, tiny_data: Path, features: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    """init-drafter --draft-vocab-size picks the subset from the target's generations; that
    drafter trains with finite losses (targets outside the subset have no CE term) and
    keeps its subset; the CE it can still learn falls."""
    reduced, out = tmp_path / "reduced", tmp_path / "trained"
    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(reduced), "--num-layers", "1",
                 "--block-size", "4", "--markov-rank", "16", "--draft-vocab-size", "64", "--corpus", str(tiny_data)]) == 0
    assert "of held-out target tokens inside the draft vocabulary" in capsys.readouterr().out
    assert main(train_argv(tiny_target, features[0], out, "--init", str(reduced), "--steps", "20", "--save-every", "0")) == 0
    log = read_log(out)
    assert all(math.isfinite(r["total"]) for r in log)
    assert sum(r["ce"] for r in log[-5:]) < sum(r["ce"] for r in log[:5])
    trained = DSparkDrafter.from_pretrained(out, tiny_target)
    assert trained.config.draft_vocab == 64
    assert torch.equal(trained.draft_to_target(), DSparkDrafter.from_pretrained(reduced, tiny_target).draft_to_target())


def test_warm_start_copies_the_targets_top_layers(tiny_target: Path, tmp_path: Path) -> None:
    """init-drafter --layers-from-target: the two draft layers are the tiny target's layers 2
    and 3 (its top two), and fc passes the deepest captured layer's features through."""
    out = tmp_path / "warm"
    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(out), "--num-layers", "2",
                 "--block-size", "4", "--markov-rank", "16", "--layers-from-target"]) == 0
    drafter = DSparkDrafter.from_pretrained(out, tiny_target)
    target = load_file(str(tiny_target / "model.safetensors"))
    for i, src in enumerate((2, 3)):
        for name in ("self_attn.q_proj.weight", "self_attn.v_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(drafter.layers[i].get_parameter(name), target[f"model.layers.{src}.{name}"]), (i, name)
    d = drafter.config.hidden_size
    states = torch.randn(3, d * len(drafter.config.target_layer_ids))
    assert torch.allclose(drafter.fc(states), states[:, -d:])
    random = tmp_path / "random"
    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(random), "--num-layers", "2",
                 "--block-size", "4", "--markov-rank", "16"]) == 0
    cold = DSparkDrafter.from_pretrained(random, tiny_target)
    assert not torch.equal(cold.layers[0].self_attn.q_proj.weight, drafter.layers[0].self_attn.q_proj.weight)


def test_resume_continues_exactly(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path, monkeypatch) -> None:
    common = [*DRAFTER, "--steps", "6", "--save-every", "3", "--heldout", str(features[1])]
    assert main(train_argv(tiny_target, features[0], tmp_path / "straight", *common)) == 0

    calls = {"n": 0}
    real_pack = train_module.pack_batch

    def crash_at_step_5(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # killed after the step-3 checkpoint
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(train_module, "pack_batch", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        main(train_argv(tiny_target, features[0], tmp_path / "resumed", *common))
    monkeypatch.setattr(train_module, "pack_batch", real_pack)
    assert main(train_argv(tiny_target, features[0], tmp_path / "resumed", "--steps", "6", "--save-every", "3",
                           "--heldout", str(features[1]), "--resume")) == 0
    assert [r["step"] for r in read_log(tmp_path / "resumed")] == [1, 2, 3, 4, 5, 6]
    heldout = [(tmp_path / run / "heldout_log.jsonl").read_text() for run in ("straight", "resumed")]
    assert heldout[0] == heldout[1] and [json.loads(r)["step"] for r in heldout[0].splitlines()] == [3, 6]
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # One schedule over two sessions: --stop-at 3 writes no drafter, --resume finishes it.
    sliced = tmp_path / "sliced"
    assert main(train_argv(tiny_target, features[0], sliced, *common, "--stop-at", "3")) == 0
    assert not (sliced / "model.safetensors").exists() and (sliced / "checkpoint").is_dir()
    assert main(train_argv(tiny_target, features[0], sliced, "--steps", "6", "--save-every", "3",
                           "--heldout", str(features[1]), "--resume")) == 0
    c = load_file(str(sliced / "model.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)
    assert (sliced / "heldout_log.jsonl").read_text() == heldout[0]


def test_kept_drafter_is_the_best_heldout_checkpoint(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path,
                                                     monkeypatch, capsys) -> None:
    """Held-out accepted lengths 1.5, 2.0, 1.7 at steps 2, 4, 6: the drafter written is step
    4's, not the last one, and the summary says so."""
    taus = iter([1.5, 2.0, 1.7])
    real = train_module.heldout_survival

    def scripted(*args, **kwargs):
        return {**real(*args, **kwargs), "tau": next(taus)}

    monkeypatch.setattr(train_module, "heldout_survival", scripted)
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(train_argv(tiny_target, features[0], out, *DRAFTER, "--steps", "6", "--save-every", "2",
                           "--heldout", str(features[1]))) == 0
    summary = json.loads(capsys.readouterr().out.split("train: ", 1)[1])
    assert summary["kept_step"] == 4 and summary["heldout"]["tau"] == 2.0
    rows = [json.loads(line) for line in (out / "heldout_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4, 6] and all(len(r["survival"]) == 4 for r in rows)
    assert all(1.0 >= a >= b >= 0.0 for r in rows for a, b in zip(r["survival"], r["survival"][1:]))
    kept, best, last = (load_file(str(d / "model.safetensors")) for d in (out, out / "best", out / "checkpoint"))
    assert all(torch.equal(kept[k], best[k]) for k in kept)
    assert not all(torch.equal(kept[k], last[k]) for k in kept)


def test_on_the_fly_features(tiny_target: Path, tiny_data: Path, features: tuple[Path, Path], tmp_path: Path) -> None:
    argv = ["train", "--target", str(tiny_target), "--data", str(tiny_data), "--out", str(tmp_path / "d"),
            *DRAFTER, "--steps", "2", "--batch-seqs", "2", "--anchors-per-seq", "4", "--heldout-frac", str(HELDOUT_FRAC)]
    assert main(argv) == 0
    assert len(read_log(tmp_path / "d")) == 2
    live = OnTheFlyFeatures(tiny_target, tiny_data, [0, 1, 2, 3], 2048, HELDOUT_FRAC)
    cached = FeatureStore(features[0])
    assert sorted(live.lengths()) == sorted(cached.lengths())  # the same training split


def test_torchrun_two_processes_keep_identical_weights(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "vllm_dspark.cli", *train_argv(tiny_target, features[0], out, *DRAFTER, "--steps", "4", "--save-every", "2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    digests = re.findall(r"rank (\d)/2: weights digest ([0-9a-f]{16})", proc.stderr)
    by_rank = {rank: [d for r, d in digests if r == rank] for rank in ("0", "1")}
    assert all(len(d) == 2 for d in by_rank.values()), digests  # checked at both checkpoints
    assert by_rank["0"] == by_rank["1"], digests
    assert len(read_log(out)) == 4 and all(r["anchors"] == 2 * 4 * 8 for r in read_log(out))


def _ddp_rank_step(rank: int, drafter_dir: Path, target: Path, batches: Path, out: Path) -> None:
    """One DDP forward/backward of rank `rank` on its own batch (gloo, 2 ranks)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out / 'rendezvous'}", rank=rank, world_size=2)
    try:
        drafter = DSparkDrafter.from_pretrained(drafter_dir, target)
        model = DistributedDataParallel(DrafterLoss(drafter))
        batch = BlockBatch(**torch.load(batches / f"rank{rank}.pt"))
        losses = model(batch)
        losses["total"].backward()
        _, row = train_module.step_stats(batch.num_blocks, losses, 2)
        grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
        torch.save({"row": row, "grads": grads}, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def random_batch(config, generator: torch.Generator, anchor_weights: list[list[float]], length: int = 16) -> BlockBatch:
    """Random features for len(anchor_weights) sequences; weight 0 marks a padding anchor."""
    b, a = len(anchor_weights), len(anchor_weights[0])
    k, d = config.block_size, config.hidden_size
    anchors = torch.stack([torch.randperm(length - k, generator=generator)[:a].sort().values for _ in range(b)])
    return BlockBatch(
        input_ids=torch.randint(0, TINY_VOCAB, (b, length), generator=generator),
        context=torch.randn(b, length, len(config.target_layer_ids) * d, generator=generator),
        topk_ids=torch.randint(0, TINY_VOCAB, (b, length, 8), generator=generator),
        topk_probs=torch.full((b, length, 8), 0.1),
        anchors=anchors,
        anchor_weights=torch.tensor(anchor_weights),
    )


def concat(*batches: BlockBatch) -> BlockBatch:
    return BlockBatch(**{f.name: torch.cat([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(BlockBatch)})


def test_data_parallel_step_equals_one_process_on_the_union(tiny_target: Path, tmp_path: Path) -> None:
    """Two gloo ranks with 2 and 7 real blocks take exactly the step (gradient and logged
    losses) of one process on both batches: the denominators are summed across ranks."""
    drafter_dir = make_drafter(tiny_target, tmp_path / "drafter")
    drafter = DSparkDrafter.from_pretrained(drafter_dir, tiny_target)
    generator = torch.Generator().manual_seed(0)
    rank_batches = [
        random_batch(drafter.config, generator, [[1, 0, 0, 0], [1, 0, 0, 0]]),
        random_batch(drafter.config, generator, [[1, 1, 1, 1], [1, 1, 1, 0]]),
    ]
    for rank, batch in enumerate(rank_batches):
        torch.save(dataclasses.asdict(batch), tmp_path / f"rank{rank}.pt")
    torch.multiprocessing.spawn(_ddp_rank_step, args=(drafter_dir, tiny_target, tmp_path, tmp_path), nprocs=2)

    union = DrafterLoss(drafter)(concat(*rank_batches))
    union["total"].backward()
    expected = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    _, expected_row = train_module.step_stats(concat(*rank_batches).num_blocks, union, 1)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["grads"].keys() == expected.keys()
        for name, grad in expected.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
        assert result["row"] == pytest.approx(expected_row, rel=1e-5)
    # The check has teeth: averaging the two ranks' own means gives another loss.
    with torch.no_grad():
        per_rank = [DrafterLoss(drafter)(b)["total"].item() for b in rank_batches]
    assert abs(sum(per_rank) / 2 - union["total"].item()) > 1e-3


def test_device_selection(monkeypatch) -> None:
    """auto falls back to the CPU unless every local rank has a GPU; cuda without one
    fails with a message that says so. GPUs are faked: only the choice is tested."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select_device("auto") == torch.device("cpu") and select_device("cpu") == torch.device("cpu")
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        select_device("cuda")
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert select_device("auto") == torch.device("cpu")  # two ranks, one GPU
    with pytest.raises(DeviceError, match="2 ranks on this node but 1 visible"):
        select_device("cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("auto") == torch.device("cuda", 1) and chosen == [1]
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not uses_bf16(cpu, "auto") and uses_bf16(cuda, "auto") and not uses_bf16(cuda, "fp32")
    monkeypatch.setattr(distributed, "cpu_has_bf16_matmul", lambda: False)
    with pytest.raises(DeviceError, match="no native bf16 products"):
        uses_bf16(cpu, "bf16")
    monkeypatch.setattr(distributed, "cpu_has_bf16_matmul", lambda: True)
    assert uses_bf16(cpu, "bf16")


# ---------------------------------------------------------------- calibration
def test_calibrate_writes_temperatures_and_diagram(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    drafter = tmp_path / "drafter"
    assert main(train_argv(tiny_target, features[0], drafter, *DRAFTER, "--steps", "10", "--save-every", "0")) == 0
    out, png = tmp_path / "calibrated", tmp_path / "reliability.png"
    argv = ["calibrate", "--target", str(tiny_target), "--drafter", str(drafter), "--features", str(features[1]),
            "--out", str(out), "--png", str(png)]
    assert main(argv) == 0
    assert "ECE before" in capsys.readouterr().out
    report = json.loads((out / "calibration.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert config["confidence_temperatures"] == report["temperatures"] and len(report["temperatures"]) == 4
    assert report["ece_after"][0] <= report["ece_before"][0] + 1e-9
    assert sum(report["ece_after"]) <= sum(report["ece_before"]) + 1e-9
    assert png.stat().st_size > 10_000
    loaded = DSparkDrafter.from_pretrained(out, tiny_target)
    assert loaded.config.confidence_temperatures == report["temperatures"]


# ---------------------------------------------------------------- bad inputs
def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def test_extract_bad_inputs(tiny_target: Path, tmp_path: Path, capsys) -> None:
    base = ["extract-features", "--target", str(tiny_target), "--out", str(tmp_path / "f")]
    code, err = run_cli([*base, "--data", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 1 and "training data not found" in err
    (tmp_path / "empty.jsonl").write_text("")
    code, err = run_cli([*base, "--data", str(tmp_path / "empty.jsonl")], capsys)
    assert code == 1 and "no usable records" in err
    foreign = write_records(tmp_path / "foreign.jsonl", [([1, 2, 3], [40000, 5, 6])])
    code, err = run_cli([*base[:-1], str(tmp_path / "g"), "--data", str(foreign)], capsys)
    assert code == 1 and "different model" in err
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n')
    code, err = run_cli([*base[:-1], str(tmp_path / "h"), "--data", str(tmp_path / "bad.jsonl")], capsys)
    assert code == 1 and "bad.jsonl:1" in err
    code, err = run_cli(["extract-features", "--target", str(tmp_path / "nowhere"), "--data", str(foreign),
                         "--out", str(tmp_path / "i")], capsys)
    assert code == 1 and "target config not found" in err
    with pytest.raises(SystemExit) as exc:
        main([*base, "--data", str(foreign), "--no-such-option"])
    assert exc.value.code == 2


def test_extract_refuses_mixing_into_other_features(tiny_target: Path, tiny_data: Path, features: tuple[Path, Path], capsys) -> None:
    argv = ["extract-features", "--target", str(tiny_target), "--data", str(tiny_data), "--out", str(features[0]),
            "--layers", "1", "2"]
    code, err = run_cli(argv, capsys)
    assert code == 1 and "already holds features made differently" in err


def other_target(tiny_target: Path, tmp_path: Path, hidden_size: int | None = None) -> Path:
    """A copy of the tiny target with another tokenizer, or a new one of another width."""
    if hidden_size is None:
        target = tmp_path / "other_tokenizer"
        shutil.copytree(tiny_target, target)
        (target / "tokenizer.json").write_text('{"model": "not the same"}')
        return target
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=hidden_size, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
    target = tmp_path / "other_width"
    LlamaForCausalLM(config).save_pretrained(target)
    return target


def test_train_bad_inputs(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    steps = ["--steps", "1"]
    code, err = run_cli(train_argv(tiny_target, tmp_path / "nothing", out, *steps), capsys)
    assert code == 1 and "no features in" in err
    for target, what in ((other_target(tiny_target, tmp_path), "tokenizer_sha256"),
                         (other_target(tiny_target, tmp_path, hidden_size=64), "hidden_size 64")):
        code, err = run_cli(train_argv(target, features[0], out, *steps), capsys)
        assert code == 1 and "different target or tokenizer" in err and what in err, err
    init = make_drafter(tiny_target, tmp_path / "init", target_layer_ids=[1, 3])
    code, err = run_cli(train_argv(tiny_target, features[0], out, "--init", str(init), *steps), capsys)
    assert code == 1 and "target_layer_ids [1, 3]" in err
    code, err = run_cli(train_argv(tiny_target, features[0], out, "--init", str(init), "--num-layers", "2", *steps), capsys)
    assert code == 2 and "either --init or drafter options" in err
    code, err = run_cli(train_argv(tiny_target, features[0], out, "--resume", *steps), capsys)
    assert code == 1 and "no checkpoint" in err
    with pytest.raises(SystemExit) as exc:
        main(train_argv(tiny_target, features[0], out, "--markov-head-type", "lstm", *steps))
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(train_argv(tiny_target, features[0], out, "--bogus", *steps))
    assert exc.value.code == 2
    code, err = run_cli(train_argv(tiny_target, features[0], out, "--block-size", "60", *steps), capsys)
    assert code == 1 and "block_size=60" in err
    if not torch.cuda.is_available():
        code, err = run_cli(train_argv(tiny_target, features[0], out, "--device", "cuda", *steps), capsys)
        assert code == 1 and "--device cuda: no CUDA device is visible" in err


def test_calibrate_bad_inputs(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path, capsys) -> None:
    base = ["calibrate", "--target", str(tiny_target), "--features", str(features[1]), "--out", str(tmp_path / "o")]
    code, err = run_cli([*base, "--drafter", str(tmp_path / "missing")], capsys)
    assert code == 1 and "drafter config not found" in err
    drafter = DSparkDrafter.from_pretrained(make_drafter(tiny_target, tmp_path / "d"), tiny_target)
    drafter.config.enable_confidence_head = False
    drafter.confidence_head = None
    no_conf = tmp_path / "noconf"
    drafter.save_pretrained(no_conf)
    code, err = run_cli([*base, "--drafter", str(no_conf)], capsys)
    assert code == 1 and "no confidence head" in err


def test_feature_union_reads_directories_as_one(tiny_target: Path, features: tuple[Path, Path], tmp_path: Path,
                                                capsys) -> None:
    """Several --features directories: their sequences in order, refused when their
    settings disagree, and training reads them as one set."""
    from vllm_dspark.training.features import FeatureError, FeatureUnion, open_features

    train_dir, heldout_dir = features
    union = open_features([train_dir, heldout_dir])
    first, second = FeatureStore(train_dir), FeatureStore(heldout_dir)
    assert isinstance(union, FeatureUnion) and len(union) == len(first) + len(second)
    assert union.lengths() == first.lengths() + second.lengths()
    assert torch.equal(union.get(len(first)).context, second.get(0).context)
    assert torch.equal(union.get(len(first) - 1).input_ids, first.get(len(first) - 1).input_ids)
    with pytest.raises(IndexError):
        union.get(len(union))
    assert isinstance(open_features([train_dir]), FeatureStore)

    other = tmp_path / "other"
    shutil.copytree(heldout_dir, other)
    meta = json.loads((other / "meta.json").read_text())
    meta["soft_label_topk"] += 1
    (other / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(FeatureError, match="soft_label_topk"):
        open_features([train_dir, other])

    out = tmp_path / "run"
    argv = train_argv(tiny_target, train_dir, out, "--steps", "2", *DRAFTER)
    argv[argv.index("--features") + 1 : argv.index("--features") + 2] = [str(train_dir), str(heldout_dir)]
    assert main(argv) == 0, capsys.readouterr().err
    assert len(read_log(out)) == 2
