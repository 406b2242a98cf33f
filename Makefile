# Two commands that work on a fresh clone: `make demo` and `make test`.
# OPENBLAS_NUM_THREADS=1: the NumPy reference runs many small matmuls; threads only contend on small CPUs.
PY      ?= python3
VENV    ?= .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.hopdec-installed
BUNDLE  ?= build/bundle-tiny

.PHONY: demo test venv bundle bundles lint clean

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test,build]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP) bundle
	OPENBLAS_NUM_THREADS=1 $(VENV)/bin/hopdec demo --bundle $(BUNDLE)

bundle: $(STAMP)
	$(VPY) -m kernels.build --config tiny --tp 4 --out $(BUNDLE)

# Every bundle the GPU machine needs (carry them there; see docs/device.md).
bundles: bundle
	$(VPY) -m kernels.build --config v41-flash --tp 4 --out build/bundle-v41-flash-tp4
	$(VPY) -m executor.bench_step --write-config build/v41-flash-bench-step.json
	$(VPY) -m kernels.build --config build/v41-flash-bench-step.json --tp 4 \
	    --out build/bundle-v41-bench-step-tp4

test: $(STAMP) bundle
	OPENBLAS_NUM_THREADS=1 HOPDEC_BUNDLE=$(BUNDLE) $(VPY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check loader kernels executor collectives tests

clean:
	rm -rf build .pytest_cache
