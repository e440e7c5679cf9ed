# retriever/: the document store (LMDB), chunking, the BM25 index and search, the context
# planner and context assembly.
RETRIEVER_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard retriever/*.c))
LIB_RETRIEVER  := $(BUILD)/libdiffrag_retriever.a
RETRIEVER_LIBS := $(LIB_RETRIEVER) -llmdb -lstemmer

$(LIB_RETRIEVER): $(RETRIEVER_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

BINS += $(BUILD)/diffrag-store
# It reads files through the clients' document reader (clients/ingest), as `diffrag ingest` does.
STORE_TOOL_OBJS := $(patsubst %.c,$(BUILD)/%.o,tools/diffrag_store.c tools/store_read.c \
                   $(wildcard clients/ingest/*.c))
$(BUILD)/diffrag-store: $(STORE_TOOL_OBJS) $(LIB_RETRIEVER) $(LIB_MODEL)
	$(CC) $(LDFLAGS) $(STORE_TOOL_OBJS) -o $@ $(RETRIEVER_LIBS) $(MODEL_LIBS) $(LDLIBS)

# The benchmark compares against SQLite FTS5; it is built and run only by `make bench-retriever`.
# SQuAD 2.0 (dev, CC BY-SA 4.0): the repository's copy (tests/data/squad2/), unpacked into
# build/data/squad2/ by tools/squad_data.py.
SQUAD_DIR := build/data/squad2
SQUAD_FILES := $(SQUAD_DIR)/passages.jsonl $(SQUAD_DIR)/questions.jsonl
$(SQUAD_FILES): tests/data/squad2/passages.jsonl.gz tests/data/squad2/questions.jsonl.gz tools/squad_data.py
	python3 tools/squad_data.py
BENCH_RETRIEVER_ARGS ?= --passages $(SQUAD_DIR)/passages.jsonl --questions $(SQUAD_DIR)/questions.jsonl
$(BUILD)/bench_retriever: $(BUILD)/bench/bench_retriever.o $(LIB_RETRIEVER) $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(RETRIEVER_LIBS) -lsqlite3 $(MODEL_LIBS) $(LDLIBS)

bench-retriever: $(BUILD)/bench_retriever $(SQUAD_FILES)
	$(BUILD)/bench_retriever $(BENCH_RETRIEVER_ARGS)

# Chunk KV reuse against full prefills over retrieved SQuAD contexts (bench/bench_kvreuse.c):
# built with everything so it always compiles, run by `make bench-kvreuse` on the default
# model (about 50 minutes on 2 cores; BENCH_KVREUSE_ARGS=--budgets 8192 --questions 2 for a
# short run, --selections probe,deviation to compare the blend's two ways of choosing).
BINS += $(BUILD)/bench_kvreuse
$(BUILD)/bench_kvreuse: $(BUILD)/bench/bench_kvreuse.o $(LIB_RETRIEVER) $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(RETRIEVER_LIBS) $(MODEL_LIBS) $(LDLIBS)

BENCH_KVREUSE_ARGS ?=
bench-kvreuse: $(BUILD)/bench_kvreuse models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf $(SQUAD_FILES)
	$(BUILD)/bench_kvreuse models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf $(SQUAD_DIR) \
	    $(BENCH_KVREUSE_ARGS)

# Prompt-lookup decoding against plain decoding over SQuAD questions and free-text prompts
# (bench/bench_lookup.c): built with everything so it always compiles, run by `make
# bench-lookup` on the default model (about 10 minutes on 2 cores; BENCH_LOOKUP_ARGS=--questions
# 5 for a short run, --lookup K for another draft length).
BINS += $(BUILD)/bench_lookup
$(BUILD)/bench_lookup: $(BUILD)/bench/bench_lookup.o $(LIB_RETRIEVER) $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(RETRIEVER_LIBS) $(MODEL_LIBS) $(LDLIBS)

BENCH_LOOKUP_ARGS ?=
bench-lookup: $(BUILD)/bench_lookup models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf $(SQUAD_FILES)
	$(BUILD)/bench_lookup models/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf $(SQUAD_DIR) \
	    $(BENCH_LOOKUP_ARGS)

.PHONY: bench-retriever bench-kvreuse bench-lookup
