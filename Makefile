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

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,demo]"
	touch $@

setup: $(VENV)/.installed

# The tests' recipe that lives outside pan (tests/plugins/pan_toy_gan), found through its entry point.
$(VENV)/.test-plugins: $(VENV)/.installed tests/plugins/pan_toy_gan/pyproject.toml
	$(PY) -m pip install -q --no-deps -e tests/plugins/pan_toy_gan
	touch $@

demo: setup
	$(PY) -m pan.cli demo

test: setup $(VENV)/.test-plugins
	@command -v slurmctld >/dev/null || bash .ci/install_slurm.sh || \
		echo "Slurm could not be installed: the launch-script tests will be skipped"
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests

docs: setup
	$(PY) -m pan.config.docs --write docs/config.md

clean:
	rm -rf $(VENV) runs demo_out
