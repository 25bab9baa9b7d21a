/* A stand-in for libcuda.so.1 and libnvidia-ml.so.1, so that the GPU branch of `epcomm doctor env`
 * (dlopen, symbol lookup, per-GPU and per-pair checks, NVML link types) runs on machines without
 * a GPU. Three GPUs: 0 and 1 are NVLink peers, 2 reaches neither (PCIe across host bridges).
 * STUB_NO_DEVICE=1 makes cuInit fail the way a driver without devices does.
 * Build: cc -shared -fPIC -o libcuda.so.1 stub_driver.c (and copy as libnvidia-ml.so.1). */
#include <stdio.h>
#include <stdlib.h>

#define NGPU 3

int cuInit(unsigned flags) {
  return getenv("STUB_NO_DEVICE") ? 100 /* CUDA_ERROR_NO_DEVICE */ : 0;
}
int cuDriverGetVersion(int *v) {
  return *v = 13000, 0;
}
int cuDeviceGetCount(int *n) {
  return *n = NGPU, 0;
}
int cuDeviceGet(int *dev, int ordinal) {
  return *dev = ordinal, 0;
}
int cuDeviceGetName(char *name, int len, int dev) {
  return snprintf(name, (size_t)len, "Stub GPU %d", dev), 0;
}
int cuDeviceTotalMem_v2(size_t *bytes, int dev) {
  return *bytes = (size_t)80 << 30, 0;
}
int cuDeviceGetAttribute(int *v, int attr, int dev) {
  return *v = attr == 75 ? 9 : 0, 0;
}
int cuDeviceGetPCIBusId(char *bus, int len, int dev) {
  return snprintf(bus, (size_t)len, "00000000:%02X:00.0", 0x10 * (dev + 1)), 0;
}
int cuDeviceCanAccessPeer(int *can, int a, int b) {
  return *can = a < 2 && b < 2, 0;
}
int cuGetErrorName(int rc, const char **s) {
  return *s = rc == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN", 0;
}

int nvmlInit_v2(void) {
  return 0;
}
int nvmlDeviceGetHandleByPciBusId_v2(const char *bus, void **dev) {
  unsigned b = 0;
  if (sscanf(bus, "00000000:%X:00.0", &b) != 1) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
  return *dev = (void *)(size_t)(b / 0x10), 0;
}
int nvmlDeviceGetP2PStatus(void *a, void *b, int index, int *status) {
  *status = index == 2 && (size_t)a < 3 && (size_t)b < 3 ? 0 : 5; /* OK or NOT_SUPPORTED */
  return 0;
}
int nvmlDeviceGetTopologyCommonAncestor(void *a, void *b, int *level) {
  return *level = 40, 0;
}
