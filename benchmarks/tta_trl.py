"""The TRL arm of `benchmarks.time_to_accuracy`: TRL's `GRPOTrainer` on the same model, rows and reward.

    python -m benchmarks.tta_trl --config CONFIG.json --reward HOST:PORT --out RESULT.json

Run by `benchmarks.time_to_accuracy` in its own process (its own torch threads). Needs the optional
benchmark dependency: `pip install -r benchmarks/requirements-trl.txt` (TRL 1.16.0).

- Data: the rows of the everstep sync job's spec, loaded by `load_job_data` (the same prompts and
  held-out prompts; the prompt ids TRL's tokenizer call makes are checked equal to everstep's).
- Per step (one generation round): ``prompts_per_step`` prompts x G completions, and as many optimizer
  steps on them as the everstep arms take (`trainer.num_minibatches` of the sync job's spec), each on an
  equal share (per-device batch up to 64, gradient accumulation to the share). TRL counts
  `steps_per_generation` in per-device batches, so the arm sets `generation_batch_size` to the whole
  round instead and reports the `steps_per_generation` TRL derives. Learning rate constant, as everstep's.
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
from pathlib import Path
from typing import Any

from benchmarks.tta_config import Arm, ArmRun, CurvePoint, TtaConfig
from everstep.v1 import common_pb2
from everstep_controller.data.dataset import PromptRow
from everstep_controller.data.reward_items import RewardItemBuilder
from everstep_controller.run.clients import RewardClient
from everstep_controller.run.evaluation import correctness, scored_results
from everstep_controller.run.job_data import load_job_data
from everstep_controller.spec.job_spec import JobSpec

MICRO_BATCH = 64  # completions per forward/backward; the optimizer step covers the whole generation batch
EVAL_GENERATE_BATCH = 256  # sequences per `generate` call in the evaluation


class MathReward:
    """TRL reward function: each completion scored by the everstep reward service."""

    def __init__(self, client: RewardClient, builder: RewardItemBuilder, rows: dict[int, PromptRow]) -> None:
        self.client, self.builder, self.rows = client, builder, rows
        self.__name__ = "everstep_reward"  # TRL logs each reward function under its name
        self.num_calls = 0
        self.num_unscored = 0

    def __call__(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                 row_index: list[int], **_: Any) -> list[float]:
        self.num_calls += 1
        by_id = {f"trl-{self.num_calls}-{i}": self.rows[r] for i, r in enumerate(row_index)}
        items = [self.builder(item_id, row, common_pb2.Sequence(output_text=text, output_ids=ids))
                 for (item_id, row), text, ids in zip(by_id.items(), completions, completion_ids, strict=True)]
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
    generated = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=config.max_new_tokens,
                               pad_token_id=pad, eos_token_id=tokenizer.eos_token_id, **options)
    sequences = []
    for ids in generated[:, width:].tolist():
        if tokenizer.eos_token_id in ids:
            ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
        text = tokenizer.decode(ids, skip_special_tokens=True)
        sequences.append(common_pb2.Sequence(output_text=text, output_ids=ids))
    return sequences


def _train_dataset(rows: list[PromptRow], tokenizer: Any) -> Any:
    """The training rows as a `datasets.Dataset`, built column-wise with an explicit fingerprint.

    `Dataset.from_dict` never pickles the rows to fingerprint them, and with caching off no transform
    hashes them later: with the pyarrow here, `datasets`' fingerprinting of a `from_list`/`from_json`
    build can fail to pickle pyarrow's `MonthDayNano` type.
    """
    import datasets

    datasets.disable_caching()
    check = rows[:256]
    ids = tokenizer([r.prompt for r in check])["input_ids"]
    for row, row_ids in zip(check, ids, strict=True):
        if tuple(row_ids) != row.prompt_ids:
            raise ValueError(f"row {row.index}: TRL would tokenize the prompt as {row_ids}, everstep as "
                             f"{list(row.prompt_ids)}; the arms would not see the same prompts")
    return datasets.Dataset.from_dict({"prompt": [r.prompt for r in rows], "row_index": [r.index for r in rows]})


def run_trl_arm(config: TtaConfig, spec: JobSpec, reward_address: str) -> ArmRun:
    started = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(config.threads_per_worker)
    torch.manual_seed(config.seed)
    data = load_job_data(spec)
    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    reward = RewardClient(reward_address)
    builder = RewardItemBuilder(spec.reward.verifiers)
    reward_function = MathReward(reward, builder, {r.index: r for r in data.train.rows})
    batch = config.prompts_per_step * config.group_size
    optimizer_steps = spec.trainer.num_minibatches  # per generation round, as the everstep arms take
    if batch % optimizer_steps:
        raise ValueError(f"prompts_per_step x group_size ({batch}) must be a multiple of trainer.num_minibatches "
                         f"({optimizer_steps}) for the TRL arm")
    share = batch // optimizer_steps
    micro = min(MICRO_BATCH, share)
    if share % micro:
        raise ValueError(f"prompts_per_step x group_size / num_minibatches ({share}) must be a multiple of {micro} "
                         "for the TRL arm")
    clock: dict[str, float] = {"start": 0.0, "paused": 0.0}
    curve: list[CurvePoint] = []

    def evaluate_at(step: int) -> None:
        t0 = time.monotonic()
        accuracy, greedy = evaluate(model, tokenizer, data.eval_rows, config, reward, builder, step)
        seconds = 0.0 if step == 0 else t0 - clock["start"] - clock["paused"]
        curve.append(CurvePoint(seconds=round(seconds, 2), step=step, accuracy=accuracy, greedy_accuracy=greedy))
        print(f"  trl eval at step {step}: avg@{config.eval_samples} {accuracy}, greedy {greedy} "
              f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        if step == 0:
            clock["start"] = time.monotonic()
        else:
            clock["paused"] += time.monotonic() - t0

    class Evaluations(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            evaluate_at(0)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step % optimizer_steps:  # inside a generation round
                return
            step = state.global_step // optimizer_steps  # generation rounds, everstep's steps
            clock["last_step"] = time.monotonic() - clock["start"] - clock["paused"]
            print(f"  trl step {step}: {clock['last_step']:.1f} s of training", file=sys.stderr, flush=True)
            if step % config.eval_every == 0 or step == config.steps:
                evaluate_at(step)

    with tempfile.TemporaryDirectory(prefix="tta-trl-") as out:
        args = GRPOConfig(
            output_dir=out, max_steps=config.steps * optimizer_steps, learning_rate=config.learning_rate,
            lr_scheduler_type="constant", per_device_train_batch_size=micro, gradient_accumulation_steps=share // micro,
            generation_batch_size=batch,
            num_generations=config.group_size, max_completion_length=config.max_new_tokens,
            temperature=config.temperature, top_p=1.0, top_k=0, beta=0.0, num_iterations=1,
            loss_type="grpo",  # everstep's aggregation, seq-mean-token-mean
            scale_rewards="group", max_grad_norm=1.0, weight_decay=0.0, warmup_steps=0,
            use_cpu=True, bf16=False, gradient_checkpointing=False, seed=config.seed, data_seed=config.seed,
            logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward_function, args=args,
                              train_dataset=_train_dataset(data.train.rows, tokenizer), processing_class=tokenizer,
                              callbacks=[Evaluations()])
        trainer.train()
        steps_per_generation = args.steps_per_generation
        logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    reward.close()
    return ArmRun(arm=Arm.trl, curve=curve, train_seconds=round(clock["last_step"], 2),
                  total_seconds=round(time.monotonic() - started, 2), eval_seconds=round(clock["paused"], 2),
                  details={"trained_samples": config.steps * batch, "trl_version": _version("trl"),
                           "optimizer_steps_per_generation": optimizer_steps,
                           "trl_steps_per_generation": steps_per_generation,
                           "reward_first_step": logs[0]["reward"] if logs else None,
                           "reward_last_step": logs[-1]["reward"] if logs else None,
                           "num_unscored": reward_function.num_unscored,
                           "evaluation_generation": "transformers generate"})


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tta_trl", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="JSON of the benchmark's TtaConfig")
    p.add_argument("--spec", required=True, help="JSON of the job spec whose data and reward the arm uses")
    p.add_argument("--reward", required=True, help="gRPC address of the everstep reward service")
    p.add_argument("--out", required=True, help="where to write the arm's result (JSON)")
    args = p.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    config = TtaConfig(**{**raw, "arms": tuple(Arm(a) for a in raw["arms"])})
    spec = JobSpec.model_validate(json.loads(Path(args.spec).read_text()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_trl_arm(config, spec, args.reward)
    Path(args.out).write_text(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
