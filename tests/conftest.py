"""Fixtures shared by every test package: real things, built small.

- `tiny_model_dir`: a randomly initialised Llama of ~100k parameters with a word-level
  tokenizer, saved in Hugging Face format (config.json, model.safetensors, tokenizer.json).
- `free_port`: a TCP port nobody listens on.
- `demo_model_build`: the demo model, built in the background from `make test`'s start (or
  pytest's collection) on; the tests that need it run last, so the build overlaps the rest.
- `service_process`: starts `python -m everstep_<name>` as a real process in its own
  process group, waits until its gRPC health check (or HTTP /healthz) says SERVING,
  and stops that process group, and only it, at teardown.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from demo_model_build import EXIT_FILE, PID_FILE

from everstep.processes import free_port as free_tcp_port


class DemoModelBuild:
    """The demo model of the end-to-end tests (tests/demo_model_build.py), built in the background.

    Adopted from `make test`, which started it before its last installs (`EVERSTEP_TEST_DEMO_MODEL`
    names its folder; scripts/test.sh owns and stops it), or else started here, at a lower CPU
    priority and in its own process group, which `close` kills.
    """

    def __init__(self) -> None:
        adopted = os.environ.get("EVERSTEP_TEST_DEMO_MODEL")
        self.process: subprocess.Popen | None = None
        if adopted:
            self.out = Path(adopted)
            self.log_path = self.out.with_suffix(".log")
            return
        self.out = Path(tempfile.mkdtemp(prefix="everstep-demo-model-"))
        self.log_path = self.out.with_suffix(".log")
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).with_name("demo_model_build.py")), str(self.out)],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=lambda: os.nice(10))

    def wait(self, timeout_seconds: float = 900) -> Path:
        deadline = time.monotonic() + timeout_seconds
        exit_file = self.out / EXIT_FILE
        while not exit_file.exists():
            if not self._running():
                time.sleep(0.5)  # it may have ended between the two checks
                if not exit_file.exists():
                    raise RuntimeError(f"the demo model build died:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the demo model build ran past {timeout_seconds} s:\n{self._log_tail()}")
            time.sleep(1)
        if (status := exit_file.read_text().strip()) != "0":
            raise RuntimeError(f"the demo model build failed ({status}):\n{self._log_tail()}")
        return self.out

    def _running(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        pid_file = self.out / PID_FILE
        if not pid_file.exists():
            return True  # make test started it a moment ago
        try:
            os.kill(int(pid_file.read_text()), 0)
        except ProcessLookupError:
            return False
        return True

    def _log_tail(self) -> str:
        return self.log_path.read_text()[-4000:] if self.log_path.exists() else "(no log)"

    def close(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        shutil.rmtree(self.out, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)


DEMO_BUILD = pytest.StashKey[DemoModelBuild]()


STACK_FOLDERS = ("e2e", "benchmarks")
"""Folders of tests/ whose tests carry the `stack` marker (`make test-stack`)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks the tests of STACK_FOLDERS `stack` before `-m` selects, so that no file can forget it."""
    tests_dir = Path(__file__).parent
    for item in items:
        relative = item.path.relative_to(tests_dir) if item.path.is_relative_to(tests_dir) else None
        if relative is not None and relative.parts[0] in STACK_FOLDERS:
            item.add_marker(pytest.mark.stack)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Tests that need the demo model go last, and its build starts now, in the background; only when
    `-m` kept one of them."""
    config, items = session.config, session.items
    needs_model = [item for item in items if "demo_model_build" in getattr(item, "fixturenames", ())]
    if needs_model and DEMO_BUILD not in config.stash:
        items[:] = [item for item in items if item not in needs_model] + needs_model
        config.stash[DEMO_BUILD] = DemoModelBuild()


def pytest_unconfigure(config: pytest.Config) -> None:
    if DEMO_BUILD in config.stash:
        config.stash[DEMO_BUILD].close()


@pytest.fixture(scope="session")
def demo_model_build(request: pytest.FixtureRequest) -> DemoModelBuild:
    """The demo model's build; `.wait()` gives its folder once it is done."""
    return request.config.stash[DEMO_BUILD]


TINY_WORDS = ["<pad>", "<s>", "</s>", "<unk>", "+", "-", "=", ",", "\\boxed{", "}", "\n"] + [
    str(i) for i in range(40)
]


@pytest.fixture
def free_port() -> int:
    return free_tcp_port()


TINY_ARCHITECTURES = ("llama", "llama3", "qwen2", "qwen3", "qwen3_moe")
"""What `make_tiny_model` builds: Llama (default RoPE), Llama 3.1+ (llama3 rope scaling), Qwen2 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE (8 experts, top-2, norm_topk_prob; every layer sparse)."""


def make_tiny_model(out: Path, *, seed: int = 0, num_layers: int = 2, hidden: int = 64,
                    architecture: str = "llama") -> Path:
    """A random tiny causal LM of `architecture` (TINY_ARCHITECTURES) + word-level fast tokenizer, in Hugging
    Face format, from transformers' own modeling code."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {w: i for i, w in enumerate(TINY_WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    fast.save_pretrained(out)
    common = dict(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  tie_word_embeddings=False)
    kinds = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": hidden // 4}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
            "head_dim": hidden // 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": hidden,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    }
    if architecture not in kinds:
        raise ValueError(f"architecture: one of {TINY_ARCHITECTURES}, got {architecture!r}")
    config_name, model_name, extra = kinds[architecture]
    config = getattr(transformers, config_name)(**common, **extra)
    torch.manual_seed(seed)
    getattr(transformers, model_name)(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """architecture -> a tiny random model of it (built once per session)."""
    built: dict[str, Path] = {}

    def get(architecture: str) -> Path:
        if architecture not in built:
            built[architecture] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{architecture}"),
                                                  architecture=architecture)
        return built[architecture]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


def wait_grpc_serving(address: str, timeout_seconds: float, process: subprocess.Popen | None = None) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_seconds
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"service at {address} exited with {process.returncode}")
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.RpcError as e:
            last_error = e
        time.sleep(0.1)
    raise TimeoutError(f"service at {address} not SERVING after {timeout_seconds}s: {last_error}")


@pytest.fixture
def service_process(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(name: str, *extra_args: str, env: dict[str, str] | None = None,
              ready_timeout_seconds: float = 60.0) -> ServiceProcess:
        http_port, grpc_port = free_tcp_port(), free_tcp_port()
        log_path = tmp_path / f"{name}-{len(started)}.log"
        cmd = [sys.executable, "-m", f"everstep_{name}", "--host", "127.0.0.1",
               "--port", str(http_port), "--grpc-port", str(grpc_port), *extra_args]
        with log_path.open("w") as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, **(env or {})})
        service = ServiceProcess(name, process, http_port, grpc_port, log_path)
        started.append(service)
        try:
            wait_grpc_serving(service.grpc_address, ready_timeout_seconds, process)
        except Exception as e:
            raise RuntimeError(f"{name} did not become ready: {e}\n--- log ---\n{service.log()}") from e
        return service

    yield start
    for service in reversed(started):
        service.stop()
