# kernels/: how each operation runs on each device. CPU kernels always (the vector paths are
# compiled with per-function target attributes and chosen at run time); CUDA when nvcc exists.
KERNEL_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard kernels/*.c kernels/cpu/*.c))
BLAS_LIBS   := -lopenblas

# The kernel benchmark behind `make bench-engine` (ceilings, per-shape products, engine split).
BINS += $(BUILD)/bench_kernels
$(BUILD)/bench_kernels: $(BUILD)/bench/bench_kernels.o $(BUILD)/libdiffrag_model.a
	$(CC) $(LDFLAGS) $< -o $@ $(MODEL_LIBS) $(LDLIBS)
