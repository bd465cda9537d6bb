PY ?= $(shell scripts/find-python.sh)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# two pytest workers: compiles dominate the suite and run one per core (tests/conftest.py)
TEST_JOBS ?= 2

.PHONY: demo test test-readme install clean

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
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) -m "not readme" tests

# every README command and code block, shrunk (tests/test_readme.py); CI runs it after the suite
test-readme: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) -m readme tests/test_readme.py

clean:
	rm -rf $(VENV) build *.egg-info
