/*
 * kvstore._kvcodec: decode a KV block that a codec encoded (see kvstore/codecs.py).
 *
 * Why in C: a read from a coded tier decodes every block it serves, on the path of a
 * request. numpy needs three passes (codes to float32, times the scales, to the
 * output dtype) and converts float32 to float16 slowly; this is one pass, with the
 * GIL released. It computes exactly what the numpy path computes (the code's value
 * in float32, times the group's scale in float32, rounded to nearest-even into the
 * output dtype), so the two agree bit for bit and the numpy path stays the reference.
 *
 * Block layout: groups x bfloat16 scales (little-endian), then the codes: one byte per
 * element (fp8 e4m3fn, int8) or two elements per byte (int4: even element in the low
 * nibble). float16 output uses the F16C instructions when the CPU has them.
 */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3") /* the per-element loops vectorize */
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define KV_HAVE_F16C 1
#else
#define KV_HAVE_F16C 0
#endif

enum { KIND_FP8 = 1, KIND_INT8 = 2, KIND_INT4 = 3 };
enum { OUT_BF16 = 0, OUT_F16 = 1, OUT_F32 = 2 };
#define MAX_GROUP 4096

/* An e4m3fn byte's value, in branch-free integer steps (the loop vectorizes): a normal one
 * moves its exponent (bias 7 -> 127) and mantissa into float32's fields, a subnormal
 * one is m * 2^-9, 0x7f and 0xff are NaN: what ml_dtypes' float8_e4m3fn says. */
static inline float
fp8_value(uint8_t b)
{
    uint32_t e = (b >> 3) & 15, m = b & 7, sign = (uint32_t)(b & 0x80) << 24;
    uint32_t normal = sign | ((e + 120) << 23) | (m << 20);
    float sub_value = (float)m * (1.0f / 512.0f);
    uint32_t sub;
    memcpy(&sub, &sub_value, 4);
    sub |= sign;
    uint32_t is_normal = 0u - (uint32_t)(e != 0);        /* all ones, or none */
    uint32_t is_nan = 0u - (uint32_t)((b & 0x7f) == 0x7f);
    uint32_t bits = (normal & is_normal) | (sub & ~is_normal);
    bits = (bits & ~is_nan) | (0x7fc00000u & is_nan);
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

static inline float
bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t
f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40; /* a NaN stays a NaN */
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet : rounded);
}

static uint16_t
f32_to_f16_soft(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t abs = x & 0x7fffffffu;
    if (abs > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u);
    if (abs >= 0x477ff000u) /* rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (abs < 0x38800000u) { /* a float16 subnormal (or zero) */
        if (abs < 0x33000000u)
            return (uint16_t)sign;
        uint32_t man = (abs & 0x7fffffu) | 0x800000u;
        int shift = 126 - (int)(abs >> 23); /* value = man * 2^(e - 150) */
        uint32_t half = 1u << (shift - 1);
        uint32_t rest = man & ((1u << shift) - 1);
        uint32_t out = man >> shift;
        if (rest > half || (rest == half && (out & 1)))
            out++;
        return (uint16_t)(sign | out);
    }
    uint32_t out = ((abs >> 13) - (112u << 10));
    uint32_t rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (out & 1)))
        out++;
    return (uint16_t)(sign | out);
}

#if KV_HAVE_F16C
__attribute__((target("avx,f16c"))) static void
f32_to_f16_hw(const float *src, uint16_t *dst, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(dst + i), h);
    }
    for (; i < n; i++)
        dst[i] = f32_to_f16_soft(src[i]);
}
static int have_f16c;
#endif

static void
store(const float *values, char *out, Py_ssize_t n, int out_kind)
{
    if (out_kind == OUT_F32) {
        memcpy(out, values, (size_t)n * 4);
    } else if (out_kind == OUT_BF16) {
        uint16_t *dst = (uint16_t *)out;
        for (Py_ssize_t i = 0; i < n; i++)
            dst[i] = f32_to_bf16(values[i]);
    } else {
#if KV_HAVE_F16C
        if (have_f16c) {
            f32_to_f16_hw(values, (uint16_t *)out, n);
            return;
        }
#endif
        uint16_t *dst = (uint16_t *)out;
        for (Py_ssize_t i = 0; i < n; i++)
            dst[i] = f32_to_f16_soft(values[i]);
    }
}

static void
decode_block(int kind, int out_kind, Py_ssize_t head_dim, Py_ssize_t groups,
             const uint8_t *src, char *out, Py_ssize_t out_item)
{
    const uint8_t *scales = src;
    const uint8_t *codes = src + 2 * groups;
    float values[MAX_GROUP];
    for (Py_ssize_t g = 0; g < groups; g++) {
        uint16_t raw = (uint16_t)(scales[2 * g] | (scales[2 * g + 1] << 8));
        float s = bf16_to_f32(raw);
        if (kind == KIND_FP8) {
            const uint8_t *c = codes + g * head_dim;
            for (Py_ssize_t j = 0; j < head_dim; j++)
                values[j] = fp8_value(c[j]) * s;
        } else if (kind == KIND_INT8) {
            const int8_t *c = (const int8_t *)codes + g * head_dim;
            for (Py_ssize_t j = 0; j < head_dim; j++)
                values[j] = (float)c[j] * s;
        } else {
            const uint8_t *c = codes + g * head_dim / 2;
            for (Py_ssize_t j = 0; j < head_dim / 2; j++) {
                int8_t lo = (int8_t)(uint8_t)(c[j] << 4), hi = (int8_t)c[j];
                values[2 * j] = (float)(lo >> 4) * s;
                values[2 * j + 1] = (float)(hi >> 4) * s;
            }
        }
        store(values, out + g * head_dim * out_item, head_dim, out_kind);
    }
}

static PyObject *
kvcodec_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "decode(kind, out_kind, head_dim, src, out)");
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]);
    long out_kind = PyLong_AsLong(args[1]);
    Py_ssize_t head_dim = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (kind < KIND_FP8 || kind > KIND_INT4 || out_kind < OUT_BF16 || out_kind > OUT_F32 ||
        head_dim <= 0 || head_dim > MAX_GROUP || head_dim % 2) {
        PyErr_SetString(PyExc_ValueError, "bad codec, output dtype or head_dim");
        return NULL;
    }
    Py_buffer src, out;
    if (PyObject_GetBuffer(args[3], &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[4], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t out_item = out_kind == OUT_F32 ? 4 : 2;
    Py_ssize_t elements = out.len / out_item;
    Py_ssize_t groups = elements / head_dim;
    Py_ssize_t code_bytes = kind == KIND_INT4 ? elements / 2 : elements;
    if (out.len % (out_item * head_dim) || src.len != 2 * groups + code_bytes) {
        PyBuffer_Release(&src);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "the buffers' sizes do not match the codec");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode_block((int)kind, (int)out_kind, head_dim, groups, (const uint8_t *)src.buf,
                 (char *)out.buf, out_item);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef kvcodec_methods[] = {
    {"decode", (PyCFunction)(void (*)(void))kvcodec_decode, METH_FASTCALL,
     "decode(kind, out_kind, head_dim, src, out) -> None\n\n"
     "Decode one encoded block (kind 1 fp8, 2 int8, 3 int4) into out (out_kind 0\n"
     "bfloat16, 1 float16, 2 float32), releasing the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef kvcodec_module = {
    PyModuleDef_HEAD_INIT,
    "kvstore._kvcodec",
    "Decoding of KV codec blocks; see kvstore.codecs.",
    -1,
    kvcodec_methods,
};

PyMODINIT_FUNC
PyInit__kvcodec(void)
{
#if KV_HAVE_F16C
    __builtin_cpu_init();
    have_f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
#endif
    return PyModule_Create(&kvcodec_module);
}
