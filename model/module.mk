# model/: what is computed (GGUF, config, weights, tokenizer, forward pass, KV cache, sampler).
MODEL_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard model/*.c))
LIB_MODEL  := $(BUILD)/libdiffrag_model.a
MODEL_LIBS := $(LIB_MODEL) $(BLAS_LIBS)

$(LIB_MODEL): $(MODEL_OBJS) $(KERNEL_OBJS)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

BINS += $(BUILD)/diffrag-run
$(BUILD)/diffrag-run: $(BUILD)/tools/diffrag_run.o $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)
