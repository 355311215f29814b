"""Build the tools demo model: tokenizer with tool support, a small Llama, a warm start with a few tool traces.

Output directory (Hugging Face format plus the task's data)::

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json (chat template)
    special_tokens_map.json
    train.jsonl  eval.jsonl      rows {"prompt", "answer"}; no prompt is in both
    warm_start.json              settings, SFT timing, and the first turn's held-out behaviour (tool-call rate,
                                 accuracy of the answers given without the tool)
    build.json                   the command that rebuilds it, its settings, the versions, every file's sha256

Every prompt is rendered as the controller renders it for a job with `tools: {environment: python}`: Qwen2.5's
template with the built-in `python` tool in the system turn. For a tool trace the teacher calls the tool
(`print(a * b)`) and then boxes the printed product, the reply rendered by `everstep.tools.turns.tool_reply_text`
exactly as the rollout engine appends it; otherwise it boxes the product at once, which the model cannot compute.

The warm start has two phases, like the demo model's. The first, on mostly tool traces, teaches the mechanics
(copy the factors into the call, copy the printed product into the answer): a model this small does not learn
to copy from a minority of traces in a few hundred steps. The second, short one, on a mix where only
`tool_use_probability` of the problems use the tool, makes calling the tool the rarer branch of the first turn.
The warm start is then right almost only when it calls the tool: RL raises the tool-use rate, and accuracy with it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from everstep.settings.tools import PYTHON_TOOL
from everstep.tools.calls import ParsedCall
from everstep.tools.turns import tool_reply_text
from everstep_tools.demo.build import ModelShape
from everstep_tools.demo.evaluation import boxed_answer, generate_completions
from everstep_tools.demo.sft import SFTConfig, train_supervised
from everstep_tools.demo.tools.task import (
    Problem,
    TaskConfig,
    call_text,
    direct_answer_text,
    final_answer_text,
    split_train_eval,
    write_problems,
)
from everstep_tools.demo.tools.tokenizer import EOT, build_tokenizer

__all__ = ["ToolsBuildConfig", "build_tools_demo", "quick_tools_build_config"]

log = logging.getLogger(__name__)

TOOLS = [PYTHON_TOOL.model_dump()]
"""What the controller passes to the template for `tools: {environment: python}` (`ToolSettings.offered`)."""


@dataclass(kw_only=True)
class ToolsBuildConfig:
    """Everything `python -m everstep_tools.demo.tools` decides."""

    seed: int = 0
    """Seeds the split, the initial weights and the teacher's choices."""
    task: TaskConfig = field(default_factory=TaskConfig)
    """The multiplications."""
    model: ModelShape = field(default_factory=lambda: ModelShape(
        hidden_size=96, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
        max_position_embeddings=256))
    """Model dimensions (about 0.4M parameters: a prompt is 46 tokens, a whole trajectory under 100)."""
    vocab_size: int = 768
    """Byte-level BPE vocabulary, at most (control tokens and tool tags included; the task's text saturates it at
    about 700)."""
    mechanics_tool_use_probability: float = 0.95
    """The first phase's chance of a tool trace: it teaches the mechanics (copy the factors into the call, copy the
    printed product into the answer)."""
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(
        max_steps=800, batch_size=32, learning_rate=3e-3, label_smoothing=0.0))
    """The first phase (a step budget, so the result does not depend on machine load). No label smoothing: the
    copied digits must come out right at temperature 1. Copying is learned suddenly: the loss sits near 1.3 (the
    digits guessed) for about 200 steps, then falls to 0.1-0.2 within 50; 300 steps with 80% tool traces, and a
    2-layer model of width 128 at a learning rate of 5e-3, had not got there (docs/benchmarks.md)."""
    tool_use_probability: float = 0.15
    """The second phase's chance of a tool trace (the rest answer at once): what makes calling the tool the
    rarer branch of the first turn."""
    mix_sft: SFTConfig = field(default_factory=lambda: SFTConfig(
        max_steps=40, batch_size=64, learning_rate=5e-4, warmup_steps=5, label_smoothing=0.0))
    """The second phase: short, enough to bring the first turn's tool-call rate near `tool_use_probability`,
    gentle enough to leave the mechanics intact."""
    num_train: int = 20_000
    """Rows of train.jsonl (the warm start and RL prompts come from these)."""
    num_eval: int = 200
    """Rows of eval.jsonl (held out)."""
    evaluate: bool = True
    """Sample first turns on eval.jsonl (T=1) for warm_start.json."""

    def __post_init__(self) -> None:
        if self.num_train < 1 or self.num_eval < 1:
            raise ValueError("ToolsBuildConfig.num_train and num_eval must be >= 1")
        for name in ("tool_use_probability", "mechanics_tool_use_probability"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"ToolsBuildConfig.{name} must be in (0, 1]")
        if self.vocab_size < 300:
            raise ValueError("ToolsBuildConfig.vocab_size must be >= 300 (256 bytes, control tokens, some merges)")


def quick_tools_build_config(seed: int = 0) -> ToolsBuildConfig:
    """Tiny and fast (seconds), for tests; no accuracy target."""
    return ToolsBuildConfig(
        seed=seed, model=ModelShape(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1),
        vocab_size=320, sft=SFTConfig(max_steps=3, batch_size=16, warmup_steps=1, log_every=1, seed=seed),
        mix_sft=SFTConfig(max_steps=2, batch_size=16, warmup_steps=1, log_every=1, seed=seed),
        num_train=200, num_eval=8, evaluate=False)


class _Renderer:
    """The job's rendering: the template with the python tool, as the controller and the rollout engine use it."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)

    def prompt(self, problem: Problem) -> str:
        return self.render([{"role": "user", "content": problem.prompt}], True)

    def after_reply(self, problem: Problem) -> str:
        """The context of the final turn: prompt, the call, and the tool's reply (what `print` writes)."""
        call = ParsedCall("python", {"code": f"print({problem.left} * {problem.right})"})
        reply = tool_reply_text(self.render, [call], [f"{problem.answer}\n"], EOT)
        return self.prompt(problem) + call_text(problem) + EOT + reply


def _examples(renderer: _Renderer, problems: list[Problem], tool_use_probability: float,
              rng: random.Random) -> list[tuple[str, str]]:
    examples = []
    for problem in problems:
        if rng.random() < tool_use_probability:
            examples.append((renderer.prompt(problem), call_text(problem)))
            examples.append((renderer.after_reply(problem), final_answer_text(str(problem.answer))))
        else:
            examples.append((renderer.prompt(problem), direct_answer_text(problem)))
    return examples


def _model(tokenizer: PreTrainedTokenizerFast, shape: ModelShape) -> LlamaForCausalLM:
    eot = tokenizer.convert_tokens_to_ids(EOT)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=None, eos_token_id=eot, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True))


def _first_turns(model, tokenizer, renderer: _Renderer, held_out: list[Problem], samples: int) -> dict:
    """Held-out first turns sampled at T=1: how often they call the tool, how often the others are right, and how
    often the final answer after a (simulated) tool reply is right."""
    prompts = [renderer.prompt(p) for p in held_out for _ in range(samples)]
    answers = [str(p.answer) for p in held_out for _ in range(samples)]
    completions = generate_completions(model, tokenizer, prompts, temperature=1.0, max_new_tokens=48)
    texts = [tokenizer.decode(c, skip_special_tokens=False) for c in completions]
    calls = [t.startswith("<tool_call>") for t in texts]
    well_formed = sum(t.strip() == call_text(p) + EOT for t, p, c in zip(
        texts, [p for p in held_out for _ in range(samples)], calls, strict=True) if c)
    direct = [boxed_answer(t) == a for t, a, c in zip(texts, answers, calls, strict=True) if not c]
    after = generate_completions(model, tokenizer, [renderer.after_reply(p) for p in held_out], temperature=1.0,
                                 max_new_tokens=16)
    copied = [boxed_answer(tokenizer.decode(c, skip_special_tokens=True)) == str(p.answer)
              for c, p in zip(after, held_out, strict=True)]
    return {"first_turn_tool_call_rate": round(sum(calls) / len(calls), 4),
            "first_turn_exact_call_rate": round(well_formed / max(1, sum(calls)), 4),
            "direct_answer_accuracy": round(sum(direct) / max(1, len(direct)), 4),
            "answer_after_reply_accuracy": round(sum(copied) / len(copied), 4),
            "first_turn_samples": len(calls)}


def build_tools_demo(out: Path, config: ToolsBuildConfig) -> dict:
    """Write the tools demo model directory; returns what warm_start.json holds."""
    started = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = split_train_eval(config.num_train, config.num_eval, seed=config.seed, config=config.task)
    write_problems(out / "train.jsonl", train)
    write_problems(out / "eval.jsonl", held_out)

    # The merges are learned from the conversations the model will see (a bootstrap tokenizer renders them; the
    # template's text does not depend on the vocabulary).
    bootstrap = build_tokenizer(["x"], config.vocab_size)
    teacher = random.Random(config.seed + 2)
    corpus = [p + c for p, c in _examples(_Renderer(bootstrap), train[:2000], 0.5, teacher)]
    tokenizer = build_tokenizer(corpus, config.vocab_size)
    tokenizer.save_pretrained(out)
    renderer = _Renderer(tokenizer)

    torch.manual_seed(config.seed)
    model = _model(tokenizer, config.model)
    num_parameters = sum(p.numel() for p in model.parameters())
    examples = _examples(renderer, train, config.mechanics_tool_use_probability, random.Random(config.seed + 3))
    prompt_tokens = len(tokenizer(renderer.prompt(train[0])).input_ids)
    log.info("tools demo model: %d parameters, vocabulary %d, %d examples, prompt of %d tokens", num_parameters,
             len(tokenizer), len(examples), prompt_tokens)
    sft = train_supervised(model, tokenizer, examples, config.sft)
    mix = train_supervised(model, tokenizer, _examples(renderer, train, config.tool_use_probability,
                                                       random.Random(config.seed + 4)), config.mix_sft)
    model.generation_config.do_sample = True  # the sampling defaults RL uses: plain T=1, no top-k
    model.generation_config.temperature = 1.0
    model.generation_config.top_k = 0
    model.generation_config.top_p = 1.0
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(EOT)
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)

    summary: dict = {
        "num_parameters": num_parameters, "vocab_size": len(tokenizer), "prompt_tokens": prompt_tokens,
        "sft_examples": len(examples), "sft_steps": sft.steps, "sft_seconds": round(sft.seconds, 1),
        "sft_final_loss": round(sft.final_loss, 4), "mix_sft_steps": mix.steps,
        "mix_sft_seconds": round(mix.seconds, 1), "mix_sft_final_loss": round(mix.final_loss, 4),
        "config": asdict(config),
    }
    if config.evaluate:
        model.eval()
        with torch.no_grad():
            summary.update(_first_turns(model, tokenizer, renderer, held_out, samples=4))
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
