PY ?= $(shell scripts/find-python.sh)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# two pytest workers: compiles dominate the suite and run one per core (tests/conftest.py)
TEST_JOBS ?= 2
PYTEST = $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist worksteal
DURATIONS ?= 40
# JAX's persistent compilation cache, kept in the checkout: the suite, the docs commands and the scripts compile the
# same small programs many times over (the same tiny models in many tests and subprocesses); each is compiled once,
# then loaded. Keyed by the program, the XLA flags and the jax version, so a changed program compiles again.
export JAX_COMPILATION_CACHE_DIR ?= $(CURDIR)/.jax-cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS ?= 0
SCRIPT_TIMES = echo "script run times (measured; CPU = the run's processes' user + system seconds):"; \
	sort .script-times 2>/dev/null; rm -f .script-times

.PHONY: demo test test-slow test-readme test-rest test-scripts install clean launchers

$(STAMP): pyproject.toml
	@test -n "$(PY)" || { echo "make: no Python >= 3.12 found (see scripts/find-python.sh)" >&2; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(PYTEST) --durations=20 -m "not readme and not scripts and not slow" tests

# the slow tier (tests/conftest.py's SLOW and tests marked slow); CI runs it after the suite
test-slow: $(STAMP)
	$(PYTEST) --durations=20 -m "slow and not readme and not scripts" tests

# every README command and code block, shrunk (tests/test_readme.py); CI runs it after the suite
test-readme: $(STAMP)
	$(PYTEST) --durations=0 -m readme tests/test_readme.py

# everything `make test` leaves out, in one pytest run (CI): the slow tier, every README and docs command and code
# block shrunk (tests/test_readme.py) and every script shrunk (tests/test_scripts.py); one pool of workers, so none
# waits out another's tail; each script run's time listed at the end
test-rest: $(STAMP)
	@rm -f .script-times
	@status=0; CFP_SCRIPT_TIMES=$(CURDIR)/.script-times $(PYTEST) --durations=$(DURATIONS) \
	  -m "slow or readme or scripts" tests || status=$$?; $(SCRIPT_TIMES); exit $$status

# every script of benchmarks/, examples/ and cfp_test/, shrunk (tests/test_scripts.py), each run's time listed
test-scripts: $(STAMP)
	@rm -f .script-times
	@status=0; CFP_SCRIPT_TIMES=$(CURDIR)/.script-times $(PYTEST) -m scripts tests/test_scripts.py || status=$$?; \
	$(SCRIPT_TIMES); exit $$status

# the cluster launchers tests/test_cluster_launchers.py runs cfp train under (in make test-rest): Debian's Open MPI
# and a single-node Slurm of this host (munged, slurmctld, slurmd as root); where a package cannot be installed or a
# daemon started, the script says why and those tests skip with the reason
launchers:
	scripts/cluster-launchers.sh install
	scripts/cluster-launchers.sh start

clean:
	rm -rf $(VENV) build *.egg-info .jax-cache
