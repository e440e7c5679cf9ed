# tests/: every tests/test_*.c becomes build/tests/test_* linked against every library; the
# pytest wrapper tests/test_c_units.py runs each one. ASAN_TESTS are also built under
# AddressSanitizer + UBSan in build/asan by `make test`.
TEST_SRCS := $(wildcard tests/test_*.c)
TEST_BINS := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRCS))
ALL_LIBS  := $(RETRIEVER_LIBS) $(MODEL_LIBS)
ALL_DEPS  := $(filter %.a,$(ALL_LIBS))

$(BUILD)/tests/%: $(BUILD)/tests/%.o $(ALL_DEPS)
	$(CC) $(LDFLAGS) $< -o $@ $(ALL_LIBS) $(LDLIBS)

# The GPU checks (tests/gpu/run.sh runs them on a machine with a CUDA GPU); built everywhere
# so they always compile, since the CUDA backend itself is loaded at run time.
BINS += $(BUILD)/tests/gpu/gpu_check
$(BUILD)/tests/gpu/gpu_check: $(BUILD)/tests/gpu/gpu_check.o $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)

# The GPU table carried out on the host (tests/gpu/host_gpu.c), loaded in place of the CUDA
# backend so that `make test` drives the engine's GPU contexts and the GPU checks without a GPU
# (tests/test_gpu_host.py).
BINS += $(BUILD)/tests/libdiffrag_hostgpu.so
$(BUILD)/tests/libdiffrag_hostgpu.so: tests/gpu/host_gpu.c kernels/gpu.h kernels/gpu_plan.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -fPIC -shared $< -o $@ $(LDFLAGS) -lopenblas $(LDLIBS)

# The engine's per-position scores of a token file (tests/test_qwen_oracle.py compares them with
# llama.cpp's record); not a unit test, so not named test_*.
BINS += $(BUILD)/tests/score_positions
$(BUILD)/tests/score_positions: $(BUILD)/tests/score_positions.o $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)

# The prefix cache against cold prefills and batches against sequences alone, on a given model
# (tests/test_engine_serving.py runs it on tiny llama, qwen2 and DIFF V2 models and the default
# one); not a unit test, so not named test_*.
BINS += $(BUILD)/tests/engine_serving
$(BUILD)/tests/engine_serving: $(BUILD)/tests/engine_serving.o $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)

# Chunk KV reuse against full prefills (tests/test_engine_blend.py runs it on tiny llama, qwen2
# and DIFF V2 models, with and without YaRN, and on the default one); not a unit test.
BINS += $(BUILD)/tests/engine_blend
$(BUILD)/tests/engine_blend: $(BUILD)/tests/engine_blend.o $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)
