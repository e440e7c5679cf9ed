# diffrag build. `make` builds everything this machine can build and says what it skipped;
# `make test` runs every test (no GPU needed); `make run` installs, builds, fetches the
# default model and serves. Modules add their sources and programs in */module.mk.
CC       ?= gcc
BUILD    ?= build
# The sanitizer tree (`make asan`) keeps its flags whoever builds in it, a test included.
ifeq ($(abspath $(BUILD)),$(abspath build/asan))
OPT      ?= -O2
SAN      ?= -fsanitize=address,undefined -fno-omit-frame-pointer
endif
ARCH     ?= -march=native
OPT      ?= -O3
SAN      ?=
CFLAGS   := -std=c11 $(OPT) $(ARCH) -g -Wall -Wextra -Werror -D_GNU_SOURCE -MMD -MP -I. \
            -fno-strict-aliasing $(SAN) $(EXTRA_CFLAGS)
LDFLAGS  := $(SAN) $(EXTRA_LDFLAGS)
LDLIBS   := -lm -lpthread
# The tools and tests run in the project's virtual environment (.venv, git-ignored; `make venv`
# makes it from the python3 on PATH with the pinned packages of tests/requirements.txt).
VENV     := .venv
PYTHON   ?= $(VENV)/bin/python3
VENV_PATH := PATH="$(abspath $(VENV))/bin:$$PATH"

# The small model the fast tests use, and the default model `make run` serves (32K context).
MODEL_FILE := models/SmolLM2-135M-Instruct.Q4_1.gguf
QWEN_FILE  := models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf

all:

# Each module.mk appends to these.
BINS        :=
TEST_BINS   :=
include text/module.mk kernels/module.mk model/module.mk
include $(wildcard retriever/module.mk daemon/module.mk clients/module.mk)
include tests/module.mk

all: $(BINS) $(TEST_BINS)

# Objects are rebuilt when the compiler or its flags change (a tree built with other OPT or
# SAN values would otherwise be reused as it is).
FLAGS_STAMP := $(BUILD)/.flags
FLAGS_NOW   := $(CC) $(CFLAGS) $(LDFLAGS)
ifneq ($(shell cat $(FLAGS_STAMP) 2>/dev/null),$(strip $(FLAGS_NOW)))
$(shell mkdir -p $(BUILD) && echo '$(strip $(FLAGS_NOW))' > $(FLAGS_STAMP))
endif

$(BUILD)/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

deps:
	sh tools/install-deps.sh

venv: $(VENV)/.requirements
$(VENV)/.requirements: tests/requirements.txt tools/make-venv.sh
	sh tools/make-venv.sh $(VENV)

model: $(MODEL_FILE) $(QWEN_FILE)
$(MODEL_FILE): tools/fetch-model.sh
	sh tools/fetch-model.sh smollm2
$(QWEN_FILE): tools/fetch-model.sh
	sh tools/fetch-model.sh qwen

# The suite runs on TEST_JOBS pytest-xdist workers, a test file to a worker: much of its time is
# spent waiting (daemons starting, deadlines, kills, slow clients), so two workers finish it
# sooner even on two cores. TEST_JOBS=1 runs it in one process.
TEST_JOBS ?= 2
test: all $(MODEL_FILE) $(QWEN_FILE) venv
	$(VENV_PATH) $(PYTHON) -m pytest -rs --durations=15 $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile) tests

# Everything built with AddressSanitizer + UndefinedBehaviorSanitizer in build/asan (flags
# above; -O2, as -O1 made the engine's products 3 times slower still); `BUILD=build/asan make
# test` runs the whole suite against it.
asan:
	$(MAKE) BUILD=build/asan all

run: deps all model
	sh tools/run-daemon.sh

install: install-daemon install-clients

# libFuzzer targets (clang): the GGUF reader, the tokenizer, the BM25 text normaliser, context
# assembly, the daemon's request decoder and the grounding calibration file's parser. `make fuzz
# FUZZ_SECONDS=N` runs each for N s; an UndefinedBehaviorSanitizer report stops the run like a
# crash (its input is saved).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := fuzz_gguf fuzz_tokenizer fuzz_analyzer fuzz_context fuzz_request fuzz_openai \
                fuzz_calibration
FUZZ_BUILD   := build/fuzz
FUZZ_SAN     := -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer
# The parsers under fuzz need no kernels: link only what they use (the text layer whole).
FUZZ_OBJS    := model/gguf model/model_ctx model/tokenizer model/tokenizer_encode $(basename $(wildcard text/*.c)) \
                $(basename $(wildcard retriever/*.c))
# fuzz_request also links the daemon's decoder and op table (with the I/O stages it names),
# msgpack reader/writer, configuration table and the grounding parsers the configuration
# checks with.
FUZZ_DAEMON_OBJS := daemon/proto daemon/ops daemon/stages daemon/mp daemon/wire daemon/config \
                    daemon/config_keys daemon/config_endpoint daemon/log daemon/grounding \
                    daemon/grounding_file daemon/extract daemon/zutil
FUZZ_LINK_fuzz_request := $(patsubst %,$(FUZZ_BUILD)/%.o,$(FUZZ_DAEMON_OBJS)) -lmsgpackc -lcrypto -lzmq
# fuzz_openai: the HTTP API's request reader, then the same decoder over what it wrote.
FUZZ_DAEMON_OBJS += daemon/openai_req
FUZZ_LINK_fuzz_openai := $(FUZZ_LINK_fuzz_request) $(FUZZ_BUILD)/daemon/openai_req.o
# fuzz_calibration: the grounding calibration file's parser, and the scores it leads to.
FUZZ_LINK_fuzz_calibration := $(FUZZ_BUILD)/daemon/grounding.o \
                              $(FUZZ_BUILD)/daemon/grounding_file.o -lcrypto
fuzz-build:
	$(MAKE) BUILD=$(FUZZ_BUILD) CC=clang OPT=-O1 SAN="$(FUZZ_SAN)" \
	    $(patsubst %,$(FUZZ_BUILD)/%.o,$(FUZZ_OBJS) $(FUZZ_DAEMON_OBJS) $(addprefix tests/fuzz/,$(FUZZ_TARGETS)))
	$(foreach t,$(FUZZ_TARGETS),clang -fsanitize=fuzzer,address,undefined $(FUZZ_BUILD)/tests/fuzz/$(t).o \
	    -o $(FUZZ_BUILD)/$(t) $(patsubst %,$(FUZZ_BUILD)/%.o,$(FUZZ_OBJS)) $(FUZZ_LINK_$(t)) \
	    -llmdb -lstemmer -ljansson -lm -lpthread &&) true
fuzz: fuzz-build $(MODEL_FILE)
	for t in $(FUZZ_TARGETS); do \
	    mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
	    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	    $(FUZZ_BUILD)/$$t -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -print_final_stats=1 \
	        $(FUZZ_BUILD)/corpus/$$t tests/fuzz/seeds/$$t || exit 1; \
	done

bench-engine: all $(MODEL_FILE) venv
	$(VENV_PATH) $(PYTHON) bench/bench_engine.py

bench-llamacpp: all $(MODEL_FILE) venv
	$(VENV_PATH) $(PYTHON) bench/bench_llamacpp.py

# The Qwen model beside llama.cpp, the two interleaved: prefill at 512 to 8,192 tokens and decode
# at depth 0 and 8,192 (medians of 3 below 8,192 tokens, one run from there), then 32,768 tokens
# once against llama.cpp's flash attention (its faster setting at length); the ratios against
# the targets (prefill 2.5x, decode 1.0x). About an hour on 2 cores.
bench-qwen: all $(QWEN_FILE) venv
	$(VENV_PATH) $(PYTHON) bench/bench_llamacpp.py --models qwen --sizes 512,2048,8192 --once-from 8192 --kv f16
	$(VENV_PATH) $(PYTHON) bench/bench_llamacpp.py --models qwen --sizes 32768 --no-decode --fa 1 --reps 1

# diffrag-extract's MB/s and peak memory on generated HTML, DOCX and PDF files of 0.1, 1 and 8 MB
# (docs/performance.md; about a minute). BENCH_ARGS=--sizes 0.1 --reps 3: a smoke run.
bench-extract: all venv
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) bench/bench_extract.py $(BENCH_ARGS)
.PHONY: bench-extract

bench-grounding: all $(MODEL_FILE) $(QWEN_FILE) venv
	$(VENV_PATH) $(PYTHON) bench/bench_grounding.py

# diffragd beside llama.cpp's llama-server (built by `sh bench/build-llama-bench.sh`) on the
# default model (about 15 minutes on two cores), same threads: prefix reuse (TTFT of a second
# question over the same ~7K tokens of documents / the first's), 16 concurrent clients'
# tokens/s, and the p99 inter-token gap of a stream while a long prompt prefills, against
# their targets. BENCH_ARGS=--quick: a smoke run; --model another GGUF file. Then the
# long-document scenario (bench/bench_longdoc.py: first ten questions over each of five
# ~18K-token documents stored in one collection, asked at a 16K budget in the window layout and
# in rank order, about 95 minutes; then ten over each of three ~16K-token documents, inline and
# stored, about 15 minutes more), LONGDOC_ARGS its options (--window-docs 0: no window run).
bench-serving: all $(QWEN_FILE) venv
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) bench/bench_serving.py $(BENCH_ARGS)
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) bench/bench_longdoc.py $(LONGDOC_ARGS)
.PHONY: bench-serving

# The groundedness detector's calibration for the default model and its held-out evaluation
# (about an hour on two cores): writes deploy/grounding/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.grounding,
# docs/grounding-eval.md and docs/grounding-roc.png. Thresholds: max F1 with a false-positive
# rate of at most 0.3 on the fit split's out-of-fold scores; a hidden-state probe of layer 14,
# fitted with every SQuAD question of the fit split (1,583); the held-out answerable questions
# also asked over a paragraph without their answer, reported apart. EVAL_ARGS=--resume keeps
# replies already collected.
GROUNDING_EVAL_ARGS := --model $(QWEN_FILE) --name qwen2.5-coder-0.5b-v3 \
	--calibration-out deploy/grounding/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.grounding \
	--cases build/grounding-eval-qwen/cases.jsonl --results build/grounding-eval-qwen/results.jsonl \
	--squad-questions 400 --fit-squad-questions 1583 --per-length 6 4 3 2 1 --max-fpr 0.3 \
	--probe-layer 14 --other-paragraph test
eval-grounding: all $(QWEN_FILE) venv
	$(VENV_PATH) $(PYTHON) tools/grounding-eval.py all $(GROUNDING_EVAL_ARGS) \
		--command "make eval-grounding" $(EVAL_ARGS)

# The detector across context lengths (docs/groundedness.md "Across lengths and answer modes";
# about two and a half hours on two cores): SQuAD questions of the fit split's articles over
# whole paragraphs from about 170 to 25,000 tokens, with the residual stream of the probe's
# layer; a probe for prompts of 4,000 documents' tokens or more and one for prompts under 500
# (a single paragraph) fitted on them, then a length offset fitted on their out-of-fold logits
# onto the calibration (per band, the threshold that flags a set share of its right answers:
# the largest share of 5% to 20% that flags at most 20% of every band's right answers in
# cross-validation over the fit split's articles), written back as qwen2.5-coder-0.5b-v6;
# then the test split's articles at the same lengths, answered under it (at about 2K and 16K
# tokens also questions of other articles, which the documents do not hold), and the report.
# Answers go to build/eval-trust/.
TRUST_BANDS := --bands 256,1024,2048,4096,8192,16384,28000 --modes free --hidden-layers 14
TRUST_CAL := deploy/grounding/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.grounding
eval-trust: all $(QWEN_FILE) venv
	rm -rf build/eval-trust && mkdir -p build/eval-trust
	$(VENV_PATH) $(PYTHON) tools/eval-trust.py --split fit $(TRUST_BANDS) \
		--contexts 40,16,16,16,8,6,4 --per-context 8,8,8,8,64,128,128 \
		--json build/eval-trust/fit.jsonl
	$(VENV_PATH) $(PYTHON) tools/eval-trust.py --report build/eval-trust/fit.jsonl \
		--refit build/eval-trust/fit.jsonl --lengths --long-probe 4000 --short-probe 500 \
		--choose-fpr 0.2 --calibration $(TRUST_CAL) --name qwen2.5-coder-0.5b-v6 --write $(TRUST_CAL)
	$(VENV_PATH) $(PYTHON) tools/eval-trust.py --split test $(TRUST_BANDS) \
		--contexts 40,24,24,24,8,6,4 --per-context 4,4,4,8,48,64,64 \
		--other-questions 0,0,4,0,0,16,0 --json build/eval-trust/test.jsonl
.PHONY: eval-trust

# Needle in a haystack with the Qwen model through diffragd at 4K, 8K, 16K and 32K tokens, five
# depths each (docs/evaluation.md; an hour or more on two cores). EVAL_ARGS=--yarn adds 64K and
# 128K with YaRN (factor 4 over 32,768).
eval-longctx: all $(QWEN_FILE) venv
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) tools/eval-longctx.py $(EVAL_ARGS)
.PHONY: eval-longctx

# Answer accuracy against the context budget (2K to 32K tokens, chunks best first and in
# document order) with the Qwen model over SQuAD collections (docs/evaluation.md; hours on two
# cores). EVAL_ARGS narrows it, e.g. --budgets 2048,4096 --articles 2.
eval-rag: all $(QWEN_FILE) venv
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) tools/eval-rag.py $(EVAL_ARGS)
.PHONY: eval-rag

# Hand-written questions over this project's docs/ (tests/data/docs-questions.jsonl): recall@1
# and @5 of the right section through diffrag-store, then each question asked of diffragd with
# the default model at its defaults, answers right and their grounding flags
# (docs/evaluation.md; about 10 minutes on two cores). EVAL_ARGS=--no-answers: retrieval only;
# --build DIR measures another build.
eval-docs: all $(QWEN_FILE) venv
	BUILD=$(BUILD) $(VENV_PATH) $(PYTHON) tools/eval-docs.py $(EVAL_ARGS)
.PHONY: eval-docs

clean:
	rm -rf build

.PHONY: all deps venv model test asan run clean bench-engine bench-llamacpp bench-qwen bench-grounding eval-grounding install fuzz fuzz-build
.SECONDARY:
-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)
