/* A CPU-second clock for benchmarks on a loaded machine (LD_PRELOAD shim, Linux / glibc).
 *
 * Every read of CLOCK_MONOTONIC (Python's time.monotonic / perf_counter, the search's own
 * deadline checks in C) returns the process's CPU time instead, so a time budget and the times
 * a benchmark prints are CPU seconds: with one search thread (--workers 1) a machine shared
 * with other jobs measures what one idle core would do. Waits with a timeout (sleep,
 * Event.wait) no longer wait: use it only for runs that do not sleep (bench_scale.py does not).
 *
 *   cc -O2 -shared -fPIC -o benchmarks/cpuclock.so benchmarks/cpuclock.c -ldl
 *   LD_PRELOAD=$PWD/benchmarks/cpuclock.so .venv/bin/python benchmarks/bench_scale.py \
 *       --workers 1 --budget 60 --cases close-4096
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);

int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!real_clock_gettime)
        real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
    if (id == CLOCK_MONOTONIC || id == CLOCK_MONOTONIC_RAW)
        id = CLOCK_PROCESS_CPUTIME_ID;
    return real_clock_gettime(id, ts);
}
