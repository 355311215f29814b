"""Build the demo model: tokenizer, a small Llama (or Qwen3-MoE), a supervised warm start, datasets and its scores.

Output directory (Hugging Face format plus the task's data)::

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json
    train.jsonl  eval.jsonl      rows {"prompt", "answer", "num_ops"}; no prompt is in both
    warm_start.json              settings, SFT timing, and held-out greedy / sampled (T=1, avg@k) accuracy
    build.json                   the command that rebuilds it, its settings, the versions, every file's sha256
                                 (`python -m everstep_tools.demo` writes it last: `write_build_manifest`)

The warm start has two phases. The first teaches the worked procedure (label smoothing keeps its
sampling noisy). The second, short one continues on a terse teacher's mix, where most solutions are
the bare boxed answer: the model then answers at once more often than it works the chain out, and a
bare answer to a long chain is a guess. Sampled accuracy starts low (about 0.1), greedy decoding takes
the bare-answer branch, and RL has a clear lesson with mixed-reward groups from the first step: show
the working. Accuracy and solution length rise together, the curve R1-Zero made familiar.
"""

from __future__ import annotations

import json
import logging
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM

from everstep.model_manifest import ModelManifest, write_manifest
from everstep_tools.demo import ARCHITECTURES
from everstep_tools.demo.evaluation import evaluate
from everstep_tools.demo.sft import SFTConfig, train_supervised
from everstep_tools.demo.task import TaskConfig, solution_text, split_train_eval, write_problems
from everstep_tools.demo.tokenizer import save_tokenizer

__all__ = ["ARCHITECTURES", "BuildConfig", "ModelShape", "MoEShape", "build_demo", "moe_build_config",
           "quick_build_config", "write_build_manifest"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModelShape:
    """Llama dimensions (defaults: about 0.8M parameters, fast on two CPU cores)."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 384
    """Width of the MLP."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    max_position_embeddings: int = 512
    """Longest sequence the model is meant for (prompt + solution of the longest chain is ~330)."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, int) and value <= 0:
                raise ValueError(f"ModelShape.{name} must be > 0")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("ModelShape: hidden_size % num_heads and num_heads % num_kv_heads must be 0")


@dataclass(kw_only=True)
class MoEShape(ModelShape):
    """Qwen3-MoE dimensions: every layer sparse, ``num_experts`` SiLU-gated experts of which the router picks
    ``num_experts_per_tok`` per token (weights renormalized over those: ``norm_topk_prob``), per-head q/k
    RMSNorm. A separate class, so the dense build's settings (and the shipped build.json) keep their keys.

    The defaults (about 2.2M parameters, 8 experts, top-2) activate about as many MLP weights per token
    as the dense demo model's MLP; the weights are saved in ``dtype`` (bfloat16 keeps model.safetensors
    under 5 MB; the trainer and the rollout engine load them as float32)."""

    architecture: str = "qwen3_moe"
    """Hugging Face model_type (the only sparse one the builder makes)."""
    num_experts: int = 8
    """Routed experts per layer."""
    num_experts_per_tok: int = 2
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 160
    """Width of each expert's MLP."""
    dtype: str = "bfloat16"
    """Dtype of the saved weights: float32 or bfloat16 (trained in float32 either way, and scored after the
    cast, so warm_start.json scores the weights shipped)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.architecture != "qwen3_moe":
            raise ValueError(f"MoEShape.architecture must be 'qwen3_moe', got {self.architecture!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("MoEShape.num_experts_per_tok must be <= num_experts")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"MoEShape.dtype must be float32 or bfloat16, got {self.dtype!r}")


@dataclass(kw_only=True)
class BuildConfig:
    """Everything `python -m everstep_tools.demo` decides."""

    seed: int = 0
    """Seeds the task split, the initial weights and the terse teacher's choices. The warm-start phases
    shuffle with their own `SFTConfig.seed` (0 by default), whatever this is."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The arithmetic chains."""
    model: ModelShape = field(default_factory=ModelShape)
    """Model dimensions (a `MoEShape` builds a Qwen3-MoE)."""
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(
        max_steps=1200, batch_size=64, learning_rate=3e-3, label_smoothing=0.05))
    """The warm start's first phase, on worked solutions (a step budget, so the result does not depend
    on machine load). Label smoothing keeps sampling at temperature 1 noisy while the argmax is
    learned, so GRPO groups have mixed rewards. How well this phase learns the worked procedure sets
    the ceiling RL climbs towards. Small batches learn it far better per example for a model this
    size: 1200 steps of 64 reach a loss of 0.39 in 396 s, where 400 steps of 256 reached 0.53 in
    716 s, and RL then gains 32 points (seed 0) and 28 (seed 1) instead of 25 and 6 (README)."""
    slip_probability: float = 0.0
    """Chance that the warm start's teacher writes a step's result off by one (see
    `everstep_tools.demo.task.solution_text`)."""
    direct_answer_probability: float = 0.6
    """In the terse phase, the chance that the teacher gives only the boxed answer, without the
    working (see `everstep_tools.demo.task.solution_text`); 0 leaves the terse phase out."""
    terse_sft: SFTConfig = field(default_factory=lambda: SFTConfig(
        max_steps=60, batch_size=256, learning_rate=5e-4, warmup_steps=5, label_smoothing=0.05))
    """The warm start's second phase, on the terse teacher's mix: enough to make the bare answer the
    likelier branch (held-out avg@k near 0.1), gentle enough to leave the worked branch intact."""
    num_train: int = 50_000
    """Rows of train.jsonl (the warm start and RL prompts come from these)."""
    num_eval: int = 200
    """Rows of eval.jsonl (held out)."""
    num_eval_samples: int = 8
    """k of the sampled avg@k score in warm_start.json."""
    eval_temperature: float = 1.0
    """Sampling temperature of that score."""
    evaluate: bool = True
    """Score the warm start on eval.jsonl."""
    eval_max_new_tokens: int | None = None
    """Generation cap while scoring (None: room for the longest chain)."""

    def __post_init__(self) -> None:
        if self.num_train < 1 or self.num_eval < 1 or self.num_eval_samples < 1:
            raise ValueError("BuildConfig.num_train, num_eval and num_eval_samples must be >= 1")
        if not 0 <= self.slip_probability < 1:
            raise ValueError("BuildConfig.slip_probability must be in [0, 1)")
        if not 0 <= self.direct_answer_probability < 1:
            raise ValueError("BuildConfig.direct_answer_probability must be in [0, 1)")
        if self.eval_temperature <= 0:
            raise ValueError("BuildConfig.eval_temperature must be > 0")


def quick_build_config(seed: int = 0) -> BuildConfig:
    """Tiny and fast (seconds), for tests; no accuracy target."""
    return BuildConfig(
        seed=seed, task=TaskConfig(max_ops=8),
        model=ModelShape(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1),
        sft=SFTConfig(max_steps=5, batch_size=16, warmup_steps=1, log_every=1, seed=seed),
        terse_sft=SFTConfig(max_steps=2, batch_size=16, warmup_steps=1, log_every=1, seed=seed),
        num_train=200, num_eval=8, num_eval_samples=2, eval_max_new_tokens=16,
    )


def moe_build_config(seed: int = 0) -> BuildConfig:
    """The settings of examples/demo-moe-model (`--architecture qwen3_moe`): the dense build's task, data and
    warm-start recipe on a `MoEShape`."""
    return BuildConfig(seed=seed, model=MoEShape())


def quick_moe_shape() -> MoEShape:
    """A tiny Qwen3-MoE for `--quick --architecture qwen3_moe` (tests)."""
    return MoEShape(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)


def _model(tokenizer, shape: ModelShape) -> PreTrainedModel:
    if isinstance(shape, MoEShape):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
            num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
            num_key_value_heads=shape.num_kv_heads, head_dim=shape.hidden_size // shape.num_heads,
            max_position_embeddings=shape.max_position_embeddings, num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok, moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        ))
    return LlamaForCausalLM(_llama_config(tokenizer, shape))


def _llama_config(tokenizer, shape: ModelShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )


def build_demo(out: Path, config: BuildConfig) -> dict:
    """Write the demo model directory; returns what warm_start.json holds."""
    started = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = split_train_eval(config.num_train, config.num_eval, seed=config.seed, config=config.task)
    write_problems(out / "train.jsonl", train)
    write_problems(out / "eval.jsonl", held_out)
    tokenizer = save_tokenizer(config.task.words(), out)

    torch.manual_seed(config.seed)
    model = _model(tokenizer, config.model)
    num_parameters = sum(p.numel() for p in model.parameters())
    log.info("demo model: %d parameters, vocabulary %d", num_parameters, len(tokenizer))
    teacher = random.Random(config.seed + 2)
    examples = [(p.prompt, solution_text(p, slip_probability=config.slip_probability, rng=teacher,
                                         max_value=config.task.max_value)) for p in train]
    sft = train_supervised(model, tokenizer, examples, config.sft)
    terse = None
    if config.direct_answer_probability:
        terse_examples = [(p.prompt, solution_text(p, slip_probability=config.slip_probability,
                                                   direct_answer_probability=config.direct_answer_probability,
                                                   rng=teacher, max_value=config.task.max_value)) for p in train]
        terse = train_supervised(model, tokenizer, terse_examples, config.terse_sft)
    model.generation_config.do_sample = True  # the sampling defaults RL uses: plain T=1, no top-k
    model.generation_config.temperature = 1.0
    model.generation_config.top_k = 0
    model.generation_config.top_p = 1.0
    if isinstance(config.model, MoEShape) and config.model.dtype != "float32":
        model.to(getattr(torch, config.model.dtype))
        model.config.dtype = config.model.dtype
    model.save_pretrained(out)
    model.float()  # scored as the trainer and the engine load it: the saved weights, in float32

    summary: dict = {
        "num_parameters": num_parameters,
        "sft_steps": sft.steps, "sft_seconds": round(sft.seconds, 1), "sft_final_loss": round(sft.final_loss, 4),
        "terse_sft_steps": terse.steps if terse else 0, "terse_sft_seconds": round(terse.seconds, 1) if terse else 0.0,
        "config": asdict(config),
    }
    if config.evaluate:
        result = evaluate(model, tokenizer, held_out, num_samples=config.num_eval_samples,
                          temperature=config.eval_temperature,
                          max_new_tokens=config.eval_max_new_tokens or _max_new_tokens(config.task))
        summary.update(greedy_accuracy=result.greedy_accuracy, sampled_accuracy=result.sampled_accuracy,
                       num_eval_samples=result.num_samples, eval_temperature=result.temperature,
                       eval_seconds=round(result.seconds, 1),
                       sampled_accuracy_by_num_ops=result.sampled_accuracy_by_num_ops)
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_build_manifest(out: Path, config: BuildConfig, command: str) -> ModelManifest:
    """Write build.json into the finished folder ``out``: ``command`` rebuilds it; the weights also depend
    on the versions and thread count recorded (the same ones rebuild them bit for bit on one machine)."""
    environment = {"python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "torch_num_threads": str(torch.get_num_threads())}
    return write_manifest(out, command=command, settings=asdict(config), environment=environment)


def _max_new_tokens(task: TaskConfig) -> int:
    """Room for the longest worked solution (6 tokens per step, 3 for the box, EOS) plus slack."""
    return 6 * task.max_ops + 16
