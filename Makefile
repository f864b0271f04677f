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

.PHONY: demo test docs setup clean fixturegen-deps fixtures-second

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

# numpy 1 for tests/fixturegen/make_pyramid_fixtures.py, which makes Pyramid-Flow fixture sets with the
# original's code: its scheduler table `timesteps_per_stage` is float64 only under numpy 1 (the
# reference README, section 4.1). A folder of its own, on the path of the generator's process only.
FIXTUREGEN_DEPS := numpy==1.26.4
$(VENV)/.fixturegen-deps: $(VENV)/.installed Makefile
	rm -rf $(VENV)/fixturegen-deps
	$(PY) -m pip install -q --no-deps --target $(VENV)/fixturegen-deps $(FIXTUREGEN_DEPS)
	touch $@

fixturegen-deps: $(VENV)/.original-deps $(VENV)/.fixturegen-deps

# Every test that reads the Pyramid-Flow fixtures, on a second set made by the original's code at other
# sizes and another seed (tests/fixturegen/README.md): `make fixtures-second [FIXTURES_OUT=DIR]` (DIR
# absent or empty; a new temporary folder by default). The suite runs a subset of them on such a set
# (tests/test_pyramid_fixture_sets.py).
FIXTURE_TESTS := tests/test_pyramid_dit.py tests/test_pyramid_flow_schedule.py tests/test_causal_vae.py \
	tests/test_causal_vae_recipe.py tests/test_pyramid_text.py tests/test_pyramid_flow_ar.py \
	tests/test_pyramid_flow_recipe.py tests/test_pyramid_flow_launch.py tests/test_lora.py \
	tests/test_lora_export.py tests/test_lora_memory.py tests/test_first_day_pyramid.py tests/test_first_day_vae.py
fixtures-second: setup $(VENV)/.test-plugins fixturegen-deps
	out=$(or $(FIXTURES_OUT),$$(mktemp -d -t pan-pyramid-fixtures-XXXXXX)) && \
	$(PY) tests/fixturegen/make_pyramid_fixtures.py --preset second --out "$$out" && \
	PAN_PYRAMID_FIXTURES="$$out" OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(FIXTURE_TESTS)

demo: setup
	$(PY) -m pan.cli demo

test: setup $(VENV)/.test-plugins $(VENV)/.original-deps $(VENV)/.fixturegen-deps
	@(command -v slurmctld && command -v shellcheck) >/dev/null || bash .ci/install_slurm.sh || \
		echo "Slurm or shellcheck could not be installed: the launch-script tests that need them will be skipped"
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder tests

docs: setup
	$(PY) -m pan.config.docs --write docs/config.md

clean:
	rm -rf $(VENV) runs demo_out
