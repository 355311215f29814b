"""The `model` verifier: a Hugging Face sequence-classification reward model (num_labels=1)
scored with torch; its raw output (a logit, unbounded) is the score.

This is the only place in the service that uses torch, an optional extra
(`pip install everstep-reward[model]`): torch and transformers are imported by
`RewardModel.load`, which the server calls only when started with `--reward-model PATH`.
Importing this module costs nothing.

The model reads the prompt and the response together (`RewardItem.prompt`): through the
tokenizer's chat template when it has one (a user turn, then an assistant turn), else as
`prompt + "\\n" + response`; an item without a prompt is scored on its response alone. The text is
truncated from the left, so the response's end (its answer) is what survives.

Items arrive one per scoring thread; a single batcher thread gathers what is waiting (up to
`batch_size`, waiting at most `batch_wait_seconds` for more) into one padded forward pass.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from everstep.v1 import reward_pb2
from everstep_reward.verifiers.base import Outcome, VerifierResult
from everstep_reward.verifiers.params import NoParams, read_params

__all__ = ["ModelVerifier", "RewardModel", "RewardModelSettings"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RewardModelSettings:
    path: str
    """Hugging Face directory of an AutoModelForSequenceClassification with num_labels=1, and its tokenizer."""
    device: str = "cpu"
    """torch device the model runs on."""
    max_tokens: int = 4096
    """Responses are truncated to this many tokens (from the left: the end holds the answer)."""
    batch_size: int = 16
    """Most responses in one forward pass."""
    batch_wait_seconds: float = 0.005
    """How long the batcher waits for more items once one arrived."""
    num_threads: int | None = None
    """torch intra-op threads on CPU (None: torch's default)."""


class RewardModel:
    """A loaded reward model: `score(texts) -> [float]`. Not thread-safe; the batcher serialises calls."""

    def __init__(self, model: Any, tokenizer: Any, settings: RewardModelSettings) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._settings = settings

    @classmethod
    def load(cls, settings: RewardModelSettings) -> RewardModel:
        try:
            import torch
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:
            raise RuntimeError("the model verifier needs the `model` extra: pip install everstep-reward[model]") from e
        if settings.num_threads is not None:
            torch.set_num_threads(settings.num_threads)
        tokenizer = AutoTokenizer.from_pretrained(settings.path)
        model = AutoModelForSequenceClassification.from_pretrained(settings.path)
        if model.config.num_labels != 1:
            raise ValueError(f"reward model {settings.path} has num_labels={model.config.num_labels}; it needs 1")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            # Without it the model cannot find the last real token of a padded row.
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.truncation_side = "left"
        model.to(settings.device).eval()
        log.info("reward model %s loaded on %s", settings.path, settings.device)
        return cls(model, tokenizer, settings)

    def text(self, prompt: str, response: str) -> str:
        """What the model reads for one item."""
        if not prompt:
            return response
        if getattr(self._tokenizer, "chat_template", None):
            return self._tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return f"{prompt}\n{response}"

    def score(self, texts: Sequence[str]) -> list[float]:
        """Raw scores of texts made by `text`."""
        import torch

        batch = self._tokenizer(list(texts), padding=True, truncation=True, max_length=self._settings.max_tokens,
                                return_tensors="pt").to(self._settings.device)
        with torch.inference_mode():
            logits = self._model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return [float(x) for x in logits[:, 0].float().cpu()]


_Request = tuple[str, Future]


class ModelVerifier:
    """Scores the response with the reward model; an error naming `--reward-model` when none is loaded."""

    name = "model"
    params_model = NoParams

    def __init__(self, model: RewardModel | None, *, timeout_seconds: float, batch_size: int = 16,
                 batch_wait_seconds: float = 0.005) -> None:
        self._model = model
        self._timeout_seconds = timeout_seconds
        self._batch_size = batch_size
        self._batch_wait_seconds = batch_wait_seconds
        self._requests: queue.Queue[_Request | None] = queue.Queue()
        self._batcher: threading.Thread | None = None
        if model is not None:
            self._batcher = threading.Thread(target=self._run_batches, name="reward-model-batcher", daemon=True)
            self._batcher.start()

    def score(self, item: reward_pb2.RewardItem, spec: reward_pb2.VerifierSpec) -> VerifierResult:
        read_params(spec, self.params_model())
        if self._model is None:
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_MODEL_UNAVAILABLE,
                                          "no reward model loaded (start the reward service with --reward-model)")
        future: Future[float] = Future()
        self._requests.put((self._model.text(item.prompt, item.response), future))
        try:
            return VerifierResult(future.result(timeout=self._timeout_seconds), outcome=Outcome.SCORED)
        except FutureTimeout:
            future.cancel()  # the batcher skips it if it has not started on it
            return VerifierResult.failure(reward_pb2.REWARD_ERROR_KIND_TIMEOUT, "timeout")

    def close(self) -> None:
        if self._batcher is not None:
            self._requests.put(None)
            self._batcher.join(timeout=10)

    def _run_batches(self) -> None:
        assert self._model is not None
        while True:
            first = self._requests.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self._batch_size:
                try:
                    request = self._requests.get(timeout=self._batch_wait_seconds)
                except queue.Empty:
                    break
                if request is None:
                    stop = True
                    break
                batch.append(request)
            live = [(text, future) for text, future in batch if future.set_running_or_notify_cancel()]
            if live:
                try:
                    scores = self._model.score([text for text, _ in live])
                except Exception as e:  # a bad batch must fail its items, not the batcher
                    log.exception("reward model forward failed")
                    for _, future in live:
                        future.set_exception(e)
                else:
                    for (_, future), value in zip(live, scores, strict=True):
                        future.set_result(value)
            if stop:
                return
