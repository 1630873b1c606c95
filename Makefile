# Rhapsode: `make test` builds the project's virtualenv when needed and runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test unit integration venv serve bench openapi clean

$(STAMP): setup.cfg pyproject.toml engines/tone/setup.cfg
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]' -e engines/tone
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

unit: $(STAMP)
	$(PY) -m pytest tests/unit

integration: $(STAMP)
	$(PY) -m pytest tests/integration

# A tone worker on TCP port 8080: curl it (README).
serve: $(STAMP)
	RHAPSODE_WORKER_LISTEN=tcp:127.0.0.1:8080 RHAPSODE_WORKER_ENGINE=tone \
	RHAPSODE_WORKER_CONTRACT=1 $(PY) -m rhapsode_engine_tone

bench: $(STAMP)
	$(PY) bench/worker.py

openapi: $(STAMP)
	$(PY) -m rhapsode_worker.contract > docs/openapi.worker.yaml

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
