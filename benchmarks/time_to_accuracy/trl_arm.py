"""The TRL arms of `benchmarks.time_to_accuracy`: TRL's `GRPOTrainer` on the same model, rows and reward.

    python -m benchmarks.time_to_accuracy.trl_arm --arm trl|trl-lora --config CONFIG.json --spec SPEC.json
        --reward HOST:PORT --out RESULT.json

Run by `benchmarks.time_to_accuracy` in its own process (its own torch threads). Needs the optional
benchmark dependency: `pip install -r benchmarks/requirements-trl.txt` (TRL 1.16.0).

SPEC is the job spec of the arm's everstep counterpart (trl: `full`, trl-lora: `lora`); the arm takes its
data, reward, learning rate, warmup, steps, optimizer steps per step and LoRA from it.

- Data: the spec's rows, loaded by `load_job_data` (the same prompts and held-out prompts; the prompt
  ids TRL's tokenizer call makes are checked equal to everstep's).
- Per step (one generation round): ``prompts_per_step`` prompts x G completions, and as many optimizer
  steps on them as the everstep arm takes (`trainer.num_minibatches` x `trainer.ppo_epochs`), each on an
  equal share (per-device batch up to 64, gradient accumulation to the share). TRL counts
  `steps_per_generation` in per-device batches, so the arm sets `generation_batch_size` to the whole
  round instead; TRL's derived `steps_per_generation` / `gradient_accumulation_steps` = num_minibatches
  (equal to num_minibatches itself when the share fits one per-device batch, as on SmolLM2's 8 x 8).
- Learning rate: everstep's schedule, exactly: the rate of optimizer step t is everstep's
  `learning_rate_at(t // optimizer steps per step, warmup_steps, total_steps = steps)` (linear warmup,
  then cosine to 0 over the run, one rate per generation round), a `LambdaLR` in place of the one
  transformers builds for `lr_scheduler_type="cosine"`; transformers' own cosine would lower the rate
  inside a round too.
- trl-lora: a peft `LoraConfig` with the spec's `trainer.lora` (rank, alpha, dropout, target modules).
- Reward: every completion is scored by the real everstep reward service over gRPC, with the job's
  reward items (`RewardItemBuilder`: the math verifier and the row's answer).
- Evaluation: before training and every ``eval_every`` steps, the same held-out prompts x k at the
  training temperature plus one greedy answer, generated with Hugging Face `generate` (not TRL's
  generation path, not everstep's engine) and scored by the same reward service. Its wall time is
  left out of the training seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.time_to_accuracy.config import (
    Arm,
    ArmRun,
    CurvePoint,
    TtaConfig,
    lr_schedule_of,
    optimizer_steps_per_step,
)
from everstep.rest.job_spec import JobSpec
from everstep.settings.training import ALL_LINEAR, LoraSettings
from everstep.v1 import common_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.evaluation import correctness, scored_results
from everstep_controller.run.job_data import load_job_data
from everstep_trainer.step.optim import learning_rate_at

MICRO_BATCH = 64  # completions per forward/backward; the optimizer step covers the whole generation batch
EVAL_GENERATE_BATCH = 256  # sequences per `generate` call in the evaluation


class MathReward:
    """TRL reward function: each completion scored by the everstep reward service."""

    def __init__(self, client: RewardClient, builder: RewardItemBuilder, rows: dict[int, PromptRow]) -> None:
        self.client, self.builder, self.rows = client, builder, rows
        self.__name__ = "everstep_reward"  # TRL logs each reward function under its name
        self.num_calls = 0
        self.num_unscored = 0

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]],
                 row_index: list[int], **_: Any) -> list[float]:
        self.num_calls += 1
        by_id = {f"trl-{self.num_calls}-{i}": self.rows[r] for i, r in enumerate(row_index)}
        items = [self.builder(item_id, row, common_pb2.Sequence(output_text=completion_text(completion),
                                                                 output_ids=ids))
                 for (item_id, row), completion, ids in zip(by_id.items(), completions, completion_ids, strict=True)]
        scored = scored_results(self.client.score(items), by_id)
        self.num_unscored += len(by_id) - len(scored)
        # an unscorable completion (a verifier timeout) gets 0: TRL has no way to leave it out of its group
        return [scored[i].reward if i in scored else 0.0 for i in by_id]


def evaluate(model: Any, tokenizer: Any, rows: list[PromptRow], config: TtaConfig, reward: RewardClient,
             builder: RewardItemBuilder, step: int) -> tuple[float | None, float | None]:
    """(avg@k at the training temperature, greedy accuracy) on the held-out rows."""
    import torch

    model.eval()
    requests = {True: [(f"eval{step}-s{i}-{k}", row) for i, row in enumerate(rows) for k in range(config.eval_samples)],
                False: [(f"eval{step}-g{i}", row) for i, row in enumerate(rows)]}
    by_id = {item_id: row for todo in requests.values() for item_id, row in todo}
    outputs: dict[str, common_pb2.Sequence] = {}
    with torch.no_grad():
        for sample, todo in requests.items():
            for start in range(0, len(todo), EVAL_GENERATE_BATCH):
                chunk = todo[start:start + EVAL_GENERATE_BATCH]
                sequences = _generate(model, tokenizer, [row for _, row in chunk], config, sample)
                outputs.update(zip((item_id for item_id, _ in chunk), sequences, strict=True))
    model.train()
    results = reward.score([builder(i, row, outputs[i]) for i, row in by_id.items()])
    scored = scored_results(results, by_id)

    def accuracy(prefix: str) -> float | None:
        scores = [correctness(r) for i, r in scored.items() if i.startswith(prefix)]
        return sum(scores) / len(scores) if scores else None

    return accuracy(f"eval{step}-s"), accuracy(f"eval{step}-g")


def _generate(model: Any, tokenizer: Any, rows: list[PromptRow], config: TtaConfig,
              sample: bool) -> list[common_pb2.Sequence]:
    import torch

    width = max(len(r.prompt_ids) for r in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(r.prompt_ids)) + list(r.prompt_ids) for r in rows])
    attention = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows])
    options: dict[str, Any] = ({"do_sample": True, "temperature": config.temperature, "top_k": 0, "top_p": 1.0}
                               if sample else {"do_sample": False})
    eos = stop_token_ids(model, tokenizer)
    generated = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=config.max_new_tokens,
                               pad_token_id=pad, eos_token_id=eos, **options)
    sequences = []
    for ids in generated[:, width:].tolist():
        end = next((i for i, token in enumerate(ids) if token in eos), None)
        if end is not None:
            ids = ids[: end + 1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        sequences.append(common_pb2.Sequence(output_text=text, output_ids=ids))
    return sequences


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """The ids that end a response: the model's generation_config's (SmolLM2: <|im_end|> and <|endoftext|>, as
    everstep's engine stops), else the tokenizer's eos."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos)


def completion_text(completion: Any) -> str:
    """A completion's text: TRL hands a string for a plain prompt, [{"role": "assistant", "content": ...}] for a
    conversational one."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content") or "") for m in completion if m.get("role", "assistant") == "assistant")


def conversation(row: PromptRow, system: str | None) -> list[dict[str, str]]:
    """The row's prompt as chat messages, as everstep renders it: its messages (or its string as one user message),
    after the job's `prompt.system` unless the row has a system message of its own."""
    messages = [{"role": m.role, "content": m.content} for m in row.messages] or [{"role": "user",
                                                                                    "content": row.prompt}]
    if system is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[int, ...] | None:
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return tuple(ids["input_ids"])


def trl_prompts(rows: list[PromptRow], tokenizer: Any, system: str | None) -> list[Any]:
    """Each row's prompt as TRL takes it, chosen so that TRL's tokenization gives everstep's prompt ids exactly:
    chat messages (TRL renders them with `apply_chat_template(add_generation_prompt=True)`) when everstep
    rendered the chat template, the string (TRL calls the tokenizer on it) when it tokenized the raw prompt.
    ValueError naming the row when neither matches: the arms would not see the same prompts."""
    prompts: list[Any] = []
    for row in rows:
        messages = conversation(row, system)
        if _chat_ids(tokenizer, messages) == row.prompt_ids:
            prompts.append(messages)
        elif not row.messages and tuple(tokenizer(row.prompt)["input_ids"]) == row.prompt_ids:
            prompts.append(row.prompt)
        else:
            raise ValueError(f"row {row.index}: neither TRL's chat rendering nor its tokenizer call gives everstep's "
                             f"prompt ids {list(row.prompt_ids)}; the arms would not see the same prompts")
    kinds = {isinstance(p, str) for p in prompts}
    if len(kinds) > 1:
        raise ValueError("the rows mix chat and raw prompts; TRL takes one kind per dataset")
    return prompts


def _train_dataset(rows: list[PromptRow], tokenizer: Any, system: str | None) -> Any:
    """The training rows as a `datasets.Dataset`, built column-wise with an explicit fingerprint.

    `Dataset.from_dict` never pickles the rows to fingerprint them, and with caching off no transform
    hashes them later: with the pyarrow here, `datasets`' fingerprinting of a `from_list`/`from_json`
    build can fail to pickle pyarrow's `MonthDayNano` type.
    """
    import datasets

    datasets.disable_caching()
    return datasets.Dataset.from_dict({"prompt": trl_prompts(rows, tokenizer, system),
                                       "row_index": [r.index for r in rows]})


@dataclass(frozen=True, kw_only=True)
class TrlBatching:
    """How the TRL arm cuts a generation round: as many optimizer steps as everstep's trainer takes per step."""

    generation_batch_size: int  # the round: prompts_per_step x G completions
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    num_minibatches: int  # optimizer steps per pass over the round (everstep's trainer.num_minibatches)
    num_iterations: int  # passes over the round (everstep's trainer.ppo_epochs)
    steps: int  # generation rounds

    @property
    def steps_per_generation(self) -> int:
        """What TRL derives from generation_batch_size (one process): per-device batches per round."""
        return self.generation_batch_size // self.per_device_train_batch_size

    @property
    def optimizer_steps_per_step(self) -> int:
        return self.num_minibatches * self.num_iterations

    @property
    def max_steps(self) -> int:
        return self.steps * self.optimizer_steps_per_step


def trl_batching(config: TtaConfig, job: JobSpec) -> TrlBatching:
    batch = config.prompts_per_step * job.algorithm.group_size
    minibatches = job.trainer.num_minibatches
    if batch % minibatches:
        raise ValueError(f"prompts_per_step x group_size ({batch}) must be a multiple of trainer.num_minibatches "
                         f"({minibatches}) for the TRL arms")
    share = batch // minibatches
    micro = min(MICRO_BATCH, share)
    if share % micro:
        raise ValueError(f"prompts_per_step x group_size / num_minibatches ({share}) must be a multiple of {micro} "
                         "for the TRL arms")
    return TrlBatching(generation_batch_size=batch, per_device_train_batch_size=micro,
                       gradient_accumulation_steps=share // micro, num_minibatches=minibatches,
                       num_iterations=job.trainer.ppo_epochs, steps=job.steps)


def grpo_config_kwargs(config: TtaConfig, job: JobSpec, output_dir: str) -> dict[str, Any]:
    """`GRPOConfig`'s arguments for a TRL arm whose everstep counterpart runs ``job``."""
    batching = trl_batching(config, job)
    return dict(
        output_dir=output_dir, max_steps=batching.max_steps, learning_rate=job.trainer.learning_rate,
        # the nearest transformers schedule; `run_trl_arm` replaces it with everstep's exact one (`lr_factor`)
        lr_scheduler_type="cosine", warmup_steps=job.trainer.warmup_steps * batching.optimizer_steps_per_step,
        per_device_train_batch_size=batching.per_device_train_batch_size,
        gradient_accumulation_steps=batching.gradient_accumulation_steps,
        generation_batch_size=batching.generation_batch_size, num_iterations=batching.num_iterations,
        num_generations=job.algorithm.group_size, max_completion_length=job.sampling.max_new_tokens,
        temperature=job.sampling.temperature, top_p=1.0, top_k=0, beta=0.0,
        loss_type="grpo",  # everstep's aggregation, seq-mean-token-mean
        scale_rewards="group", max_grad_norm=job.trainer.max_grad_norm, weight_decay=job.trainer.weight_decay,
        use_cpu=True, bf16=False, gradient_checkpointing=False, seed=job.seed, data_seed=job.seed,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )


def lr_factor(job: JobSpec) -> Callable[[int], float]:
    """The TRL arm's `LambdaLR` factor of optimizer step t: everstep's rate of the step t falls in, over the peak."""
    per_step = optimizer_steps_per_step(job)
    warmup, total = job.trainer.warmup_steps, job.steps

    def factor(t: int) -> float:
        return learning_rate_at(t // per_step, learning_rate=1.0, warmup_steps=warmup, total_steps=total)

    return factor


def lora_config_kwargs(lora: LoraSettings) -> dict[str, Any]:
    """peft `LoraConfig` arguments with everstep's `trainer.lora` (peft's own 'all-linear' shorthand kept)."""
    targets: str | list[str] = ALL_LINEAR if lora.target_modules == [ALL_LINEAR] else list(lora.target_modules)
    return dict(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets, bias="none",
                task_type="CAUSAL_LM")


TRL_SCHEDULE = ("TRL arm: torch LambdaLR per optimizer step t, factor everstep's learning_rate_at(t // optimizer "
                "steps per step, warmup_steps, total_steps = steps) (benchmarks/time_to_accuracy/trl_arm.py "
                "lr_factor), in place of transformers' lr_scheduler_type='cosine'")


def run_trl_arm(config: TtaConfig, arm: Arm, spec: JobSpec, reward_address: str) -> ArmRun:
    started = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if arm.uses_lora != (spec.trainer.lora is not None):
        raise ValueError(f"the {arm.value} arm needs a job spec {'with' if arm.uses_lora else 'without'} trainer.lora")
    torch.set_num_threads(config.threads_per_worker)
    torch.manual_seed(spec.seed)
    data = load_job_data(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    reward = RewardClient(reward_address)
    builder = RewardItemBuilder(spec.reward.verifiers, spec.reward.functions)
    reward_function = MathReward(reward, builder, {r.index: r for r in data.train.rows})
    batching = trl_batching(config, spec)
    per_step = batching.optimizer_steps_per_step
    clock: dict[str, float] = {"start": 0.0, "paused": 0.0}
    curve: list[CurvePoint] = []
    learning_rates: list[float] = []
    policy: dict[str, Any] = {"model": model}  # the PeftModel once the trainer has wrapped it

    def evaluate_at(step: int) -> None:
        t0 = time.monotonic()
        accuracy, greedy = evaluate(policy["model"], tokenizer, data.eval_rows, config, reward, builder, step)
        seconds = 0.0 if step == 0 else t0 - clock["start"] - clock["paused"]
        curve.append(CurvePoint(seconds=round(seconds, 2), step=step, accuracy=accuracy, greedy_accuracy=greedy))
        print(f"  {arm.value} eval at step {step}: avg@{config.eval_samples} {accuracy}, greedy {greedy} "
              f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        if step == 0:
            clock["start"] = time.monotonic()
        else:
            clock["paused"] += time.monotonic() - t0

    class Evaluations(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            evaluate_at(0)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            optimizer = kwargs.get("optimizer")
            if optimizer is not None:  # the rate this optimizer step runs with
                learning_rates.append(float(optimizer.param_groups[0]["lr"]))

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % per_step:  # inside a generation round
                return
            step = state.global_step // per_step  # generation rounds, everstep's steps
            clock["last_step"] = time.monotonic() - clock["start"] - clock["paused"]
            print(f"  {arm.value} step {step}: {clock['last_step']:.1f} s of training", file=sys.stderr, flush=True)
            if (config.eval_every and step % config.eval_every == 0) or step == spec.steps:
                evaluate_at(step)

    class EverstepScheduleTrainer(GRPOTrainer):
        """GRPOTrainer whose learning-rate schedule is everstep's (`lr_factor`)."""

        def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
            if self.lr_scheduler is None:
                self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lr_factor(spec))
                self._created_lr_scheduler = True
            return self.lr_scheduler

    peft_kwargs = lora_config_kwargs(spec.trainer.lora) if spec.trainer.lora is not None else None
    with tempfile.TemporaryDirectory(prefix="tta-trl-") as out:
        args = GRPOConfig(**grpo_config_kwargs(config, spec, out))
        peft_config = None
        if peft_kwargs is not None:
            from peft import LoraConfig

            peft_config = LoraConfig(**peft_kwargs)
        trainer = EverstepScheduleTrainer(model=model, reward_funcs=reward_function, args=args,
                                          train_dataset=_train_dataset(data.train.rows, tokenizer, spec.prompt.system),
                                          processing_class=tokenizer, callbacks=[Evaluations()],
                                          peft_config=peft_config)
        policy["model"] = trainer.model
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        trainer.train()
        steps_per_generation = args.steps_per_generation
        logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    reward.close()
    return ArmRun(arm=arm, curve=curve, train_seconds=round(clock["last_step"], 2),
                  total_seconds=round(time.monotonic() - started, 2), eval_seconds=round(clock["paused"], 2),
                  details={"trained_samples": spec.steps * batching.generation_batch_size,
                           "trl_version": _version("trl"),
                           "optimizer_steps_per_generation": per_step,
                           "trl_steps_per_generation": steps_per_generation,
                           "trl_gradient_accumulation_steps": args.gradient_accumulation_steps,
                           "trl_per_device_train_batch_size": args.per_device_train_batch_size,
                           "trainable_parameters": trainable, "peft_lora_config": peft_kwargs,
                           "reward_first_step": logs[0]["reward"] if logs else None,
                           "reward_last_step": logs[-1]["reward"] if logs else None,
                           "num_unscored": reward_function.num_unscored,
                           "evaluation_generation": "transformers generate"},
                  lr_schedule=lr_schedule_of(spec, implementation=TRL_SCHEDULE, observed=learning_rates,
                                             observed_per="optimizer step"))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.time_to_accuracy.trl_arm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", required=True, choices=[Arm.trl.value, Arm.trl_lora.value], help="which TRL arm")
    p.add_argument("--config", required=True, help="JSON of the benchmark's TtaConfig")
    p.add_argument("--spec", required=True, help="JSON of the job spec whose data and reward the arm uses")
    p.add_argument("--reward", required=True, help="gRPC address of the everstep reward service")
    p.add_argument("--out", required=True, help="where to write the arm's result (JSON)")
    args = p.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    config = TtaConfig.from_json(raw)
    spec = JobSpec.model_validate(json.loads(Path(args.spec).read_text()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_trl_arm(config, Arm(args.arm), spec, args.reward)
    Path(args.out).write_text(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
