# The two commands a newcomer needs: `make demo` (the main job) and `make test`. Both set up
# their own virtualenv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is pinned to the CPU wheel this project is developed against; a GPU cluster installs its
# own CUDA build of torch >= 2.9 into its environment instead (see docs/training.md).
TORCH_SPEC ?= torch==2.13.0
# Test files run in parallel, one whole file per worker (its module fixtures are built once); most
# of the suite's time is one process at a time, so two workers fill two cores.
TEST_WORKERS ?= 2

.PHONY: demo test docs setup clean

# The other dependencies at the versions CI last passed with (constraints.txt): pyproject.toml's
# lower bounds alone let a fresh install take whatever was released last.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[test,demo]"
	touch $@

setup: $(VENV)/.installed

# The tests' recipe that lives outside pan (tests/plugins/pan_toy_gan), found through its entry point.
$(VENV)/.test-plugins: $(VENV)/.installed tests/plugins/pan_toy_gan/pyproject.toml
	$(PY) -m pip install -q --no-deps -e tests/plugins/pan_toy_gan
	touch $@

# The original Pyramid-Flow's own dependencies, for the tests that load pan's exports with its code
# (tests/test_lora_export.py runs tests/original_pyramid_dit.py): a folder of their own in the venv,
# never on pan's path (timm's torchvision does not import beside this torch; the original's stubs
# stand in for it).
ORIGINAL_DEPS := einops==0.8.2 timm==1.0.31 accelerate==1.15.0
$(VENV)/.original-deps: $(VENV)/.installed Makefile
	rm -rf $(VENV)/original-deps
	$(PY) -m pip install -q --no-deps --target $(VENV)/original-deps $(ORIGINAL_DEPS)
	touch $@

demo: setup
	$(PY) -m pan.cli demo

test: setup $(VENV)/.test-plugins $(VENV)/.original-deps
	@(command -v slurmctld && command -v shellcheck) >/dev/null || bash .ci/install_slurm.sh || \
		echo "Slurm or shellcheck could not be installed: the launch-script tests that need them will be skipped"
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests

docs: setup
	$(PY) -m pan.config.docs --write docs/config.md

clean:
	rm -rf $(VENV) runs demo_out
