/* CPU-only stand-in for libnvidia-ml.so.1: one Hopper device, for import checks. */
#include <string.h>
typedef void *nvmlDevice_t;
int nvmlInit_v2(void) { return 0; }
int nvmlInit(void) { return 0; }
int nvmlInitWithFlags(unsigned f) { (void)f; return 0; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = 1; return 0; }
int nvmlDeviceGetCount(unsigned *n) { *n = 1; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, nvmlDevice_t *d) { (void)i; *d = (void *)1; return 0; }
int nvmlDeviceGetHandleByIndex(unsigned i, nvmlDevice_t *d) { (void)i; *d = (void *)1; return 0; }
int nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *ma, int *mi) { (void)d; *ma = 9; *mi = 0; return 0; }
int nvmlDeviceGetName(nvmlDevice_t d, char *s, unsigned n) { (void)d; strncpy(s, "NVIDIA H200 (stub)", n); return 0; }
int nvmlSystemGetDriverVersion(char *s, unsigned n) { strncpy(s, "580.159.04", n); return 0; }
int nvmlSystemGetCudaDriverVersion_v2(int *v) { *v = 13000; return 0; }
int nvmlSystemGetCudaDriverVersion(int *v) { *v = 13000; return 0; }
const char *nvmlErrorString(int r) { (void)r; return "stub"; }
int nvmlDeviceGetP2PStatus(nvmlDevice_t a, nvmlDevice_t b, int i, int *s) { (void)a; (void)b; (void)i; *s = 0; return 0; }
int nvmlDeviceGetTopologyCommonAncestor(nvmlDevice_t a, nvmlDevice_t b, int *l) { (void)a; (void)b; *l = 0; return 0; }
