"""A LoRA job through `everstep up`: the trainer trains adapters on a random Llama, pushes only them to the
engine every step, checkpoints them, and `everstep model export` writes the job's checkpoint as a PEFT adapter
directory and, with --merge, as a plain Hugging Face model, which peft and transformers load as they are."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from stack_jobs import everstep_up, run_job

from everstep.v1 import rollout_pb2, rollout_pb2_grpc


@pytest.mark.slow
def test_a_lora_job_pushes_adapters_and_exports_its_checkpoints(tmp_path: Path, tiny_model_dirs) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs("llama")
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{a} + {b} =", "answer": str(a + b)}) + "\n"
                             for a in range(6) for b in range(6)))
    with everstep_up(tmp_path / "home") as stack:
        spec = {
            "name": "lora-e2e",
            "model_path": str(model_dir),
            "dataset": {"train_path": str(train)},
            "reward": {"verifiers": [{"name": "length", "params": {"max_length": 10, "cache_length": 9}}]},
            "algorithm": {"group_size": 4},
            "sampling": {"temperature": 1.0, "max_new_tokens": 16},
            "scheduler": {"mode": "sync", "prompts_per_iteration": 4},
            "trainer": {"learning_rate": 5e-2, "packing": True,
                        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}},
            "checkpoint": {"interval": 2, "dir": str(tmp_path / "checkpoints")},
            "steps": 3,
            "seed": 3,
        }
        api = httpx.Client(base_url=stack.url, timeout=30)
        job = run_job(api, spec, timeout_seconds=600)
        assert job["state"] == "SUCCEEDED", job["error"]
        history = api.get(f"/v1/jobs/{job['id']}/metrics").json()
        trained = [m for m in history if m["num_samples_trained"]]
        assert trained, history
        assert [c["step"] for c in job["checkpoints"]] == [2, 3]

        with grpc.insecure_channel(stack.address("rollout")) as channel:
            status = rollout_pb2_grpc.RolloutStub(channel).GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
        assert status.version == len(trained)  # every trained step's adapters reached the engine

        adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
        for extra, out in (([], adapter_dir), (["--merge"], merged_dir)):
            exported = stack.everstep("model", "export", job["id"], "--out", str(out), "--url", stack.url, *extra)
            assert exported.returncode == 0, exported.stderr
        assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "config.json").exists()
        missing = stack.everstep("model", "export", job["id"], "--step", "1", "--out", str(tmp_path / "none"),
                                 "--url", stack.url, timeout=120)
        assert missing.returncode != 0 and "no checkpoint of step 1" in missing.stderr

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with_adapters = PeftModel.from_pretrained(base, adapter_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 4, 7, 6, 9, 3]])
    with torch.inference_mode():
        adapted_logits = with_adapters(ids).logits
        torch.testing.assert_close(merged(ids).logits, adapted_logits, atol=1e-4, rtol=0)
        assert (plain(ids).logits - adapted_logits).abs().max() > 1e-3  # the adapters trained
