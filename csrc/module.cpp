// Python module entry for osd_kernels._C. The ops register with the torch dispatcher
// (schemas: TORCH_LIBRARY in ops.cpp; kernels: TORCH_LIBRARY_IMPL in cpu/ and cuda/) when
// the shared library is loaded; this file only gives Python something to import.
#include <Python.h>

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
  return m;
}
