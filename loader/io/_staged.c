/* gdsload's staged reader: files in the page cache (or tmpfs) to GPU memory through small pinned buffers.
 *
 * Reader threads take file chunks from one queue in order, pread(2) each into one of their own pinned host
 * buffers and start its host-to-device copy on their own CUDA stream, then read the next chunk into the next
 * buffer while the copy runs; a buffer is reused once the event recorded after its copy has completed. Pinned
 * staging is threads * buffers * chunk bytes, allocated once per pool (16 threads with two 2 MiB buffers each
 * was the fastest shape measured; smaller buffers, which stay in the cores' caches, were slower).
 *
 * The staging is one anonymous mapping asking for transparent huge pages; each thread faults in its own slice
 * (the kernel zeroes the pages in parallel) and registers it with the driver. On an H200 host that pinned 64 MiB
 * in 5-6 ms, against 22-37 ms for cuMemHostAlloc, which zeroes and pins page by page under the driver's lock
 * (bench/RESULTS.md). Where registering fails, a thread falls back to cuMemHostAlloc. gdsl_start starts the
 * threads (and so the pinning) before the first ticket, so that a load can overlap it with its planning.
 *
 * Work arrives as tickets (gdsl_submit): one whole rank for a plain load, one staging group after another for
 * a compressed one, the threads moving on to the next ticket's chunks while the last copies of the previous
 * one are in flight. A ticket is done when the last copy of its chunks has completed; the first error of a
 * ticket (a read error, the file ending early, a CUDA error) is kept with the extent it happened in, and its
 * remaining chunks are skipped.
 *
 * The CUDA driver API is looked up at run time (dlopen of libcuda.so.1), so this builds with a C compiler
 * alone and loads where no driver is. With a NULL context the pool copies into host memory instead
 * (memcpy from the same staging buffers): the tests drive every path of the pool that way on hosts
 * without a GPU.
 *
 * Python reaches it through ctypes (gdsload.loader.io.staged); ctypes releases the GIL around every call.
 */
#define _GNU_SOURCE
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef void *CUcontext, *CUstream, *CUevent;
typedef unsigned long long CUdeviceptr;

static struct {
    CUresult (*ctx_set)(CUcontext);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    CUresult (*free_host)(void *);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_sync)(CUstream);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*copy)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
    int loaded;
} cu;
static pthread_mutex_t cu_lock = PTHREAD_MUTEX_INITIALIZER;

static int load_cuda(void) {
    pthread_mutex_lock(&cu_lock);
    if (!cu.loaded) {
        void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        int ok = h != NULL;
#define SYM(field, name) if (ok && !(*(void **)&cu.field = dlsym(h, name))) ok = 0;
        SYM(ctx_set, "cuCtxSetCurrent") SYM(host_alloc, "cuMemHostAlloc") SYM(free_host, "cuMemFreeHost")
        SYM(stream_create, "cuStreamCreate") SYM(stream_sync, "cuStreamSynchronize")
        SYM(stream_destroy, "cuStreamDestroy_v2") SYM(event_create, "cuEventCreate")
        SYM(event_record, "cuEventRecord") SYM(event_query, "cuEventQuery")
        SYM(event_destroy, "cuEventDestroy_v2") SYM(copy, "cuMemcpyHtoDAsync_v2")
        SYM(host_register, "cuMemHostRegister_v2") SYM(host_unregister, "cuMemHostUnregister")
#undef SYM
        cu.loaded = ok ? 1 : -1;
    }
    pthread_mutex_unlock(&cu_lock);
    return cu.loaded == 1 ? 0 : -1;
}

/* One range of one file to one destination address; tag comes back with an error (the caller's extent index). */
typedef struct { int fd; int tag; long long offset; long long length; unsigned long long dst; } gdsl_extent;

enum { GDSL_OK = 0, GDSL_EOF = 1, GDSL_READ = 2, GDSL_CUDA = 3, GDSL_NOMEM = 4, GDSL_INVALID = 5 };

/* The most chunks one ticket may queue (2 MiB chunks: 128 TiB; the 4 KiB minimum: 256 GiB): a length from a
   damaged caller is refused here instead of growing the queue without bound. */
#define GDSL_MAX_TICKET_CHUNKS (1L << 26)
/* What went wrong first in a ticket: code, errno (GDSL_READ) or CUresult (GDSL_CUDA), the extent's tag and
   the file offset of the chunk. */
typedef struct { int code; int detail; int tag; long long offset; } gdsl_error;

typedef struct ticket {
    long pending;          /* chunks not yet copied (or skipped) */
    long long done_bytes;  /* bytes whose copy has completed */
    gdsl_error error;
} ticket;

typedef struct { int fd; int tag; long long offset; size_t length; unsigned long long dst; ticket *t; } chunk;

typedef struct pool {
    CUcontext ctx;  /* NULL: host destinations */
    int threads;
    size_t chunk;
    int buffers;
    pthread_mutex_t mu;
    pthread_cond_t work;  /* chunks queued, or stopping */
    pthread_cond_t done;  /* a ticket progressed */
    chunk *queue;
    size_t head, tail, cap;
    int stopping;
    int started;
    pthread_t *tids;
    int next_id;             /* the slice of the staging mapping the next thread to start takes */
    char *staging;           /* threads slices of `slice` bytes (NULL: every thread allocates its own) */
    void *staging_base;      /* the mapping itself (staging rounded up to 2 MiB) */
    size_t staging_len, slice;
    gdsl_error setup_error;  /* a thread could not set itself up */
} pool;

static void fail(ticket *t, int code, int detail, int tag, long long offset) {
    if (t->error.code == GDSL_OK) {
        t->error.code = code;
        t->error.detail = detail;
        t->error.tag = tag;
        t->error.offset = offset;
    }
}

/* Account for a chunk whose copy completed (or that was skipped); the caller holds e->mu. */
static void credit(pool *e, ticket *t, size_t bytes) {
    t->done_bytes += (long long)bytes;
    if (--t->pending == 0 || bytes) pthread_cond_broadcast(&e->done);
}

typedef struct { void *buf; CUevent ev; chunk c; int busy; } slot;

/* Wait for a copy to complete: poll its event, yielding the core between polls to any other thread that can run
   (a compressed load's decoder, the caller). Spinning in cuEventSynchronize kept those threads off the cores, and
   a blocking-sync event (the thread sleeps) slowed the reads by 5%: bench/RESULTS.md. */
static CUresult wait_event(CUevent ev) {
    for (;;) {
        CUresult r = cu.event_query(ev);
        if (r != 600 /* CUDA_ERROR_NOT_READY */) return r;
        sched_yield();
    }
}

static void retire(pool *e, slot *s) {
    if (!s->busy) return;
    int r = e->ctx ? wait_event(s->ev) : 0;
    pthread_mutex_lock(&e->mu);
    if (r) fail(s->c.t, GDSL_CUDA, r, s->c.tag, s->c.offset);
    credit(e, s->c.t, r ? 0 : s->c.length);
    pthread_mutex_unlock(&e->mu);
    s->busy = 0;
}

/* Pin this thread's slice of the staging mapping: fault its pages in here (in parallel with the other threads),
   then register it. Returns the slice, or NULL when it cannot be pinned that way. */
static char *pin_slice(pool *e, int id) {
    if (!e->staging) return NULL;
    char *p = e->staging + (size_t)id * e->slice;
    for (size_t off = 0; off < e->slice; off += 4096) p[off] = 0;
    return cu.host_register(p, e->slice, 0) ? NULL : p;
}

static void *worker(void *arg) {
    pool *e = arg;
    slot *slots = calloc((size_t)e->buffers, sizeof(slot));
    CUstream stream = NULL;
    char *pinned = NULL;
    int ok = slots != NULL, err = 0, k = 0;
    pthread_mutex_lock(&e->mu);
    int id = e->next_id++;
    pthread_mutex_unlock(&e->mu);
    if (ok && e->ctx) {
        ok = !(err = cu.ctx_set(e->ctx)) && !(err = cu.stream_create(&stream, 1 /* non-blocking */));
        if (ok) pinned = pin_slice(e, id);
        for (int i = 0; ok && i < e->buffers; i++) {
            if (pinned) slots[i].buf = pinned + (size_t)i * e->chunk;
            else ok = !(err = cu.host_alloc(&slots[i].buf, e->chunk, 0));
            ok = ok && !(err = cu.event_create(&slots[i].ev, 2 /* no timing */));
        }
    } else if (ok) {
        for (int i = 0; ok && i < e->buffers; i++) ok = (slots[i].buf = aligned_alloc(4096, e->chunk)) != NULL;
    }
    if (!ok) {
        pthread_mutex_lock(&e->mu);
        if (e->setup_error.code == GDSL_OK) e->setup_error = (gdsl_error){err ? GDSL_CUDA : GDSL_NOMEM, err, -1, 0};
        pthread_mutex_unlock(&e->mu);
    }
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (e->head == e->tail && !e->stopping) {
            /* Nothing queued: finish the copies in flight before sleeping, so their tickets can complete. */
            int any = 0;
            for (int i = 0; i < e->buffers; i++) any |= slots ? slots[i].busy : 0;
            if (!any) {
                pthread_cond_wait(&e->work, &e->mu);
                continue;
            }
            pthread_mutex_unlock(&e->mu);
            for (int i = 0; i < e->buffers; i++) retire(e, &slots[i]);
            pthread_mutex_lock(&e->mu);
        }
        if (e->head == e->tail) {  /* stopping, queue empty */
            pthread_mutex_unlock(&e->mu);
            break;
        }
        chunk c = e->queue[e->head++ % e->cap];
        int skip = !ok || c.t->error.code != GDSL_OK;
        if (!ok) fail(c.t, e->setup_error.code, e->setup_error.detail, c.tag, c.offset);
        if (skip) {
            credit(e, c.t, 0);
            pthread_mutex_unlock(&e->mu);
            continue;
        }
        pthread_mutex_unlock(&e->mu);

        slot *s = &slots[k];
        retire(e, s);  /* its last copy has completed: the buffer is free */
        size_t got = 0;
        int rerr = 0;
        while (got < c.length) {
            ssize_t n = pread(c.fd, (char *)s->buf + got, c.length - got, (off_t)(c.offset + (long long)got));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) {
                rerr = n == 0 ? -1 : errno;
                break;
            }
            got += (size_t)n;
        }
        int cerr = 0;
        if (!rerr) {
            if (e->ctx) {
                cerr = cu.copy(c.dst, s->buf, c.length, stream);
                if (!cerr) cerr = cu.event_record(s->ev, stream);
            } else {
                memcpy((void *)(uintptr_t)c.dst, s->buf, c.length);
            }
        }
        if (rerr || cerr) {
            pthread_mutex_lock(&e->mu);
            if (rerr) fail(c.t, rerr < 0 ? GDSL_EOF : GDSL_READ, rerr < 0 ? 0 : rerr, c.tag,
                           c.offset + (long long)got);
            else fail(c.t, GDSL_CUDA, cerr, c.tag, c.offset);
            credit(e, c.t, 0);
            pthread_mutex_unlock(&e->mu);
            continue;
        }
        s->c = c;
        s->busy = 1;
        k = (k + 1) % e->buffers;
    }
    if (slots) {
        for (int i = 0; i < e->buffers; i++) retire(e, &slots[i]);
        for (int i = 0; i < e->buffers; i++) {
            if (e->ctx) {
                if (slots[i].ev) cu.event_destroy(slots[i].ev);
                if (slots[i].buf && !pinned) cu.free_host(slots[i].buf);
            } else {
                free(slots[i].buf);
            }
        }
        free(slots);
    }
    if (pinned) cu.host_unregister(pinned);
    if (stream) cu.stream_destroy(stream);
    return NULL;
}

/* A pool of `threads` readers, each with `buffers` staging buffers of `chunk` bytes, copying in `ctx`
   (a CUDA context; NULL: into host memory). Returns NULL when the CUDA driver cannot be loaded or memory is short;
   the threads start, and pin their buffers, with the first ticket. */
pool *gdsl_open(void *ctx, int threads, size_t chunk, int buffers) {
    if (threads < 1 || buffers < 1 || chunk < 4096) return NULL;
    if (ctx && load_cuda()) return NULL;
    pool *e = calloc(1, sizeof(pool));
    if (!e) return NULL;
    e->ctx = ctx;
    e->threads = threads;
    e->chunk = chunk;
    e->buffers = buffers;
    e->tids = calloc((size_t)threads, sizeof(pthread_t));
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->done, NULL);
    if (!e->tids) {
        free(e);
        return NULL;
    }
    if (ctx) {  /* the staging mapping, 2 MiB-aligned slices; its pages are faulted in by the threads */
        const size_t huge = 2u << 20;
        e->slice = ((size_t)buffers * chunk + huge - 1) / huge * huge;
        e->staging_len = (size_t)threads * e->slice + huge;
        void *m = mmap(NULL, e->staging_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            e->staging_len = 0;
        } else {
            e->staging = (char *)(((uintptr_t)m + huge - 1) / huge * huge);
            madvise(e->staging, (size_t)threads * e->slice, MADV_HUGEPAGE);  /* a hint: 4 KiB pages work too */
            e->staging_base = m;
        }
    }
    return e;
}

static int start(pool *e) {
    for (; e->started < e->threads; e->started++)
        if (pthread_create(&e->tids[e->started], NULL, worker, e)) return e->started ? 0 : -1;
    return 0;
}

/* Start the reader threads now (they pin their staging, then wait for tickets); 0 when at least one runs. */
int gdsl_start(pool *e) {
    pthread_mutex_lock(&e->mu);
    int r = e->started ? 0 : start(e);
    pthread_mutex_unlock(&e->mu);
    return r;
}

/* Queue `n` extents as one ticket; NULL when memory is short or no reader thread could start (errno ENOMEM,
   EAGAIN), or an extent is not a range of a file (a negative offset or length, an end past 2^63 - 1) or the
   ticket would need more than GDSL_MAX_TICKET_CHUNKS chunks (errno EINVAL, EOVERFLOW). */
ticket *gdsl_submit(pool *e, const gdsl_extent *x, long n) {
    if (!e || n < 0 || (n && !x)) {
        errno = EINVAL;
        return NULL;
    }
    long chunks = 0;
    const long long step = (long long)e->chunk;
    for (long i = 0; i < n; i++) {
        if (x[i].offset < 0 || x[i].length < 0 || x[i].offset > LLONG_MAX - x[i].length) {
            errno = EINVAL;
            return NULL;
        }
        long long k = x[i].length / step + (x[i].length % step != 0);  /* no overflow: no rounding up first */
        if (k > GDSL_MAX_TICKET_CHUNKS - chunks) {
            errno = EOVERFLOW;
            return NULL;
        }
        chunks += (long)k;
    }
    ticket *t = calloc(1, sizeof(ticket));
    if (!t) {
        errno = ENOMEM;
        return NULL;
    }
    pthread_mutex_lock(&e->mu);
    if (e->stopping || (!e->started && start(e))) {
        pthread_mutex_unlock(&e->mu);
        free(t);
        errno = EAGAIN;
        return NULL;
    }
    size_t used = e->tail - e->head;
    if (used + (size_t)chunks > e->cap) {
        size_t cap = e->cap ? e->cap : 1024;
        while (cap < used + (size_t)chunks && cap <= SIZE_MAX / 2 / sizeof(chunk)) cap *= 2;
        chunk *q = cap >= used + (size_t)chunks ? malloc(cap * sizeof(chunk)) : NULL;
        if (!q) {
            pthread_mutex_unlock(&e->mu);
            free(t);
            errno = ENOMEM;
            return NULL;
        }
        for (size_t i = 0; i < used; i++) q[i] = e->queue[(e->head + i) % e->cap];
        free(e->queue);
        e->queue = q;
        e->cap = cap;
        e->head = 0;
        e->tail = used;
    }
    t->pending = chunks;
    for (long i = 0; i < n; i++)
        for (long long off = 0; off < x[i].length; off += (long long)e->chunk) {
            long long len = x[i].length - off < (long long)e->chunk ? x[i].length - off : (long long)e->chunk;
            e->queue[e->tail++ % e->cap] = (chunk){x[i].fd, x[i].tag, x[i].offset + off, (size_t)len,
                                                   x[i].dst + (unsigned long long)off, t};
        }
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
    return t;
}

/* Wait up to `timeout_ms` (< 0: until done) for ticket `t`. Returns 1 when done (then *err holds its first error,
   code 0 for none, and the ticket is freed), 0 on timeout; *done_bytes is the bytes copied so far. A ticket is
   waited for until done once: after that it is gone (the Python side keeps its outcome). */
int gdsl_wait(pool *e, ticket *t, int timeout_ms, long long *done_bytes, gdsl_error *err) {
    if (!e || !t) {
        *done_bytes = 0;
        *err = (gdsl_error){GDSL_INVALID, EINVAL, -1, 0};
        return 1;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    if (timeout_ms >= 0) {
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&e->mu);
    while (t->pending > 0) {
        if (timeout_ms < 0) pthread_cond_wait(&e->done, &e->mu);
        else if (pthread_cond_timedwait(&e->done, &e->mu, &until) == ETIMEDOUT) break;
    }
    int finished = t->pending == 0;
    *done_bytes = t->done_bytes;
    *err = t->error;
    pthread_mutex_unlock(&e->mu);
    if (finished) free(t);
    return finished;
}

/* Finish the work queued, stop the threads, free their buffers and the pool. */
void gdsl_close(pool *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    pthread_cond_broadcast(&e->work);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < e->started; i++) pthread_join(e->tids[i], NULL);
    free(e->tids);
    free(e->queue);
    if (e->staging_base) munmap(e->staging_base, e->staging_len);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->work);
    pthread_cond_destroy(&e->done);
    free(e);
}

/* An importable module, so that the install places it like any extension; its functions are called through ctypes. */
static struct PyModuleDef staged_module = {PyModuleDef_HEAD_INIT, "_staged",
                                           "gdsload's staged reader (called through ctypes).", -1, NULL};
PyMODINIT_FUNC PyInit__staged(void) { return PyModule_Create(&staged_module); }
