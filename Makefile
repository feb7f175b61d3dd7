# The two set-up commands of the README are `make demo` and `make test`; everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Downloads (torch is several GB) are cached outside the repo so a fresh clone installs in minutes.
export PIP_CACHE_DIR ?= $(HOME)/.cache/kembed/pip
export KEMBED_CACHE ?= $(HOME)/.cache/kembed

.PHONY: install demo test lint clean cluster-bins manifests
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -c constraints.txt -e '.[api,trainer,operator,dev]'
	touch $@

demo: install
	$(BIN)/kembed demo

test: install cluster-bins
	$(BIN)/python -m pytest

# The test Kubernetes control plane (etcd, kube-*, kwok, helm) built from Go modules into $(KEMBED_CACHE)/bin.
cluster-bins:
	bash tests/cluster/build.sh

# The CRDs in the Helm chart, generated from the pydantic models (tests/operator/test_manifests.py checks drift).
manifests: install
	$(BIN)/python -m kembed_api.resources --chart helm/kembed

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .kembed .pytest_cache
