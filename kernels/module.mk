# kernels/: how each operation runs on each device. CPU kernels always; CUDA when nvcc exists.
KERNEL_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard kernels/*.c kernels/cpu/*.c))
BLAS_LIBS   := -lopenblas
