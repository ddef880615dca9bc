"""Confidence-scheduled verification: SPS profiles and verification-length policies."""

from vllm_dspark.scheduling.policies import POLICIES, dspark_budget, select_verify_lengths
from vllm_dspark.scheduling.sla import SlaPlan, plan_sla
from vllm_dspark.scheduling.sps import SpsCurve

__all__ = [
    "POLICIES",
    "SlaPlan",
    "SpsCurve",
    "dspark_budget",
    "plan_sla",
    "select_verify_lengths",
]
