/*
 * A fake NVML library for tests: the entry points memwatch reaches through the official
 * nvidia-ml-py bindings, answering from a scenario file instead of a GPU.
 *
 * Build:  gcc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 *
 * The scenario file is named by the environment variable MEMWATCH_FAKE_NVML_SCRIPT and is re-read on
 * every call, so a test can change the machine while a process watches it. One directive a line,
 * '#' starts a comment:
 *
 *   driver VERSION                      driver version string (absent: NOT_SUPPORTED)
 *   device UUID TOTAL USED NAME...      a GPU; indices follow the order of the lines; free = TOTAL - USED
 *   process DEVICE PID USED             a compute process on device DEVICE; USED may be "na"
 *   error FUNCTION CODE [device=N] [first=K]
 *                                       FUNCTION returns CODE (on device N only; for its first K calls
 *                                       only, counted from when the file or its content last changed)
 *
 * Without the variable or the file, initialisation fails with NVML_ERROR_DRIVER_NOT_LOADED. A handle
 * whose device has disappeared from the file answers NVML_ERROR_GPU_IS_LOST. Buffers that are too
 * small get NVML_ERROR_INSUFFICIENT_SIZE, as from the real library. Struct layouts follow nvml.h.
 */

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_UNKNOWN = 999,
};

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

typedef struct fake_device {
    unsigned int index;
} *nvmlDevice_t;

#define MAX_DEVICES 16
#define MAX_PROCESSES 1024
#define MAX_ERRORS 64
#define MAX_SCRIPT_BYTES 65536
#define TEXT_BYTES 128
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

struct device_spec {
    char uuid[TEXT_BYTES];
    char name[TEXT_BYTES];
    unsigned long long total;
    unsigned long long used;
};

struct process_spec {
    unsigned int device;
    unsigned int pid;
    unsigned long long used;
};

struct error_spec {
    char function[TEXT_BYTES];
    nvmlReturn_t code;
    int device;          /* -1: every device */
    long first;          /* -1: every call */
};

struct scenario {
    char driver[TEXT_BYTES];
    unsigned int device_count;
    struct device_spec devices[MAX_DEVICES];
    unsigned int process_count;
    struct process_spec processes[MAX_PROCESSES];
    unsigned int error_count;
    struct error_spec errors[MAX_ERRORS];
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int init_count;
static struct fake_device handles[MAX_DEVICES];
static struct scenario current;
static char last_text[MAX_SCRIPT_BYTES];
static char last_path[4096];
static long error_calls[MAX_ERRORS];

static void copy_text(char *dst, const char *src) {
    snprintf(dst, TEXT_BYTES, "%s", src);
}

static void parse_error_line(char *rest, struct scenario *s) {
    if (s->error_count >= MAX_ERRORS) return;
    struct error_spec *e = &s->errors[s->error_count];
    char *function = strtok(rest, " \t");
    char *code = strtok(NULL, " \t");
    if (!function || !code) return;
    copy_text(e->function, function);
    e->code = atoi(code);
    e->device = -1;
    e->first = -1;
    for (char *opt = strtok(NULL, " \t"); opt; opt = strtok(NULL, " \t")) {
        if (strncmp(opt, "device=", 7) == 0) e->device = atoi(opt + 7);
        else if (strncmp(opt, "first=", 6) == 0) e->first = atol(opt + 6);
    }
    s->error_count++;
}

static void parse_line(char *line, struct scenario *s) {
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char *keyword = strtok(line, " \t");
    if (!keyword) return;
    char *rest = strtok(NULL, "");
    if (!rest) rest = "";
    while (*rest == ' ' || *rest == '\t') rest++;

    if (strcmp(keyword, "driver") == 0) {
        copy_text(s->driver, rest);
    } else if (strcmp(keyword, "device") == 0 && s->device_count < MAX_DEVICES) {
        struct device_spec *d = &s->devices[s->device_count];
        int consumed = 0;
        char uuid[TEXT_BYTES];
        if (sscanf(rest, "%127s %llu %llu %n", uuid, &d->total, &d->used, &consumed) < 3) return;
        copy_text(d->uuid, uuid);
        copy_text(d->name, rest + consumed);
        s->device_count++;
    } else if (strcmp(keyword, "process") == 0 && s->process_count < MAX_PROCESSES) {
        struct process_spec *p = &s->processes[s->process_count];
        char used[TEXT_BYTES];
        if (sscanf(rest, "%u %u %127s", &p->device, &p->pid, used) < 3) return;
        p->used = strcmp(used, "na") == 0 ? NOT_AVAILABLE : strtoull(used, NULL, 10);
        s->process_count++;
    } else if (strcmp(keyword, "error") == 0) {
        parse_error_line(rest, s);
    }
}

/* Re-read the scenario into `current`; 0 on success. Call with the lock held. */
static int load_scenario(void) {
    const char *path = getenv("MEMWATCH_FAKE_NVML_SCRIPT");
    if (!path) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    static char text[MAX_SCRIPT_BYTES];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';

    if (strcmp(text, last_text) != 0 || strncmp(path, last_path, sizeof last_path) != 0) {
        memcpy(last_text, text, n + 1);
        snprintf(last_path, sizeof last_path, "%s", path);
        memset(error_calls, 0, sizeof error_calls);
    }
    memset(&current, 0, sizeof current);
    char *save = NULL;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        parse_line(line, &current);
    }
    return 0;
}

/* The scripted error for this call, or NVML_SUCCESS. `device` is -1 for calls without a device. */
static nvmlReturn_t forced_error(const char *function, int device) {
    for (unsigned int i = 0; i < current.error_count; i++) {
        struct error_spec *e = &current.errors[i];
        if (strcmp(e->function, function) != 0) continue;
        if (e->device >= 0 && e->device != device) continue;
        if (e->first >= 0 && error_calls[i] >= e->first) continue;
        error_calls[i]++;
        return e->code;
    }
    return NVML_SUCCESS;
}

/* Common prologue of every call after init: lock, reload, scripted errors. */
static nvmlReturn_t enter(const char *function, int device) {
    pthread_mutex_lock(&lock);
    if (init_count == 0) return NVML_ERROR_UNINITIALIZED;
    if (load_scenario() != 0) return NVML_ERROR_UNKNOWN;
    return forced_error(function, device);
}

static nvmlReturn_t leave(nvmlReturn_t ret) {
    pthread_mutex_unlock(&lock);
    return ret;
}

/* Index of a handle's device, or -1 when the handle is not one of ours. */
static int handle_index(nvmlDevice_t device) {
    if (device < &handles[0] || device >= &handles[MAX_DEVICES]) return -1;
    return (int)device->index;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (load_scenario() != 0) return leave(NVML_ERROR_DRIVER_NOT_LOADED);
    nvmlReturn_t ret = forced_error("nvmlInitWithFlags", -1);
    if (ret == NVML_SUCCESS) {
        for (unsigned int i = 0; i < MAX_DEVICES; i++) handles[i].index = i;
        init_count++;
    }
    return leave(ret);
}

nvmlReturn_t nvmlInit_v2(void) {
    return nvmlInitWithFlags(0);
}

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&lock);
    if (init_count == 0) return leave(NVML_ERROR_UNINITIALIZED);
    init_count--;
    return leave(NVML_SUCCESS);
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t ret = enter("nvmlSystemGetDriverVersion", -1);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (current.driver[0] == '\0') return leave(NVML_ERROR_NOT_SUPPORTED);
    return leave(copy_string(version, length, current.driver));
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    nvmlReturn_t ret = enter("nvmlDeviceGetCount_v2", -1);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = current.device_count;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t ret = enter("nvmlDeviceGetHandleByIndex_v2", (int)index);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!device || index >= current.device_count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *device = &handles[index];
    return leave(NVML_SUCCESS);
}

/* Prologue of a per-device call: the device's spec in *spec, or an error. */
static nvmlReturn_t enter_device(const char *function, nvmlDevice_t device, struct device_spec **spec) {
    int index = handle_index(device);
    nvmlReturn_t ret = enter(function, index);
    if (ret != NVML_SUCCESS) return ret;
    if (index < 0) return NVML_ERROR_INVALID_ARGUMENT;
    if ((unsigned int)index >= current.device_count) return NVML_ERROR_GPU_IS_LOST;
    *spec = &current.devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    struct device_spec *spec = NULL;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetName", device, &spec);
    if (ret != NVML_SUCCESS) return leave(ret);
    return leave(copy_string(name, length, spec->name));
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    struct device_spec *spec = NULL;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetUUID", device, &spec);
    if (ret != NVML_SUCCESS) return leave(ret);
    return leave(copy_string(uuid, length, spec->uuid));
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    struct device_spec *spec = NULL;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetMemoryInfo", device, &spec);
    if (ret != NVML_SUCCESS) return leave(ret);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    memory->total = spec->total;
    memory->used = spec->used;
    memory->free = spec->used < spec->total ? spec->total - spec->used : 0;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                     nvmlProcessInfo_t *infos) {
    struct device_spec *spec = NULL;
    nvmlReturn_t ret = enter_device("nvmlDeviceGetComputeRunningProcesses_v3", device, &spec);
    if (ret != NVML_SUCCESS && ret != NVML_ERROR_INSUFFICIENT_SIZE) return leave(ret);
    if (!infoCount) return leave(NVML_ERROR_INVALID_ARGUMENT);

    unsigned int index = handle_index(device), found = 0;
    for (unsigned int i = 0; i < current.process_count; i++) {
        if (current.processes[i].device == index) found++;
    }
    if (ret == NVML_ERROR_INSUFFICIENT_SIZE || *infoCount < found) {
        *infoCount = found;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    if (found > 0 && !infos) return leave(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int written = 0;
    for (unsigned int i = 0; i < current.process_count; i++) {
        struct process_spec *p = &current.processes[i];
        if (p->device != index) continue;
        infos[written].pid = p->pid;
        infos[written].usedGpuMemory = p->used;
        infos[written].gpuInstanceId = 0xFFFFFFFFu;
        infos[written].computeInstanceId = 0xFFFFFFFFu;
        written++;
    }
    *infoCount = found;
    return leave(NVML_SUCCESS);
}
