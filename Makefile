# diffrag build. `make` builds everything this machine can build and says what it skipped;
# `make test` runs every test (no GPU needed); `make run` installs, builds, fetches the
# default model and serves. Modules add their sources and programs in */module.mk.
CC       ?= gcc
ARCH     ?= -march=native
OPT      ?= -O3
SAN      ?=
CFLAGS   := -std=c11 $(OPT) $(ARCH) -g -Wall -Wextra -Werror -D_GNU_SOURCE -MMD -MP -I. \
            -fno-strict-aliasing $(SAN) $(EXTRA_CFLAGS)
LDFLAGS  := $(SAN) $(EXTRA_LDFLAGS)
LDLIBS   := -lm -lpthread
BUILD    ?= build
PYTHON   ?= python3

MODEL_FILE := models/SmolLM2-135M-Instruct.Q4_1.gguf

all:

# Each module.mk appends to these.
BINS        :=
TEST_BINS   :=
include kernels/module.mk model/module.mk
include $(wildcard retriever/module.mk daemon/module.mk clients/module.mk)
include tests/module.mk

all: $(BINS) $(TEST_BINS)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

deps:
	sh tools/install-deps.sh

model: $(MODEL_FILE)
$(MODEL_FILE): tools/fetch-model.sh
	sh tools/fetch-model.sh

test: all $(MODEL_FILE)
	$(PYTHON) -m pytest -q tests

# The same tests under AddressSanitizer + UndefinedBehaviorSanitizer.
asan:
	$(MAKE) BUILD=build/asan OPT=-O1 SAN="-fsanitize=address,undefined -fno-omit-frame-pointer" all

run: deps all model
	sh tools/run-default.sh

bench-engine: all $(MODEL_FILE)
	$(PYTHON) bench/bench_engine.py

clean:
	rm -rf build

.PHONY: all deps model test asan run clean bench-engine
.SECONDARY:
-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
