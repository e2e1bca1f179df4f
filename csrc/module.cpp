// Python module entry for osd_kernels._C. The ops register with the torch dispatcher
// (schemas: TORCH_LIBRARY in ops.cpp; kernels: TORCH_LIBRARY_IMPL in cpu/ and cuda/) when
// the shared library is loaded; this file gives Python something to import and a few
// constants about the build and the CPU.
#include <Python.h>

#include "cpu/fast_math.h"
#include "cpu/quant_linear_x16.h"

static struct PyModuleDef osd_module = {PyModuleDef_HEAD_INIT, "_C",
                                        "osd native kernels (torch.ops.osd.*)", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&osd_module);
  if (m == nullptr) return nullptr;
#ifdef OSD_WITH_CUDA
  PyModule_AddIntConstant(m, "WITH_CUDA", 1);
#else
  PyModule_AddIntConstant(m, "WITH_CUDA", 0);
#endif
  // Whether the CPU kernels' AVX-512 paths can run here (osd_kernels.use_avx512 adds the
  // OSD_NO_AVX512 / OSD_NO_AVX2 switches, read per call as the kernels read them).
  PyModule_AddIntConstant(m, "CPU_AVX512", osd::cpu_has_avx512() ? 1 : 0);
  // Whether quant_linear's int8-activation types run on VNNI here (else a portable loop).
  PyModule_AddIntConstant(m, "CPU_AVX512_VNNI",
                          osd::cpu_has_avx512() && __builtin_cpu_supports("avx512vnni") ? 1 : 0);
  // Whether its passes of several rows run on AMX-INT8 tiles here (asks the OS for them).
  PyModule_AddIntConstant(m, "CPU_AMX_INT8", osd::x16_amx_available() ? 1 : 0);
  return m;
}
