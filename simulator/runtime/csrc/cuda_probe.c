/* Loads libcuda.so.1 the way a CUDA program does (the dynamic loader, searching LD_LIBRARY_PATH),
 * calls cuDriverGetVersion, and prints the version and the file the loader picked:
 *   libcuda.so.1 <path> cuDriverGetVersion=<n>
 * Dynamically linked on purpose; the test image carries the host's loader and libc for it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

int main(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("dlopen failed: %s\n", dlerror());
        return 1;
    }
    int (*get_version)(int *) = (int (*)(int *))dlsym(lib, "cuDriverGetVersion");
    if (!get_version) {
        printf("dlsym failed: %s\n", dlerror());
        return 1;
    }
    Dl_info info;
    int version = 0;
    int rc = get_version(&version);
    if (!dladdr((void *)get_version, &info) || !info.dli_fname) {
        printf("dladdr failed\n");
        return 1;
    }
    printf("libcuda.so.1 %s cuDriverGetVersion=%d rc=%d\n", info.dli_fname, version, rc);
    return rc;
}
