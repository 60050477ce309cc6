# shardfs: `make demo` runs the main job on a fresh machine, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup system-deps bytecode demo test test-unit lint format clean bench bench-scale bench-deps bench-small writers

setup: system-deps $(STAMP)

system-deps:
	@bash scripts/install-system-deps.sh

$(STAMP): pyproject.toml $(wildcard shardfs/*/*.c shardfs/*/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# The project's own modules compiled once. Where PYTHONDONTWRITEBYTECODE is set (as on this
# project's machines), an editable install's modules are otherwise compiled again in every
# process that imports them: about 0.3 s of each `shardfs mount` (the command and its
# daemon), which the tests run hundreds of times. Unchanged modules are skipped.
bytecode: setup
	$(BIN)/python -m compileall -q shardfs tests/support

demo: setup bytecode
	$(BIN)/python scripts/demo.py

test: setup writers bytecode
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The writers venv: the real tools that write the parquet and MDS test fixtures (datasets,
# pyarrow, mosaicml-streaming's MDSWriter), apart from .venv because their pins conflict
# with it (numpy<2.2 for streaming). streaming is installed without its dependencies (every
# cloud SDK) plus the few MDSWriter imports; torch comes from .venv through a .pth file,
# which Python appends after the writers' own packages. The tests run the scripts in
# tests/support/writers/ under it, and fail naming `make writers` when it is missing.
WRITERS := .venv-writers
WRITERS_STAMP := $(WRITERS)/.installed
WRITERS_REQS := tests/support/writers/requirements.txt tests/support/writers/requirements-nodeps.txt

writers: setup $(WRITERS_STAMP)

$(WRITERS_STAMP): $(WRITERS_REQS)
	$(PYTHON) -m venv $(WRITERS)
	$(WRITERS)/bin/pip install -q -r tests/support/writers/requirements.txt
	$(WRITERS)/bin/pip install -q --no-deps -r tests/support/writers/requirements-nodeps.txt
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
		> "$$($(WRITERS)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-shardfs-venv.pth"
	touch $@

test-unit: setup bytecode
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not integration and not s3"

lint: setup
	$(BIN)/ruff check shardfs tests scripts bench examples
	$(BIN)/ruff format --check shardfs tests scripts bench examples
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix shardfs tests scripts
	$(BIN)/ruff format shardfs tests scripts

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	touch $(BENCH_STAMP)

bench-deps: setup bytecode $(BENCH_STAMP)

# The benchmark: local ImageFolder vs shardfs vs webdataset vs ratarmount over a local S3
# server, then the small-cache section (below). The server runs on the last core, the bench,
# its DataLoader workers and the daemons on the others (bench/pinning.py); cold epochs are
# paired with a local epoch with the page cache warm and one right after drop_caches (root).
# A last round on shared cores is reported apart, as context. Writes results/bench.json,
# results/bench.md and results/bench.png. BENCH_ARGS passes options, e.g.
# `make bench BENCH_ARGS=--quick`, or `--shared-cores` for every process on every core.
bench: bench-deps
	$(BIN)/python bench/run.py $(BENCH_ARGS)

# The small-cache section alone (issue 12): --cache-size 0.5x, 0.25x (and 2x, control) of
# the dataset, page cache dropped every 20 files, two epochs of shuffle=True, ShardSampler
# shard and uniform; egress per epoch at the server; pinned as `make bench` is (server on
# the last core, with its objects in memory). Writes results/small_cache.json and
# .md. Size knobs: SMALL_CACHE_IMAGES (1400), SMALL_CACHE_BLOCK_SIZE (8M), SMALL_CACHE_SHARDS
# (5); SMALL_ARGS passes options, e.g. `make bench-small SMALL_ARGS="--fractions 0.5"`.
bench-small: bench-deps
	$(BIN)/python bench/small_cache.py $(SMALL_ARGS)

.PHONY: bench-files
# What one file costs the daemon (issue 21): ~100 KB files read raw (open, read, close) by 4
# threads through a fresh mount over moto S3 (server pinned to the last core), cold and warm,
# open() with default buffering and with buffering=0: files/s and the daemon's user and
# system CPU per file, next to curl fetching the same shards and this VM's page-fault and
# page-cache fill costs, all in the same run. Writes results/per_file.json and .md.
# FILES_ARGS passes options, e.g. `make bench-files FILES_ARGS="--rounds 1 --images 600"`.
bench-files: bench-deps
	$(BIN)/python bench/per_file.py $(FILES_ARGS)

bench-scale: bench-deps writers
	$(BIN)/python bench/scale.py --out results/scale.json

.PHONY: bench-ceiling
# The daemon's ceiling in files/s (issue 21), for a machine with many cores: ~100 KB files in
# tar shards in a local folder (no store server), read raw by 1, 4 and 16 reader processes,
# cold (fresh cache), warm and recached (page cache dropped, blocks cached), with and
# without the compiled hot path, next to the same files on local disk. No pinning: run it
# where cores are plenty. Writes ceiling.json and .md (CEILING_ARGS, e.g. "--out DIR").
bench-ceiling: setup
	$(BIN)/python bench/ceiling.py $(CEILING_ARGS)

.PHONY: bench-stream
# Streaming through a small cache (issue 21), the store pinned to the last core: cold epochs
# (a fresh mount over an empty cache each, page cache dropped first) of ShardSampler shard
# and uniform mode and plain shuffle=True at --cache-size 0.15x of the dataset, each next
# to the same epoch with a cache that holds it all (3x); webdataset and local disk (warm and
# after drop_caches) as context; then the same under a shaped store (20 ms first-byte
# latency, 100 MB/s per response). 3,000 images, 5 rounds; egress, daemon CPU and the
# mount's counters per epoch; the issue's targets checked. Writes results/streaming.json
# and .md. STREAM_ARGS passes options, e.g. `make bench-stream STREAM_ARGS="--rounds 2
# --out /tmp/stream"`.
bench-stream: bench-deps
	$(BIN)/python bench/streaming.py $(STREAM_ARGS)

.PHONY: bench-formats
# Shard formats (issue 22), the store pinned to the last core: the same 2,000 JPEGs as GNU
# tar shards, parquet (`datasets` to_parquet), MDS (MDSWriter, plain) and a stored zip
# (`zip -0 -r`), and decoded: the tars gzipped, pyarrow snappy + dictionary parquet, zstd
# MDS and a deflated zip (`zip -r`), and the tars again with an index sidecar (their mount
# fetches the sidecar only), the parquet and MDS written in the writers venv; per
# round and format, in an order rotated by round, a fresh mount over an empty cache (3x)
# and one cold decode epoch. Each format / tar per round, the decoded kinds' decode CPU
# per image; targets: parquet and MDS
# within 0.05 of tar and of the sidecar tar (5 rounds), mount + epoch egress <= 1.05x the images, index <= 2%.
# Writes results/formats.json and .md. FORMATS_ARGS passes options (`--rounds 3`).
bench-formats: bench-deps writers
	$(BIN)/python bench/formats.py $(FORMATS_ARGS)

.PHONY: bench-figures
# The README's figures that `make bench` does not produce (bench/figures.py): `shardfs pack`
# into a folder and into S3 against `tar -cf` and `cp -r`, a cold shuffled read with each
# --miss-fetch policy (seconds, GETs, the timeline of bytes fetched and files read), the
# isatty ioctl on the mount and on local disk. Writes results/figures.json and .md.
# FIGURES_ARGS passes options, e.g. `make bench-figures FIGURES_ARGS="--rounds 1"`.
bench-figures: bench-deps
	$(BIN)/python bench/figures.py $(FIGURES_ARGS)

.PHONY: bench-dist
# Two simulated nodes on this machine, each with its own shardfs mount and cache, each running
# `torchrun --nnodes 2 --nproc-per-node 2` (gloo, CPU) of examples/train_ddp.py for two epochs,
# with ShardSampler and then DistributedSampler; egress per node and per epoch at the server.
# Then the elastic run: 2 nodes x 2 ranks stop mid-epoch and resume on 1 x 2 and on 3 x 1
# (ranks in the bench process), egress per node and every sample seen once.
# Writes results/dist.json and results/dist.md.
bench-dist: bench-deps
	$(BIN)/python bench/dist.py $(BENCH_ARGS)

.PHONY: soak
# Soak under faults: one mount read for SOAK_EPOCHS epochs (default 30) through a fault proxy
# that injects random transient faults; writes results/soak.json and prints a table. Fails on
# any wrong byte or on daemon RSS/fd growth over 10% across the last half of the epochs.
soak: setup
	$(BIN)/python bench/soak.py

.PHONY: newcomer
# What a new user meets in a first hour (issue 19), with the installed command, real mounts
# and real servers: the collision shards under ImageFolder, stats against the server, the
# messages for a dead folder URL, an -o typo, pack into its source, a .tar.gz, and more.
newcomer: setup
	$(BIN)/python scripts/newcomer_check.py

clean:
	rm -rf $(VENV) $(WRITERS) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

FUZZ_STAMP := $(VENV)/.fuzz-installed
FUZZ_SECONDS ?= 600

$(FUZZ_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e '.[fuzz]'
	touch $(FUZZ_STAMP)

# Coverage-guided fuzzing (atheris) of the tar parser, the index's name and label rules and
# the views, for FUZZ_SECONDS (default 600). A finding is stored as text in
# tests/fuzz_regressions/, which the test suite replays.
.PHONY: fuzz
fuzz: setup $(FUZZ_STAMP)
	FUZZ_SECONDS=$(FUZZ_SECONDS) $(BIN)/python tests/fuzz_target.py
