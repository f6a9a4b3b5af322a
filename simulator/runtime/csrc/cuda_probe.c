/* Loads libcuda.so.1 the way a CUDA program does (the dynamic loader, searching LD_LIBRARY_PATH),
 * calls cuDriverGetVersion, and prints the version and the file the loader picked:
 *   libcuda.so.1 <path> cuDriverGetVersion=<n> rc=<rc>
 * With "devices" (a real driver and GPU), it goes on as a CUDA program starts: cuInit, then
 *   devices <count>
 *   device <i> <the device's UUID, 32 hex digits>
 * and with "devices BYTES" it allocates BYTES on device 0, prints "held BYTES" and holds them until
 * SIGTERM (so that NVML sees a process of the container using the GPU).
 * Dynamically linked on purpose; the test image carries the host's loader and libc for it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *lib;

static void *need(const char *name) {
    void *fn = dlsym(lib, name);
    if (!fn) {
        printf("dlsym failed: %s\n", dlerror());
        exit(1);
    }
    return fn;
}

#define CHECK(call, name)                                       \
    do {                                                        \
        int rc_ = (call);                                       \
        if (rc_) {                                              \
            printf("%s failed: CUresult %d\n", (name), rc_);    \
            return 2;                                           \
        }                                                       \
    } while (0)

static void on_term(int sig) {
    (void)sig;
    _exit(0);
}

static int devices(int argc, char **argv) {
    int (*cu_init)(unsigned) = (int (*)(unsigned))need("cuInit");
    int (*count_of)(int *) = (int (*)(int *))need("cuDeviceGetCount");
    int (*device)(int *, int) = (int (*)(int *, int))need("cuDeviceGet");
    int (*uuid_of)(unsigned char *, int) = (int (*)(unsigned char *, int))need("cuDeviceGetUuid_v2");
    int count = 0, dev = 0;
    CHECK(cu_init(0), "cuInit");
    CHECK(count_of(&count), "cuDeviceGetCount");
    printf("devices %d\n", count);
    for (int i = 0; i < count; i++) {
        unsigned char uuid[16];
        CHECK(device(&dev, i), "cuDeviceGet");
        CHECK(uuid_of(uuid, dev), "cuDeviceGetUuid_v2");
        printf("device %d ", i);
        for (int j = 0; j < 16; j++)
            printf("%02x", uuid[j]);
        printf("\n");
    }
    if (argc < 3)
        return 0;
    unsigned long long bytes = strtoull(argv[2], NULL, 10), ptr = 0;
    void *ctx = NULL;
    int (*retain)(void **, int) = (int (*)(void **, int))need("cuDevicePrimaryCtxRetain");
    int (*set_current)(void *) = (int (*)(void *))need("cuCtxSetCurrent");
    int (*alloc)(unsigned long long *, size_t) = (int (*)(unsigned long long *, size_t))need("cuMemAlloc_v2");
    CHECK(device(&dev, 0), "cuDeviceGet");
    CHECK(retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    CHECK(set_current(ctx), "cuCtxSetCurrent");
    CHECK(alloc(&ptr, (size_t)bytes), "cuMemAlloc_v2");
    signal(SIGTERM, on_term);
    printf("held %llu\n", bytes);
    for (;;)
        pause();
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* each line out as it is printed, also into a file */
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("dlopen failed: %s\n", dlerror());
        return 1;
    }
    int (*get_version)(int *) = (int (*)(int *))need("cuDriverGetVersion");
    Dl_info info;
    int version = 0;
    int rc = get_version(&version);
    if (!dladdr((void *)get_version, &info) || !info.dli_fname) {
        printf("dladdr failed\n");
        return 1;
    }
    printf("libcuda.so.1 %s cuDriverGetVersion=%d rc=%d\n", info.dli_fname, version, rc);
    if (rc || argc < 2 || strcmp(argv[1], "devices") != 0)
        return rc;
    return devices(argc, argv);
}
