"""The policy trainer: one `train_step` = recompute log-probs, PPO epochs over minibatches of the
batch with the IcePop/TIS-corrected loss of `config.mode` (`losses`), one optimizer step per minibatch, version + 1.

Gradient accumulation over token-budgeted micro-batches divides every micro-batch's loss by the
normaliser of its whole minibatch (samples or tokens, per the aggregation), so the accumulated
gradient equals the gradient of the minibatch loss computed in one piece. The minibatches and micro-batches are
planned in `micro_batches`, the optimizer step is `optim.optimizer_step`, the statistics are made in `stats`.

Several ranks (FSDP2, see `everstep_trainer.model.distributed`): every rank is given the whole batch,
trains on its own disjoint share of the rows (`assign_rows`), and divides by the normaliser of the
whole minibatch, which it computes from the samples' lengths; gradients are summed across ranks,
so the step equals the one-rank step up to floating-point summation order. Every rank runs the same
number of forward/backward passes (a rank with fewer micro-batches adds passes whose loss is
multiplied by 0), because each pass is a collective. Statistics are reduced across ranks.

Routing replay (`TrainerConfig.routing_replay` rollout, MoE models): every forward of the step (the old
log-prob pass, every micro-batch forward/backward, and the KL reference's pass) runs inside
`routing.replay_routes` with the engine's recorded expert sets of the micro-batch's tokens, laid out as the
model sees them (padded or packed, `PaddedBatch.flat_routes`). The old log-prob pass also counts how often
the trainer's own top-k set differs from the engine's (`TrainStats.routing_disagreement`), whether or not
replay is on, whenever the samples carry routes.

LoRA (`TrainerConfig.lora`, `everstep_trainer.model.lora`): the model is wrapped by peft, the base frozen (bfloat16 when
`dtype` is bfloat16 on CUDA, else float32), the adapters float32 and the only parameters the optimizer, FSDP's
gradient reduction and the checkpoints see; `weights_to_push` gives the adapters alone. The KL reference, when it
is the base (as it is for a job), is the policy with its adapters disabled, not a second model.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from everstep.settings.training import RoutingReplay, TrainerConfig
from everstep_trainer.batch.samples import PaddedBatch, RouteSpec, TrainSample, pad_samples, validate_samples
from everstep_trainer.batch.shared_prompts import SharedPromptRows
from everstep_trainer.model.checkpoint import (
    CheckpointMeta,
    RngStates,
    config_differences,
    read_checkpoint_meta,
    read_trainer_state,
    write_checkpoint_dir,
)
from everstep_trainer.model.distributed import (
    RankContext,
    all_reduce_max,
    all_reduce_sum,
    assign_rows,
    full_model_state_dict,
    full_optimizer_state_dict,
    full_trainable_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
    parallelize,
)
from everstep_trainer.model.hf_model import (
    Layout,
    autocast_context,
    check_packing_supported,
    compute_token_logprobs,
    compute_token_logprobs_and_entropy,
    copy_tokenizer_files,
    load_causal_lm,
    save_hf_checkpoint,
)
from everstep_trainer.model.lora import (
    AdapterWeights,
    adapter_dropout,
    adapter_weights,
    apply_lora,
    is_adapter_dir,
    load_adapter_state,
    save_adapter_dir,
)
from everstep_trainer.model.routing import RouteCounts, check_replay_supported, replay_routes, route_spec
from everstep_trainer.step.losses import (
    MismatchSums,
    adaptive_kl_coef,
    aggregate_token_loss,
    kl_divergence,
    mismatch_sums,
    staleness_masks,
    token_policy_loss,
)
from everstep_trainer.step.micro_batches import (
    minibatch_normalizer,
    plan_micro_batches,
    shuffled_minibatches,
)
from everstep_trainer.step.optim import build_adamw, learning_rate_at, optimizer_step, set_learning_rate
from everstep_trainer.step.reference_kl import ReferenceKl, sequence_kl_sums
from everstep_trainer.step.stats import PassSums, RoutingSums, TrainStats, train_stats

__all__ = ["PolicyTrainer", "WeightsToPush"]

log = logging.getLogger(__name__)

# The reference-KL log-ratio is clamped here so that one far-off token cannot make the loss inf.
_MAX_REFERENCE_LOG_RATIO = 20.0


@dataclass(frozen=True)
class WeightsToPush:
    """What a weight push carries: every weight (full fine-tuning), or the LoRA adapters alone."""

    tensors: dict[str, Tensor]
    """HF parameter names, or (adapter) "<module>.lora_A" / "<module>.lora_B"; empty on ranks other than 0."""
    adapter: AdapterWeights | None = None
    """Set for a LoRA trainer: its rank and alpha (its tensors are `tensors`)."""


class PolicyTrainer:
    """Owns the policy model, the optional frozen reference and the optimizer of one job (on one rank).

    With several ranks every public method is a collective: call it on every rank, in the same order
    and with the same arguments (`everstep_trainer.rank_commands` does that for the gRPC server).
    """

    def __init__(self, model_dir: str | Path, config: TrainerConfig, *, version: int = 0,
                 device: torch.device | str | None = None, ranks: RankContext | None = None,
                 reference_model_dir: str | Path | None = None) -> None:
        """`reference_model_dir`: the frozen KL reference (default `model_dir`; a resumed job passes
        its initial model). `ranks`: default, the current process group (or a single rank)."""
        self.config = config
        self.model_dir = Path(model_dir)
        self.reference_model_dir = Path(reference_model_dir) if reference_model_dir is not None else self.model_dir
        self.ranks = ranks if ranks is not None else RankContext.current()
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        if config.dtype == "bfloat16" and self.device.type != "cuda":
            log.warning("dtype=bfloat16 is ignored on %s: autocast is used on CUDA only, computing in float32",
                        self.device)
        torch.manual_seed(config.seed)
        if config.lora is None:
            self.model = load_causal_lm(self.model_dir, device=self.device)
        else:
            base_dtype = torch.bfloat16 if config.dtype == "bfloat16" and self.device.type == "cuda" else torch.float32
            self.model = apply_lora(load_causal_lm(self.model_dir, device=self.device, dtype=base_dtype), config.lora)
        self.reference: torch.nn.Module | None = None
        # A LoRA policy whose KL reference is its own base scores the reference with its adapters off: no second
        # copy of the model (`_reference_logp`).
        self._reference_is_base = (config.lora is not None and config.kl_coef > 0
                                   and self.reference_model_dir.resolve() == self.model_dir.resolve())
        if config.kl_coef > 0 and not self._reference_is_base:
            self.reference = load_causal_lm(self.reference_model_dir, device=self.device)
            self.reference.requires_grad_(False)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        self.num_parameters = sum(p.numel() for p in self.model.parameters())
        self.num_trainable_parameters = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self._adapter_dropout = adapter_dropout(self.model, config.lora)
        self.replay = config.routing_replay == RoutingReplay.rollout
        if self.replay:
            check_replay_supported(self.model)  # before sharding: it calls the routers on their own
            if self.reference is not None:
                check_replay_supported(self.reference)
                if route_spec(self.reference) != route_spec(self.model):
                    raise ValueError("config.routing_replay: the KL reference model routes differently from the "
                                     "policy (MoE layers, top_k, experts); replay needs one layout for both")
        self.routing: RouteSpec | None = route_spec(self.model, required=self.replay)
        """The layout of the samples' routes (None: a dense model, whose samples' routes are ignored)."""
        if self.ranks.is_distributed:
            parallelize(self.model)
            if self.reference is not None:
                parallelize(self.reference)
        self.optimizer = build_adamw(self.model, learning_rate=config.learning_rate,
                                     weight_decay=config.weight_decay)
        self.version = version
        self.num_train_steps = 0
        self.kl_coef = config.kl_coef
        """The KL coefficient of the next step: config.kl_coef, adapted after every step with config.kl_target."""
        self._reward_kl: ReferenceKl | None = None
        """kl_in_reward: what `reference_kl` measured since the last train step (the step adapts kl_coef with it)."""
        self._shuffle = torch.Generator().manual_seed(config.seed)
        pad = getattr(self.model.config, "pad_token_id", None)
        self.pad_token_id = pad if isinstance(pad, int) else 0
        if config.packing:
            check_packing_supported(self.model, pad_token_id=self.pad_token_id, device=self.device,
                                    share_prompts=config.share_prompts)

    # -- weights and checkpoints ------------------------------------------------------------------------

    def full_state_dict(self) -> dict[str, Tensor]:
        """The full state dict (HF parameter names; with LoRA, peft's names of the adapters only) on rank 0, {} on
        the other ranks (a collective)."""
        if self.config.lora is not None:
            return full_trainable_state_dict(self.model, self.ranks)
        return full_model_state_dict(self.model, self.ranks)

    def weights_to_push(self) -> WeightsToPush:
        """What a push sends (a collective): the full state dict, or with LoRA the adapters by the names the
        engines take (`everstep_trainer.model.lora`)."""
        state = self.full_state_dict()
        if self.config.lora is None:
            return WeightsToPush(state)
        adapter = adapter_weights(state, self.config.lora)
        return WeightsToPush(adapter.tensors, adapter)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """The state dict, as the rollout engines load it (with LoRA: the adapters, see `weights_to_push`); empty
        on ranks other than 0. With several ranks the full state dict is gathered when iteration starts (a
        collective)."""
        yield from self.weights_to_push().tensors.items()

    def save_checkpoint(self, out_dir: str | Path, *, data_position: str = "") -> Path:
        """Write the model (HF format) and everything an exact resume needs; see `everstep_trainer.model.checkpoint`.

        A collective: every rank gathers, rank 0 writes. `data_position` is stored as given and
        returned by `resume`."""
        model_state = self.full_state_dict()
        optimizer_state = full_optimizer_state_dict(self.model, self.optimizer)
        out_dir = Path(out_dir).absolute()
        if self.ranks.is_main:
            lora = self.config.lora is not None
            meta = CheckpointMeta(train_step=self.num_train_steps, version=self.version, data_position=data_position,
                                  world_size=self.ranks.world_size,
                                  reference_model_path=str(self.reference_model_dir.absolute()), config=self.config,
                                  base_model_path=str(self.model_dir.absolute()) if lora else "",
                                  kl_coef=self.kl_coef if self.config.kl_target is not None else None)

            def write_model(directory: Path) -> None:
                if lora:
                    save_adapter_dir(self.model, model_state, directory, base_model_path=self.model_dir)
                    copy_tokenizer_files(self.model_dir, directory)
                else:
                    save_hf_checkpoint(self.model, self.model_dir, directory, state_dict=model_state)

            write_checkpoint_dir(out_dir, optimizer_state=optimizer_state, rng=RngStates.capture(self._shuffle),
                                 meta=meta, write_model=write_model)
        if self.ranks.is_distributed:
            torch.distributed.barrier()  # no rank returns before the checkpoint is complete
        return out_dir

    @classmethod
    def resume(cls, path: str | Path, config: TrainerConfig | None = None, *,
               device: torch.device | str | None = None,
               ranks: RankContext | None = None) -> tuple[PolicyTrainer, CheckpointMeta]:
        """A trainer in the state `save_checkpoint` recorded: weights, AdamW state, RNG streams,
        train step and version. `config` (default: the saved one) may change settings; each change is
        logged. The next train step on the same batch equals that of the uninterrupted run."""
        path = Path(path)
        meta = read_checkpoint_meta(path)
        if config is None:
            config = meta.config
        else:
            for change in config_differences(meta.config, config):
                log.warning("resuming %s with a changed setting: %s", path, change)
        if config.kl_coef > 0 and not Path(meta.reference_model_path).is_dir():
            raise ValueError(f"path: {path} needs its KL reference model at {meta.reference_model_path}, "
                             "which is not a directory")
        adapters = is_adapter_dir(path)
        if adapters != (config.lora is not None) or (adapters and config.lora != meta.config.lora):
            raise ValueError(f"config.lora: {path} holds {'LoRA adapters' if adapters else 'full weights'} "
                             f"(lora {meta.config.lora}); resuming it needs the same lora settings, not "
                             f"{config.lora}")
        trainer = cls(meta.base_model_path if adapters else path, config, version=meta.version, device=device,
                      ranks=ranks, reference_model_dir=meta.reference_model_path)
        if adapters:
            load_full_model_state_dict(trainer.model, load_adapter_state(path))
        optimizer_state, rng = read_trainer_state(path)
        load_full_optimizer_state_dict(trainer.model, trainer.optimizer, optimizer_state)
        rng.restore(trainer._shuffle)
        trainer.num_train_steps = meta.train_step
        if meta.kl_coef is not None and config.kl_target is not None:
            trainer.kl_coef = meta.kl_coef  # as adapted by the saved run's steps
        return trainer, meta

    # -- the train step ---------------------------------------------------------------------------------

    def check_samples(self, samples: Sequence[TrainSample], *, training: bool = True) -> None:
        """ValueError naming the field unless `train_step` (or, not `training`, `reference_kl`) can take `samples`
        (no collective: rank 0 calls it alone before handing a batch to every rank)."""
        validate_samples(samples, vocab_size=self.vocab_size, routing=self.routing)
        if len(samples) < self.ranks.world_size:
            raise ValueError(f"samples: a batch of {len(samples)} cannot give each of the "
                             f"{self.ranks.world_size} trainer ranks a sample")
        if not training and not self.config.kl_in_reward:
            raise ValueError("kl_in_reward: the trainer's KL term is in the loss (kl_in_reward false, kl_coef "
                             f"{self.config.kl_coef}); ReferenceKl serves a trainer loaded with kl_in_reward true")
        if training and self.config.num_minibatches > len(samples):
            raise ValueError(f"num_minibatches: {self.config.num_minibatches} exceeds the batch size {len(samples)}")

    def train_step(self, samples: Sequence[TrainSample]) -> tuple[int, TrainStats]:
        """Train on one batch (the whole batch, on every rank); returns the new policy version and
        the step's statistics (over the whole batch)."""
        cfg = self.config
        self.check_samples(samples)
        learning_rate = learning_rate_at(self.num_train_steps, learning_rate=cfg.learning_rate,
                                         warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps,
                                         schedule=cfg.lr_schedule, min_lr_ratio=cfg.min_lr_ratio)
        set_learning_rate(self.optimizer, learning_rate)
        own_rows = assign_rows([s.num_tokens for s in samples], self.ranks)
        local_row = {row: i for i, row in enumerate(own_rows)}
        num_outputs = [len(s.output_ids) - sum(s.output_tool_mask) for s in samples]  # the trained tokens
        batch = pad_samples([samples[row] for row in own_rows], pad_token_id=self.pad_token_id, device=self.device,
                            routing=self.routing)

        start = self._now()
        counts = RouteCounts()
        old_logp = self._score(self.model, batch, counts)
        reference_logp = None if cfg.kl_in_reward else self._reference_logp(batch)  # the loss's KL term
        logp_seconds = self._now() - start
        routing = RoutingSums(*all_reduce_sum(list(counts.sums()), self.ranks, self.device))
        mismatch = self._reduce_mismatch(mismatch_sums(old_logp, batch.rollout_logp, batch.output_mask,
                                                       alpha=cfg.alpha, beta=cfg.beta))
        fresh_mask, stale_mask = staleness_masks(batch.output_mask, batch.output_versions, self.version)
        fresh, stale = (self._reduce_mismatch(mismatch_sums(old_logp, batch.rollout_logp, group,
                                                            alpha=cfg.alpha, beta=cfg.beta))
                        for group in (fresh_mask, stale_mask))

        forward_backward_seconds = optimizer_seconds = 0.0
        results: list[PassSums] = []
        grad_norms: list[float] = []
        for _ in range(cfg.ppo_epochs):
            for minibatch in shuffled_minibatches(len(samples), cfg.num_minibatches, self._shuffle):
                normalizer = minibatch_normalizer([num_outputs[row] for row in minibatch], cfg.aggregation,
                                                  max_new_tokens=cfg.max_new_tokens)
                local = [local_row[row] for row in minibatch if row in local_row]
                start = self._now()
                results.append(self._accumulate_gradients(batch, local, normalizer, old_logp, reference_logp))
                forward_backward_seconds += self._now() - start
                start = self._now()
                grad_norms.append(optimizer_step(self.model, self.optimizer, max_grad_norm=cfg.max_grad_norm))
                optimizer_seconds += self._now() - start

        self.num_train_steps += 1
        self.version += 1
        passes = PassSums(*all_reduce_sum(PassSums.total(results).values(), self.ranks, self.device))
        step_kl_coef = self.kl_coef
        self._adapt_kl_coef(passes, len(samples))
        stats = train_stats(
            passes=passes, kl_coef=0.0 if cfg.kl_in_reward else step_kl_coef,
            num_optimizer_steps=len(results), grad_norms=grad_norms, mismatch=mismatch, fresh=fresh, stale=stale,
            routing=routing, learning_rate=learning_rate, num_tokens=sum(num_outputs), logp_seconds=logp_seconds,
            forward_backward_seconds=forward_backward_seconds, optimizer_seconds=optimizer_seconds)
        return self.version, stats

    def _adapt_kl_coef(self, passes: PassSums, num_samples: int) -> None:
        """kl_target: the next step's coefficient, from the KL of this step's loss (`passes`), or with kl_in_reward
        from what `reference_kl` measured for this step's rewards (none measured: kept)."""
        cfg, measured, self._reward_kl = self.config, self._reward_kl, None
        if cfg.kl_target is None:  # with it kl_coef > 0, so there is a reference
            return
        if not cfg.kl_in_reward:
            kl, num_samples = passes.kl_sum / max(passes.num_tokens, 1), num_samples
        elif measured is not None:
            kl, num_samples = measured.kl_mean, len(measured.kl_sums)
        else:
            log.warning("kl_in_reward: a train step without ReferenceKl before it; kl_coef %g kept", self.kl_coef)
            return
        self.kl_coef = adaptive_kl_coef(self.kl_coef, kl, target=cfg.kl_target, horizon=cfg.kl_horizon,
                                        num_samples=num_samples)

    def reference_kl(self, samples: Sequence[TrainSample]) -> ReferenceKl:
        """kl_in_reward: each sample's KL to the reference under the current weights (`step.reference_kl`), with the
        coefficient of this step; the next `train_step` adapts the coefficient (kl_target) with it. A collective:
        each rank scores its own rows of the batch."""
        own_rows = assign_rows([s.num_tokens for s in samples], self.ranks)
        batch = pad_samples([samples[row] for row in own_rows], pad_token_id=self.pad_token_id, device=self.device,
                            routing=self.routing)
        sums = sequence_kl_sums(self._score(self.model, batch), self._reference_logp(batch), batch.output_mask,
                                self.config.kl_estimator, max_log_ratio=_MAX_REFERENCE_LOG_RATIO).tolist()
        by_row = [0.0] * len(samples)
        for local, row in enumerate(own_rows):
            by_row[row] = sums[local]
        num_tokens = sum(len(s.output_ids) - sum(s.output_tool_mask) for s in samples)
        self._reward_kl = ReferenceKl(kl_sums=all_reduce_sum(by_row, self.ranks, self.device),
                                      kl_coef=self.kl_coef, num_tokens=num_tokens)
        return self._reward_kl

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _reduce_mismatch(self, sums: MismatchSums) -> MismatchSums:
        if not self.ranks.is_distributed:
            return sums
        num_valid, num_masked, k3_sum, diff_sum = all_reduce_sum(
            [sums.num_valid, sums.num_masked, sums.k3_sum, sums.logp_diff_abs_sum], self.ranks, self.device)
        (diff_max,) = all_reduce_max([sums.logp_diff_max], self.ranks, self.device)
        return MismatchSums(num_valid=int(num_valid), num_masked=int(num_masked), k3_sum=k3_sum,
                            logp_diff_abs_sum=diff_sum, logp_diff_max=diff_max)

    def _routing(self, model: torch.nn.Module, micro: PaddedBatch, packed: Layout | None,
                 counts: RouteCounts | None = None) -> contextlib.AbstractContextManager:
        """Routing replay (and, with `counts`, the disagreement count) for one forward of `model` on `micro`
        (laid out as `packed`, or padded); a no-op without replay and counts, or without routes."""
        flat = micro.flat_routes(packed) if self.routing is not None else None
        if flat is None or not (self.replay or counts is not None):
            return contextlib.nullcontext()
        if counts is not None:
            counts.stale = micro.flat_stale_routes(self.version, packed)
            counts.multiplicity = packed.multiplicity() if isinstance(packed, SharedPromptRows) else None
        return replay_routes(model, *flat, replay=self.replay, counts=counts)

    def _reference_logp(self, batch: PaddedBatch) -> Tensor | None:
        """[B, L] log-probs under the KL reference (None without one); a LoRA policy's base is the policy with its
        adapters disabled."""
        if self._reference_is_base:
            with self.model.disable_adapter():
                return self._score(self.model, batch)
        return self._score(self.reference, batch) if self.reference is not None else None

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, batch: PaddedBatch, counts: RouteCounts | None = None) -> Tensor:
        """[B, L] log-probs of the output tokens under `model`, without gradient (with routing replay on, under
        the batch's routes); `counts`: count the routing disagreement of the real passes."""
        logp = torch.zeros_like(batch.rollout_logp)
        for pass_ in plan_micro_batches(batch, list(range(len(batch))), self.config, self.ranks, self.device):
            micro, packed = pass_.select(batch, self.pad_token_id)
            routing = self._routing(model, micro, packed, counts if pass_.real else None)
            with routing, autocast_context(self.device, self.config.dtype):
                micro_logp = compute_token_logprobs(model, micro.input_ids, micro.attention_mask,
                                                    micro.output_mask, self.config.temperature, packed=packed)
            if pass_.real:
                rows = torch.as_tensor(pass_.rows, device=self.device)
                logp[rows, : micro_logp.shape[1]] = micro_logp.float()
        return logp

    def _accumulate_gradients(self, batch: PaddedBatch, indices: Sequence[int], normalizer: int, old_logp: Tensor,
                              reference_logp: Tensor | None) -> PassSums:
        cfg = self.config
        result = PassSums()
        for pass_ in plan_micro_batches(batch, indices, self.config, self.ranks, self.device):
            micro, packed = pass_.select(batch, self.pad_token_id)
            rows, length = torch.as_tensor(pass_.rows, device=self.device), micro.input_ids.shape[1]
            with (self._routing(self.model, micro, packed), autocast_context(self.device, cfg.dtype),
                  self._adapter_dropout):
                logp, entropy = compute_token_logprobs_and_entropy(
                    self.model, micro.input_ids, micro.attention_mask, micro.output_mask, cfg.temperature,
                    differentiable_entropy=cfg.entropy_coef > 0, packed=packed)
            token_loss = token_policy_loss(logp, old_logp[rows, :length], micro.rollout_logp, micro.advantages,
                                           micro.output_mask, cfg)
            per_token = token_loss.per_token
            kl = None
            if reference_logp is not None:
                kl = kl_divergence(reference_logp[rows, :length] - logp, cfg.kl_estimator,
                                   max_log_ratio=_MAX_REFERENCE_LOG_RATIO)
                per_token = per_token + self.kl_coef * kl
            if cfg.entropy_coef > 0:
                per_token = per_token - cfg.entropy_coef * entropy
            loss = aggregate_token_loss(per_token, micro.output_mask, cfg.aggregation, normalizer=normalizer)
            if not pass_.real:
                (loss * 0.0).backward()  # a collective pass that contributes nothing
                continue
            loss.backward()
            result.loss += float(loss.detach())
            result.num_tokens += int(micro.output_mask.sum())
            result.num_clipped += int(token_loss.clipped.sum())
            result.entropy_sum += float(entropy.detach()[micro.output_mask].sum())
            if kl is not None:
                result.kl_sum += float(kl.detach()[micro.output_mask].sum())
            result.computed_positions += (packed or micro).input_ids.numel()
            result.real_positions += int(micro.attention_mask.sum())
            result.distinct_positions += (packed.num_real_positions if isinstance(packed, SharedPromptRows)
                                          else int(micro.attention_mask.sum()))
        return result
