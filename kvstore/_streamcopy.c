/*
 * kvstore._streamcopy: copy one buffer into another with non-temporal stores.
 *
 * Why: a put copies a large KV block (256 KiB .. 2 MiB per row) into an arena slot
 * that nobody reads again soon (the GPU or another process reads it later, if at
 * all). With ordinary stores the CPU first reads every destination cache line into
 * its cache (read-for-ownership) and later writes it back: two trips over the
 * memory bus per line, and the copy evicts useful data from the cache. Streaming
 * (non-temporal) stores fill write-combining buffers and send whole lines to memory
 * without reading them first. glibc does the same for very large memcpy calls, but
 * its threshold is a tunable that a library inside someone else's process cannot
 * set, hence this helper.
 *
 * Only SSE2 is used (part of x86-64 itself), so there is no runtime CPU dispatch.
 * Other architectures get plain memcpy. Small copies use memcpy too: below
 * KV_STREAM_MIN the destination is likely in cache and wanted there, and the fixed
 * cost of the sfence is not repaid.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KV_HAVE_STREAM 1
#else
#define KV_HAVE_STREAM 0
#endif

/* Copies shorter than this use memcpy, with the GIL held (a few microseconds at most). */
#ifndef KV_STREAM_MIN
#define KV_STREAM_MIN ((size_t)64 * 1024)
#endif

#if KV_HAVE_STREAM
/* n >= KV_STREAM_MIN, dst and src do not overlap. */
static void
stream_copy(char *dst, const char *src, size_t n)
{
    /* Unaligned head: plain stores up to the next 16-byte boundary of dst. */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;

    /* Body: 128 bytes per iteration, unaligned loads, aligned streaming stores. */
    while (n >= 128) {
        __m128i a0 = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i a1 = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i a2 = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i a3 = _mm_loadu_si128((const __m128i *)(src + 48));
        __m128i a4 = _mm_loadu_si128((const __m128i *)(src + 64));
        __m128i a5 = _mm_loadu_si128((const __m128i *)(src + 80));
        __m128i a6 = _mm_loadu_si128((const __m128i *)(src + 96));
        __m128i a7 = _mm_loadu_si128((const __m128i *)(src + 112));
        _mm_stream_si128((__m128i *)(dst + 0), a0);
        _mm_stream_si128((__m128i *)(dst + 16), a1);
        _mm_stream_si128((__m128i *)(dst + 32), a2);
        _mm_stream_si128((__m128i *)(dst + 48), a3);
        _mm_stream_si128((__m128i *)(dst + 64), a4);
        _mm_stream_si128((__m128i *)(dst + 80), a5);
        _mm_stream_si128((__m128i *)(dst + 96), a6);
        _mm_stream_si128((__m128i *)(dst + 112), a7);
        src += 128;
        dst += 128;
        n -= 128;
    }
    while (n >= 16) {
        _mm_stream_si128((__m128i *)dst, _mm_loadu_si128((const __m128i *)src));
        src += 16;
        dst += 16;
        n -= 16;
    }
    /* Tail shorter than 16 bytes: plain stores. */
    memcpy(dst, src, n);
    /* Streaming stores are weakly ordered: make them visible before we return, so a
       later store (e.g. publishing the slot) cannot overtake them. */
    _mm_sfence();
}
#endif

static void
copy_bytes(char *dst, const char *src, size_t n)
{
    if (dst < src + n && src < dst + n) {
        memmove(dst, src, n); /* overlapping views of one buffer */
        return;
    }
#if KV_HAVE_STREAM
    if (n >= KV_STREAM_MIN) {
        stream_copy(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Get a C-contiguous buffer from obj; "what" names the argument in error messages. */
static int
get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    /* Ask for strides without PyBUF_WRITABLE and check the flags ourselves, so that
       every exporter fails with the same precise message. */
    if (PyObject_GetBuffer(obj, view, PyBUF_STRIDES) < 0)
        return -1;
    if (writable && view->readonly) {
        PyErr_Format(PyExc_ValueError, "copy(): %s is read-only (%.100s)", what,
                     Py_TYPE(obj)->tp_name);
        PyBuffer_Release(view);
        return -1;
    }
    if (!PyBuffer_IsContiguous(view, 'C')) {
        PyErr_Format(PyExc_ValueError, "copy(): %s is not C-contiguous (%.100s, ndim %d)",
                     what, Py_TYPE(obj)->tp_name, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
streamcopy_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer dst, src;
    (void)module;

    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "copy() takes exactly 2 arguments (dst, src), got %zd",
                     nargs);
        return NULL;
    }
    if (get_buffer(args[0], &dst, 1, "dst") < 0)
        return NULL;
    if (get_buffer(args[1], &src, 0, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "copy(): dst has %zd bytes, src has %zd", dst.len,
                     src.len);
        PyBuffer_Release(&src);
        PyBuffer_Release(&dst);
        return NULL;
    }

    size_t n = (size_t)dst.len;
    if (n >= KV_STREAM_MIN) {
        /* Both buffers stay exported (pinned) while the GIL is released. */
        Py_BEGIN_ALLOW_THREADS
        copy_bytes((char *)dst.buf, (const char *)src.buf, n);
        Py_END_ALLOW_THREADS
    }
    else {
        copy_bytes((char *)dst.buf, (const char *)src.buf, n);
    }

    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    Py_RETURN_NONE;
}

static PyMethodDef streamcopy_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))streamcopy_copy, METH_FASTCALL,
     "copy(dst, src) -> None\n\n"
     "Copy the bytes of src into dst (both C-contiguous buffers of equal byte length,\n"
     "dst writable). Copies of STREAM_MIN bytes or more use non-temporal stores on\n"
     "x86-64 and release the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef streamcopy_module = {
    PyModuleDef_HEAD_INIT,
    "kvstore._streamcopy",
    "Buffer copy with non-temporal (streaming) stores; see kvstore.stream_copy.",
    0,
    streamcopy_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__streamcopy(void)
{
    PyObject *m = PyModule_Create(&streamcopy_module);
    if (m == NULL)
        return NULL;
    /* STREAMING: whether copies of STREAM_MIN bytes or more really stream (x86-64). */
    if (PyModule_AddIntConstant(m, "STREAMING", KV_HAVE_STREAM) < 0 ||
        PyModule_AddIntConstant(m, "STREAM_MIN", (long)KV_STREAM_MIN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
