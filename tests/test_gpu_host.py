"""The GPU path on a machine without a GPU: tests/gpu/gpu_check, the program tests/gpu/run.sh
runs on a GPU, run here against the host emulation of the GPU table (tests/gpu/host_gpu.c,
loaded in place of the CUDA backend through DIFFRAG_CUDA_LIB). That drives everything above
the kernels as a GPU run does: the engine's GPU contexts (model/engine_gpu.c: the paged KV
cache, the activation block, logits left on the device, sampling's pass and its candidates,
the masses and lambdas copied after the last layer) against CPU contexts of the default model,
and the GPU checks' own logic. The CUDA kernels themselves are checked only on a GPU."""
import os
import re
import subprocess

from conftest import BUILD


def test_gpu_checks_against_the_host_emulation(default_model):
    lib = BUILD / "tests" / "libdiffrag_hostgpu.so"
    check = BUILD / "tests" / "gpu" / "gpu_check"
    assert lib.exists() and check.exists(), "run make first"
    env = dict(os.environ, DIFFRAG_CUDA_LIB=str(lib.resolve()), OPENBLAS_NUM_THREADS="1")
    r = subprocess.run([str(check), "--quick", "--threads", "2", str(default_model)], env=env,
                       capture_output=True, text=True, timeout=3600)
    out = r.stdout + r.stderr
    print(out[-3000:])
    assert "device 0: host emulation of the GPU table" in out, out[-3000:]
    assert r.returncode == 0 and "PASS: 0 failed checks" in out, out[-6000:]
    oks = re.findall(r"^ok   (.*)$", out, re.M)
    # the operations, sampling's pass in 14 settings, 16 attention sequences, and 4 end-to-end
    # checks for each of the two forms
    assert sum(o.startswith("sample (") for o in oks) == 14, oks
    assert sum(o.startswith("attention (") for o in oks) >= 16, oks
    for form in ("GQA form", "DIFF V2 form"):
        e2e = [o for o in oks if o.startswith(form + ", ")]
        assert len(e2e) == 4, (form, e2e)
        assert any("greedy sampling on the device" in o for o in e2e), e2e
