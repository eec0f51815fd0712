# `make demo` and `make test` set everything up on a fresh machine: a pinned .venv holding torch and the
# real upstream packages (see requirements/), then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
# deepspeed (requirements/test.txt) is an sdist: build it without compiled ops (the tests use its CPU accelerator).
export DS_BUILD_OPS := 0

# The lowest torch pyproject.toml accepts gets a venv of its own, for the tests that need no upstream
# package: the checkpoint fix, the engine, sampling through gradpatch.differentiable (checkpoint_steps,
# grad_steps, copy on write) and the sampler options; gradpatch reads autocast, compile, autograd and
# dispatch state through torch APIs that changed since (checkpointing/_compat.py). Their tests of upstream
# packages skip there with the reason (tests/skip_policy.py). Skipping it takes a reason:
# `make test SKIP_TORCH_LOWER="why"`, which is printed.
LOWER_VENV ?= .venv-torch-lower
LOWER_PY := $(LOWER_VENV)/bin/python
LOWER_TESTS := tests/checkpointing/test_checkpoint_fix.py tests/checkpointing/test_checkpoint_properties.py \
	tests/checkpointing/test_checkpoint_trust.py tests/patching/test_engine.py tests/patching/test_trust.py \
	tests/patching/test_definitions.py tests/sampling/test_differentiable.py tests/sampling/test_differentiable_unwatched.py tests/sampling/test_sampler_options.py \
	tests/sampling/test_step_checkpoint.py tests/sampling/test_lift.py tests/sampling/test_lift_trust.py \
	tests/sampling/test_trust_steps.py tests/project/test_skip_policy.py
SKIP_TORCH_LOWER ?=

# The newest torch release gets a venv of its own too, for the tests that import without the upstream
# codebases (torchaudio 2.11, the newest, refuses to import on torch 2.15: docs/install.md).
# Skipping it takes a reason: `make test SKIP_TORCH_NEWEST="why"`, which is printed. Its install reads
# no pip configuration (PIP_CONFIG_FILE=/dev/null): a machine-wide constraints file that caps torch for
# other environments must not apply to the one venv whose point is another torch.
NEWEST_VENV ?= .venv-torch-newest
NEWEST_PY := $(NEWEST_VENV)/bin/python
NEWEST_TESTS := $(LOWER_TESTS) tests/checkpointing/test_checkpoint_functorch.py \
	tests/checkpointing/test_checkpoint_budget_compile.py tests/checkpointing/test_checkpoint_peak_compile.py \
	tests/patching/test_versions.py \
	tests/upstream/test_diffusers_pipelines.py
SKIP_TORCH_NEWEST ?=

# LeRobot 0.6.1 needs Python >= 3.12: its policies (pi0, pi05, SmolVLA, diffusion) are tested in a venv of
# their own, made with PYTHON_LEROBOT: the first python3.13 / python3.12 on PATH that runs, else pyenv's
# 3.13 / 3.12 under ~/.pyenv/versions (Debian trixie: `apt-get install python3.13 python3.13-venv`), from
# requirements/lerobot.txt; only tests/upstream/test_lerobot.py runs there (it skips elsewhere, with its
# reason). Skipping it takes a reason: `make test SKIP_LEROBOT="why"`, which is printed.
PYTHON_LEROBOT ?= $(firstword $(shell for p in python3.13 python3.12; do command -v $$p >/dev/null && $$p -c "" 2>/dev/null && command -v $$p; done) \
	$(wildcard $(HOME)/.pyenv/versions/3.13*/bin/python3.13 $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.13)
LEROBOT_VENV ?= .venv-lerobot
LEROBOT_PY := $(LEROBOT_VENV)/bin/python
SKIP_LEROBOT ?=

# JUNIT_DIR=<folder> (.ci/run): each pytest run of `make test` also writes <folder>/<venv>.xml.
JUNIT_DIR ?=
junit = $(if $(JUNIT_DIR),--junitxml=$(JUNIT_DIR)/$(1).xml)

.PHONY: demo test lint docs test-torch-lower test-torch-newest test-lerobot newcomer bench clean

$(VENV)/.installed: pyproject.toml requirements/test.txt requirements/upstream.txt requirements/upstream-build.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first and named in every command: installing its dependents alone can replace it.
	$(PIP) install --quiet torch==2.14.1 torchvision==0.29.1
	$(PIP) install --quiet -r requirements/test.txt
	$(PIP) install --quiet --no-deps -r requirements/upstream.txt
	$(PIP) install --quiet --no-deps --no-build-isolation -r requirements/upstream-build.txt
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/finetune_audioldm.py

# ruff (a small rule set, pyproject.toml) and mypy (gradpatch and patches/, configured in pyproject.toml).
lint: $(VENV)/.installed
	$(PY) -m ruff check --no-cache gradpatch patches tests benchmarks examples
	$(PY) -m mypy

# The documentation site (mkdocs.yml), built strictly: a broken link, an API name that does not resolve or
# any other warning fails it. The docs' Python blocks run in tests/project/test_docs_snippets.py.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir build/site

test: $(VENV)/.installed lint docs
	GRADPATCH_TEST_ENV=main $(PY) -m pytest -n 2 --durations=15 $(call junit,main)
ifeq ($(strip $(SKIP_TORCH_LOWER)),)
	$(MAKE) test-torch-lower
else
	@echo "NOT RUN: the tests that need no upstream package on the lowest accepted torch (SKIP_TORCH_LOWER: $(SKIP_TORCH_LOWER))"
endif
ifeq ($(strip $(SKIP_TORCH_NEWEST)),)
	$(MAKE) test-torch-newest
else
	@echo "NOT RUN: engine and checkpoint tests on the newest torch (SKIP_TORCH_NEWEST: $(SKIP_TORCH_NEWEST))"
endif
ifeq ($(strip $(SKIP_LEROBOT)),)
	$(MAKE) test-lerobot
else
	@echo "NOT RUN: the LeRobot policy tests on Python 3.13 (SKIP_LEROBOT: $(SKIP_LEROBOT))"
endif

# gradpatch itself is installed in the lowest/newest-torch venvs as in .venv (editable, with its start-up
# file: tests/patching/test_trust.py starts interpreters with GRADPATCH set); hatchling builds it (torch-*.txt).
$(LOWER_VENV)/.installed: requirements/torch-lower.txt pyproject.toml
	$(PYTHON) -m venv $(LOWER_VENV)
	$(LOWER_PY) -m pip install --quiet --no-deps -r requirements/torch-lower.txt
	$(LOWER_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test-torch-lower: $(LOWER_VENV)/.installed
	PYTHONPATH=. GRADPATCH_TEST_ENV=torch-lower $(LOWER_PY) -m pytest -p no:cacheprovider $(call junit,torch-lower) $(LOWER_TESTS)

$(NEWEST_VENV)/.installed: requirements/torch-newest.txt pyproject.toml
	$(PYTHON) -m venv $(NEWEST_VENV)
	PIP_CONFIG_FILE=/dev/null $(NEWEST_PY) -m pip install --quiet --no-deps -r requirements/torch-newest.txt
	PIP_CONFIG_FILE=/dev/null $(NEWEST_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test-torch-newest: $(NEWEST_VENV)/.installed
	PYTHONPATH=. GRADPATCH_TEST_ENV=torch-newest $(NEWEST_PY) -m pytest -p no:cacheprovider $(call junit,torch-newest) $(NEWEST_TESTS)

# torch first and named in every command; then lerobot and what its policies import, --no-deps (it pins
# torch<2.12); gradpatch editable, as in the other venvs.
$(LEROBOT_VENV)/.installed: requirements/lerobot.txt pyproject.toml
	@$(PYTHON_LEROBOT) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { echo "test-lerobot: \
	'$(PYTHON_LEROBOT)' is not a Python >= 3.12 interpreter (LeRobot 0.6.1 needs one). Install python3.13 \
	(apt-get install python3.13 python3.13-venv, or pyenv install 3.13) and pass PYTHON_LEROBOT=<its path>, \
	or skip with a reason: make test SKIP_LEROBOT=\"why\"" >&2; exit 1; }
	$(PYTHON_LEROBOT) -m venv $(LEROBOT_VENV)
	$(LEROBOT_PY) -m pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(LEROBOT_PY) -m pip install --quiet --no-deps torch==2.14.1 torchvision==0.29.1 -r requirements/lerobot.txt
	$(LEROBOT_PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test-lerobot: $(LEROBOT_VENV)/.installed
	PYTHONPATH=. GRADPATCH_TEST_ENV=lerobot $(LEROBOT_PY) -m pytest -p no:cacheprovider $(call junit,lerobot) tests/upstream/test_lerobot.py

# The wheel in fresh virtual environments, installed as the README's Install section says, and the
# Python blocks of the README and of the docs pages whose blocks stand alone run there (also part of `make test`).
newcomer: $(VENV)/.installed
	$(PY) -m pytest -n 2 tests/project/test_newcomer.py tests/project/test_cli.py

bench: $(VENV)/.installed
	for script in benchmarks/*.py; do $(PY) $$script --quick || exit 1; done

clean:
	rm -rf $(VENV) $(LOWER_VENV) $(NEWEST_VENV) $(LEROBOT_VENV) build dist .pytest_cache
