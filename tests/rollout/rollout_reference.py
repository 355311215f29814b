"""Hugging Face references the rollout engine is checked against (full forward passes, no KV cache)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each output token under a full Hugging Face forward (T=1 when 0)."""
    ids = torch.tensor([prompt_ids + output_ids])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs.gather(1, torch.tensor(output_ids)[:, None]).squeeze(1).tolist()


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int, eos_token_id: int | None = 2) -> list[int]:
    ids = list(prompt_ids)
    out: list[int] = []
    for _ in range(num_tokens):
        token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)
        out.append(token)
        if token == eos_token_id:
            break
    return out


def assert_matches_hf(results: dict, model, prompts: list[list[int]], temperature: float) -> None:
    """Each result `s{i}` for prompts[i]: log-probs within 1e-3 (mean) / 1e-2 (max) of a float32 HF
    forward pass, and at temperature 0 the same tokens as HF greedy decoding."""
    from everstep_rollout.sequence import FinishReason

    diffs = []
    for i, prompt in enumerate(prompts):
        r = results[f"s{i}"]
        assert r.output_ids and r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        reference = hf_logprobs(model, prompt, r.output_ids, temperature)
        diffs += [abs(a - b) for a, b in zip(r.output_logprobs, reference, strict=True)]
        if temperature == 0:
            assert r.output_ids == hf_greedy(model, prompt, len(r.output_ids))
    assert sum(diffs) / len(diffs) < 1e-3
    assert max(diffs) < 1e-2
