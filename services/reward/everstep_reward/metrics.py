"""Prometheus metrics of the reward service (default registry, served on --port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ITEMS = Counter("everstep_reward_items_total", "Verifier results by outcome (one per item and verifier).",
                ["verifier", "outcome"])
ITEM_SECONDS = Histogram("everstep_reward_item_seconds", "Time one verifier took on one item.", ["verifier"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ERRORS = Counter("everstep_reward_errors_total", "Verifier results that are errors, by kind.",
                 ["verifier", "kind"])
TIMEOUTS = Counter("everstep_reward_timeouts_total", "Verifier results that hit a time limit.", ["verifier"])
SANDBOX_ERRORS = Counter("everstep_reward_sandbox_errors_total",
                         "Code samples the sandbox could not judge (unreachable, failed call, SandboxError).",
                         ["kind"])
CODE_RESULTS = Counter("everstep_reward_code_results_total",
                       "Judged code samples by language and verdict (accepted, wrong_answer, time_limit, "
                       "runtime_error, compile_error).", ["language", "verdict"])
FORMAT_VIOLATIONS = Counter("everstep_reward_format_violations_total",
                            "Responses failing a format rule, by the first rule broken.", ["rule"])
LENGTH_MEASUREMENTS = Counter("everstep_reward_length_measurements_total",
                              "Length verifier results by how L was measured: tokens (num_response_tokens), "
                              "or the words/chars fallback when the caller sent no token count.", ["unit"])
INFLIGHT_ITEMS = Gauge("everstep_reward_inflight_items", "Items being scored.")
