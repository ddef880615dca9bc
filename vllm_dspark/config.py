"""Configuration objects: the drafter's checkpoint config and the plugin's serving options.

Both are pydantic models so that a malformed `config.json` or a bad serving option fails
at start-up with a message that names the field, instead of deep inside the engine.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from vllm_dspark.scheduling.policies import POLICY_TYPES, Objective, PolicyName

if TYPE_CHECKING:
    from vllm_dspark.scheduling.sps import SpsCurve

MarkovHeadType = Literal["vanilla", "gated", "rnn"]
DRAFTER_ARCHITECTURE = "Qwen3DSparkModel"
CONFIG_FILE = "config.json"


class ConfigError(ValueError):
    """A configuration or checkpoint does not fit; the message says what and where."""


class DrafterConfig(BaseModel):
    """`config.json` of a DSpark drafter (DSPARK.md section 6).

    Unknown keys are kept (`extra="allow"`) so public checkpoints with more fields load
    and save back without losing them.
    """

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    architectures: list[str] = Field(default_factory=lambda: [DRAFTER_ARCHITECTURE])
    model_type: str = "qwen3"
    hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    max_position_embeddings: int = Field(default=8192, gt=0)
    vocab_size: int = Field(gt=0)
    # Reduced draft vocabulary (vLLM's DSpark format): the drafter's LM head and Markov W2
    # cover only these many target tokens, mapped back by the checkpoint's `d2t` (target id
    # = draft id + d2t[draft id]); None = the full target vocabulary.
    draft_vocab_size: int | None = Field(default=None, gt=0)
    hidden_act: Literal["silu"] = "silu"
    target_hidden_size: int | None = Field(default=None, gt=0)
    num_hidden_layers: int = Field(gt=0)
    block_size: int = Field(gt=0, le=64)
    target_layer_ids: list[int] = Field(min_length=1)
    mask_token_id: int = Field(ge=0)
    markov_rank: int = Field(default=256, ge=0)
    markov_head_type: MarkovHeadType = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    # Sequential Temperature Scaling (DSPARK.md section 3): one temperature per block
    # position, applied to the confidence logit. None means uncalibrated (all 1.0).
    confidence_temperatures: list[float] | None = None
    num_anchors: int = Field(default=64, gt=0)
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"

    @model_validator(mode="after")
    def _check_consistency(self) -> "DrafterConfig":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        if self.draft_vocab_size is not None and self.draft_vocab_size > self.vocab_size:
            raise ValueError(
                f"draft_vocab_size {self.draft_vocab_size} is larger than the target vocabulary "
                f"(vocab_size {self.vocab_size})"
            )
        ids = self.target_layer_ids
        if min(ids) < -1:
            raise ValueError(f"target_layer_ids must be >= -1 (-1 = embeddings), got {ids}")
        if any(b <= a for a, b in zip(ids, ids[1:])):
            # vLLM captures hidden states in layer order; the concatenation the `fc`
            # layer was trained on must follow the same order.
            raise ValueError(f"target_layer_ids must be strictly increasing, got {ids}")
        temps = self.confidence_temperatures
        if temps is not None:
            if len(temps) != self.block_size:
                raise ValueError(
                    f"confidence_temperatures has {len(temps)} entries, "
                    f"block_size is {self.block_size}"
                )
            if any(not (t > 0) for t in temps):
                raise ValueError(f"confidence_temperatures must be > 0, got {temps}")
        return self

    @property
    def context_hidden_size(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @property
    def draft_vocab(self) -> int:
        """Rows of the drafter's LM head and Markov W2."""
        return self.draft_vocab_size or self.vocab_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab < self.vocab_size

    @property
    def has_markov_head(self) -> bool:
        return self.markov_rank > 0

    @classmethod
    def from_dir(cls, path: str | Path) -> "DrafterConfig":
        config_path = Path(path) / CONFIG_FILE
        if not config_path.is_file():
            raise ConfigError(f"drafter config not found: {config_path}")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc
        return cls.parse_checked(raw, source=str(config_path))

    @classmethod
    def parse_checked(cls, raw: dict[str, Any], source: str) -> "DrafterConfig":
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(f"invalid drafter config {source}:\n{exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / CONFIG_FILE).write_text(
            json.dumps(self.model_dump(exclude_none=True), indent=2) + "\n"
        )

    def check_fits_target(self, *, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Raise ConfigError when this drafter cannot read the given target's states."""
        problems = []
        if self.context_hidden_size != hidden_size:
            problems.append(
                f"drafter expects target hidden size {self.context_hidden_size}, "
                f"target has {hidden_size}"
            )
        if self.vocab_size != vocab_size:
            problems.append(
                f"drafter vocabulary is {self.vocab_size}, target vocabulary is {vocab_size}"
            )
        bad = [i for i in self.target_layer_ids if i >= num_layers]
        if bad:
            problems.append(
                f"target_layer_ids {bad} out of range: target has {num_layers} layers "
                f"(valid ids -1..{num_layers - 1})"
            )
        if problems:
            raise ConfigError("drafter does not match the target: " + "; ".join(problems))


# `sps_profile: "auto"`: the profile cached by `vllm-dspark profile --cache` for this
# model, dtype, hardware and vLLM version.
AUTO_PROFILE = "auto"


class PluginOptions(BaseModel):
    """Serving options of the plugin, read from vLLM's `additional_config["vllm_dspark"]`.

    Example: `--additional-config '{"vllm_dspark": {"policy": "dspark",
    "sps_table": [[1, 11.9], [8, 8.9], [64, 3.2]]}}'`.
    """

    model_config = ConfigDict(extra="forbid")

    # None: `dspark`; without a curve also `sps_profile: "auto"` with `profile_at_startup`
    # (logged at start-up).
    policy: PolicyName | None = None
    # fixed policy: verify min(k, K) draft tokens; None = all K.
    k: int | None = Field(default=None, ge=0)
    threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    # SPS(B) as [[batch_tokens, steps_per_second], ...] or a profile file path.
    sps_table: list[tuple[int, float]] | None = None
    sps_profile: str | None = None
    # With sps_profile "auto": measure the curve at start-up when no cached one exists.
    profile_at_startup: bool = False
    min_tokens_per_s: float = Field(default=0.0, ge=0.0)
    # dspark policy: what each step maximises, the engine's expected tokens per second or
    # the product of the requests' expected speeds (scheduling/policies.py, DSparkPolicy).
    objective: Objective = "throughput"
    # Learn how the served steps relate to the curve (scale and offset, scheduling/overhead.py).
    measure_step_overhead: bool = True
    # Correct the drafter's confidences per position from the acceptance observed while
    # serving (online Platt scaling; see vllm_dspark/scheduling/recalibration.py).
    recalibrate: bool = True
    recalibration_rate: float = Field(default=0.05, gt=0.0, le=1.0)
    # Let the adaptive policies (dspark, dspark_async) choose each step whether and how
    # deep to draft, and let the drafter stop a request once no policy would verify more
    # of it (scheduling/controller.py); false drafts all K positions every step.
    adaptive_drafting: bool = True
    # Also propose, per request, the continuation of the longest earlier match of its own
    # context (prompt lookup); the scheduler takes whichever proposal expects more accepted
    # tokens and ranks both sources under one budget (scheduling/hybrid.py).
    hybrid_ngram: bool = True
    # Hybrid: the worker leaves the drafter out of a step predicted to serve more tokens a
    # second with the requests' n-gram continuations alone (scheduling/hybrid.py,
    # DrafterSkip). Measured on SmolLM2 under a closed loop, turn by turn against the same
    # hybrid without it at R = 1 / 4 / 16: chat 1.05x / 1.09x / 1.02x, code 0.96x / 1.20x /
    # 0.97x and 0.98x / 1.01x / 0.94x with the drafter's c_1 pooled; code 0.96x / 1.00x /
    # 1.03x with it kept by situation, as now (benchmarks/results/closed_loop/README.md).
    ngram_skips_drafter: bool = True
    # With adaptive drafting: stop speculating at a load where speculative steps have
    # measurably realized less per-request speed than plain steps there, whatever the
    # model predicts (probes go on; scheduling/realized.py).
    check_realized_speed: bool = True
    # With the check: also stop where some request's own recent speculative steps realized
    # less than plain decoding, while the mean over requests gains (scheduling/realized.py);
    # false judges the mean alone. Off by default: under a server's steady load (closed
    # loop on code, 2026-12-06) one request's losses (0.68-0.72x plain) kept the hybrid's
    # whole load plain on 33-57% of its steps in three of the runs' cells at R = 4 and 16,
    # which then ran at 0.81-0.93x vLLM's n-gram per user, the other cells of those runs
    # at 0.93-1.04x (benchmarks/results/closed_loop/README.md).
    check_each_request: bool = False
    # With the check and hybrid proposals: also stop drafting (n-gram continuations still
    # verified) at a load where the hybrid's steps have measurably realized less than its
    # reference steps without the drafter, both chosen by count (scheduling/realized.py,
    # `drafter_vetoes`). Off by default: where the drafter pays it never vetoes and its
    # reference steps only cost (benchmarks/results/closed_loop/README.md).
    check_drafter_against_ngram: bool = False
    # With adaptive drafting: a request admitted at a load where the drafter's recent
    # accepted drafts saved fewer seconds than its context pass, forward passes and their
    # verification cost gets no drafter for its life (no context K/V, n-gram continuations
    # only; scheduling/drafter_ledger.py). Off by default: on SmolLM2 under a closed loop
    # it took the drafter's time at 16 requests from 3.9 to 0.4 ms a step, yet served the
    # median request 1.003x (code) and 1.000x (chat) the engine without it, and its system
    # throughput was 1.7% and 4.9% lower (benchmarks/results/closed_loop/README.md).
    drafter_admission: bool = False
    # A step that drafts nothing queues its context K/V, written in one batch before the
    # drafter next drafts (integration/deferred_context.py); false writes it every step.
    defer_context: bool = True
    # The dtype of the context pass's largest product, the drafter's `fc` over the
    # target's concatenated layers (integration/draft_model.py). "auto": bfloat16 where the
    # drafter's weights are float32 on a CPU that multiplies bfloat16 natively (AVX512-BF16
    # or AMX), else the weights' own dtype. Only the drafts' rounding changes (verification
    # stays exact). On a 2-core AMD EPYC the product of 300 rows took 2.4 against 5.0 ms,
    # and the context pass 0.1-0.7 ms a step less (benchmarks/results/context_projection/).
    context_projection: Literal["auto", "float32", "bfloat16"] = "auto"
    # A step where no request verifies drafts samples as a plain engine does (vLLM's
    # sampler, not its rejection sampler over zero drafts); false keeps vLLM's path.
    plain_sampling_without_drafts: bool = True
    log_interval_s: float = Field(default=10.0, gt=0)

    @model_validator(mode="after")
    def _check_curve(self) -> "PluginOptions":
        has_curve = self.sps_table is not None or self.sps_profile is not None
        if self.policy is None:
            # Out of the box: the adaptive policy, on this engine's cached profile, measured
            # at start-up when there is none yet.
            self.policy = "dspark"
            if not has_curve:
                self.sps_profile, self.profile_at_startup, has_curve = AUTO_PROFILE, True, True
                self._defaulted = True
        if POLICY_TYPES[self.policy].needs_curve and not has_curve:
            raise ValueError(
                f"policy '{self.policy}' needs the engine throughput curve: give "
                "'sps_table' ([[batch_tokens, steps_per_second], ...]) or 'sps_profile' "
                "(a file written by `vllm-dspark profile`)"
            )
        if self.sps_table is not None and self.sps_profile is not None:
            raise ValueError("give either 'sps_table' or 'sps_profile', not both")
        if has_curve and self.sps_profile != AUTO_PROFILE:
            self.sps_curve()  # fail at start-up, naming the table or file
        return self

    def sps_curve(self) -> "SpsCurve | None":
        """The engine throughput curve SPS(B) from the table or file (not for "auto",
        which the scheduler resolves from the engine's profile cache key)."""
        from vllm_dspark.scheduling.sps import SpsCurve

        if self.sps_profile is not None:
            return SpsCurve.load(self.sps_profile)
        if self.sps_table is not None:
            return SpsCurve(points=self.sps_table)
        return None

    _defaulted: bool = PrivateAttr(default=False)

    def choice(self) -> str:
        """What the options select and why, for the start-up log."""
        if self._defaulted:
            return ("policy 'dspark' with adaptive drafting on this engine's SPS profile (cached, or "
                    "measured now): the default when only --speculative-config is given")
        curve = "no curve" if self.sps_table is None and self.sps_profile is None else (
            f"sps_profile {self.sps_profile!r}" if self.sps_profile else f"an sps_table of {len(self.sps_table or [])} points")
        return (f"policy '{self.policy}' with {curve}" + ("" if self.adaptive_drafting else ", drafting all K")
                + (", per-user objective" if self.policy == "dspark" and self.objective == "per_user" else ""))

    @classmethod
    def from_additional_config(cls, additional_config: dict[str, Any] | None) -> "PluginOptions":
        raw = (additional_config or {}).get("vllm_dspark", {})
        if not isinstance(raw, dict):
            raise ConfigError(
                f"additional_config['vllm_dspark'] must be an object, got {type(raw).__name__}"
            )
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            raise ConfigError(f"invalid vllm_dspark plugin options:\n{exc}") from exc
