# hvd_train: each target is the documentation of how to do it. Variables: NP, LAUNCHER, STACK, VENV.
SHELL := /bin/bash
# STACK=classic: TensorFlow 2.15 + Keras 2 in .venv-classic; modern (TensorFlow 2.21 + Keras 3) in
# .venv. An existing VENV keeps the stack it was installed with (VENV=.venv-classic make train).
STACK ?=
VENV ?= $(if $(filter classic,$(STACK)),.venv-classic,.venv)
PY := $(VENV)/bin/python
NP ?= 2
LAUNCHER ?= mpirun

.PHONY: help install train example test test-full container-test test-unit test-parallel test-cluster bench plan lint format doctor nccl-check

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

install: ## set up OpenMPI, the venv and Horovod (idempotent: seconds once built); STACK=classic
	STACK=$(STACK) VENV=$(VENV) bash mpi_scripts/install.sh

RUN_DIR ?= runs/digits

train: install ## the main job: configs/digits.yaml on NP workers under LAUNCHER, into RUN_DIR
	PATH=$(VENV)/bin:$$PATH timeout 900 $(VENV)/bin/hvd-train launch --np $(NP) \
	  --launcher $(LAUNCHER) -- train --config configs/digits.yaml --set run_dir=$(RUN_DIR) --overwrite

example: install ## the API example: a plain Keras script distributed in a few lines
	NP=$(NP) LAUNCHER=$(LAUNCHER) TIMEOUT=900 bash mpi_scripts/run.sh examples/keras_digits.py

test: ## install, then every test tier, with a table of stage times at the end
	bash tests/run.sh

HOROVOD_SRC ?=

test-full: ## make test, then what CI has neither the time nor the network for (HOROVOD_SRC=a Horovod clone)
	@[ -n "$(HOROVOD_SRC)" ] || { echo "test-full: HOROVOD_SRC= must name a Horovod source tree \
	  (git clone https://github.com/horovod/horovod): its examples run against hvd_train.horovod"; exit 2; }
	HVD_TRAIN_FULL=1 bash tests/run.sh
	HVD_TRAIN_HOROVOD_SRC=$(HOROVOD_SRC) PATH=$(VENV)/bin:$$PATH timeout 10800 $(PY) -m pytest \
	  tests/horovod_examples -v -p no:cacheprovider --durations=0

container-test: ## (root) both stacks' images with their unit and parallel suites inside, the GPU build, the cluster patterns
	bash mpi_scripts/container.sh install
	for stack in modern classic; do CI=true HVD_TRAIN_CONTAINER_SUITES=1 HVD_TRAIN_CONTAINER_STACK=$$stack \
	  timeout 3600 $(PY) -m pytest tests/container -v -p no:cacheprovider --durations=0 || exit 1; done
	GPU=1 timeout 3600 bash mpi_scripts/container.sh build
	timeout 1800 bash mpi_scripts/container.sh cluster

test-unit: ## one process, no launcher
	$(PY) -m pytest tests/unit -q

test-parallel: ## tests/parallel on NP ranks under LAUNCHER, once (no timeout: for debugging)
	PATH=$(VENV)/bin:$$PATH $(PY) -m hvd_train.core.launch --np $(NP) --launcher $(LAUNCHER) -- \
	  $(PY) -m pytest tests/parallel -q -p no:cacheprovider

test-cluster: ## (root) the cluster tier: hosts made of this machine, jobs, SLURM, faults, elastic across them
	bash mpi_scripts/cluster/install.sh
	timeout 1800 $(PY) -m pytest tests/cluster -v -p no:cacheprovider --durations=0

bench: install ## rerun the benchmarks of the README (idle machine!): JSON + PNG in benchmarks/results
	VENV=$(VENV) NP=$(NP) bash benchmarks/run.sh all

plan: ## the cost model: predicted scaling at 8..1024 workers against published results
	$(VENV)/bin/hvd-train plan --out benchmarks/results

doctor: ## versions, the Horovod build, and what is wrong
	$(VENV)/bin/hvd-train doctor

nccl-check: ## compile Horovod's NCCL ops with this nvcc and the nvidia-nccl wheel (no GPU; ~2-4 min)
	VENV=$(VENV) bash mpi_scripts/check_nccl_build.sh

lint: ## ruff, the layer rules (import-linter), shellcheck, hadolint, the docs (mkdocs --strict)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	@command -v shellcheck >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq shellcheck >/dev/null; } \
	  || { echo "lint: shellcheck missing: apt-get install shellcheck"; exit 1; }
	shellcheck mpi_scripts/*.sh mpi_scripts/cluster/*.sh mpi_scripts/slurm.sbatch tests/run.sh benchmarks/run.sh .ci/run
	$(VENV)/bin/hadolint Dockerfile
	site=$$(mktemp -d) && trap 'rm -rf "$$site"' EXIT && $(VENV)/bin/mkdocs build --strict --site-dir "$$site"

format: ## rewrite the code in the project's format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
