# model/: what is computed (GGUF, config, weights, tokenizer, forward pass, KV cache, sampler).
MODEL_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard model/*.c))
LIB_MODEL  := $(BUILD)/libdiffrag_model.a
MODEL_LIBS := $(LIB_MODEL) $(TEXT_LIBS) $(BLAS_LIBS)

# The model library is remade when the text library changes, so that everything linked with
# both is relinked; the archive itself holds only the model's and the kernels' objects.
$(LIB_MODEL): $(MODEL_OBJS) $(KERNEL_OBJS) $(LIB_TEXT)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $(filter %.o,$^)

BINS += $(BUILD)/diffrag-run
$(BUILD)/diffrag-run: $(BUILD)/tools/diffrag_run.o $(LIB_MODEL)
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)
