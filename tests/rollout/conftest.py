"""Rollout fixtures: a tied-embedding Qwen2 twin of the tiny model, and tiny GPT-2 / GPT-NeoX models (not
Llama-compatible: they run on the transformers executor), all with the tiny model's tokenizer; a sandbox service
process for the python tool."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from everstep_rollout.config import default_num_threads

# As the server does: with more threads than free cores, CPU decoding slows down by orders of magnitude.
torch.set_num_threads(default_num_threads())


def _with_tiny_tokenizer(tiny_model_dir: Path, out: Path) -> Path:
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random GPT-2 (learned absolute positions, LayerNorm, Conv1D projections, tied embeddings)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    out = _with_tiny_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("tiny-gpt2"))
    torch.manual_seed(2)
    GPT2LMHeadModel(GPT2Config(vocab_size=51, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=1,
                               eos_token_id=2)).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_neox_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random GPT-NeoX (partial rotary embeddings, parallel attention and MLP)."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    out = _with_tiny_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("tiny-neox"))
    torch.manual_seed(3)
    GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=51, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, bos_token_id=1, eos_token_id=2, rotary_pct=0.5,
    )).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 (q/k/v bias, tied embeddings) with the tiny model's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = _with_tiny_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("tiny-qwen2"))
    config = Qwen2Config(
        vocab_size=51, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=True, rope_theta=500.0,
    )
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # make the biases non-zero so that they matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sandbox_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from everstep.processes import free_port, spawn, stop_processes, wait_grpc_serving

    http_port, grpc_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("sandbox") / "sandbox.log"
    process = spawn("sandbox", ["-m", "everstep_sandbox", "--host", "127.0.0.1", "--port", str(http_port),
                                "--grpc-port", str(grpc_port), "--workers", "2"], log,
                    http_port=http_port, grpc_port=grpc_port)
    try:
        wait_grpc_serving(process, 60)
        yield process.grpc_address
    finally:
        stop_processes([process])
