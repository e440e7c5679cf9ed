# kernels/: how each operation runs on each device. CPU kernels always (the vector paths are
# compiled with per-function target attributes and chosen at run time); CUDA when nvcc exists.
KERNEL_OBJS := $(patsubst %.c,$(BUILD)/%.o,$(wildcard kernels/*.c kernels/cpu/*.c))
BLAS_LIBS   := -lopenblas

# The kernel benchmark behind `make bench-engine` (ceilings, per-shape products, engine split).
BINS += $(BUILD)/bench_kernels
$(BUILD)/bench_kernels: $(BUILD)/bench/bench_kernels.o $(BUILD)/bench/peak_loops.o $(BUILD)/libdiffrag_model.a
	$(CC) $(LDFLAGS) $(BUILD)/bench/bench_kernels.o $(BUILD)/bench/peak_loops.o -o $@ $(MODEL_LIBS) $(LDLIBS)

# The CUDA backend (kernels/cuda/*.cu, CUDA C + cuBLAS) as its own shared object, loaded with
# dlopen when a context asks for a GPU (kernels/gpu.h): built wherever nvcc is found, for
# sm_90a (H100/H200: the Hopper-only instructions) plus compute_90 PTX that newer GPUs compile
# at load. Sanitizer builds leave it out (the sanitizers do not see device code).
NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) $(wildcard /usr/local/cuda/bin/nvcc))
ifneq ($(NVCC),)
ifeq ($(SAN),)
CUDA_HOME   ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_GENCODE := -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=compute_90
NVCCFLAGS   := -O3 -std=c++17 -I. $(CUDA_GENCODE) -Werror all-warnings \
               -Xcompiler -fPIC,-Wall,-Wextra,-fvisibility=hidden \
               -DDIFFRAG_CUDA_ARCHS='"sm_90a + compute_90 PTX"'
CUDA_OBJS   := $(patsubst %.cu,$(BUILD)/%.o,$(wildcard kernels/cuda/*.cu))
CUDA_LIB    := $(BUILD)/libdiffrag_cuda.so
BINS        += $(CUDA_LIB)
$(BUILD)/kernels/cuda/%.o: kernels/cuda/%.cu kernels/cuda/cuda_common.h kernels/gpu.h kernels/gpu_plan.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
$(CUDA_LIB): $(CUDA_OBJS)
	$(NVCC) -shared $(CUDA_GENCODE) $^ -o $@ -lcublas -Xlinker -rpath,$(CUDA_HOME)/lib64
	@echo "built the CUDA backend ($@, $(notdir $(NVCC)) $(shell $(NVCC) --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), sm_90a + compute_90 PTX)"
endif
else
$(info nvcc not found: the CUDA backend (libdiffrag_cuda.so) is not built; the CPU backend is)
endif
