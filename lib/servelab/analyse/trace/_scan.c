/* A single-pass scanner for one slice of Chrome-trace events (``[ {event}, {event}, ... ]``): the fields every
 * event carries (ph, cat, name, pid, tid, ts, dur, args."External id", args.correlation, args.bytes,
 * args."graph id") go straight into column buffers, without a Python object per event.
 *
 * It is a fast path, not a second decoder: whatever it does not handle the way the msgspec decoder in load.py
 * would, it hands back.
 *   - the whole slice → None when the text is not strict JSON, or a typed field has another type (the caller
 *     then decodes the slice with msgspec, which also produces the error or sends the file to the lenient path);
 *   - one event → a "special" row (its byte span is returned) when fields beyond the columns are needed:
 *     metadata events (ph "M"), string pid / tid (the pid label), gloo collectives (name "gloo:..."), collectives ("Collective name" a string, and
 *     their args). The caller decodes those few events with msgspec for what the columns do not hold.
 * Strings are unescaped (a lone surrogate hands the slice back); valid UTF-8 is copied as is.
 *
 * Missing values use the caller's conventions: INT64_MIN for integers, -inf for ts / dur, "" for strings.
 * args.bytes and args."graph id" are untyped in the trace: a value that is not an integer is missing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MISSING_INT INT64_MIN
#define MAX_DEPTH 512

typedef struct {
    char *p;
    size_t n, cap;
} buf_t;

static int buf_reserve(buf_t *b, size_t extra)
{
    if (b->n + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 1 << 16;
    while (cap < b->n + extra)
        cap *= 2;
    char *q = realloc(b->p, cap);
    if (!q)
        return -1;
    b->p = q;
    b->cap = cap;
    return 0;
}

static int buf_put(buf_t *b, const void *src, size_t len)
{
    if (buf_reserve(b, len) < 0)
        return -1;
    memcpy(b->p + b->n, src, len);
    b->n += len;
    return 0;
}

typedef const unsigned char *cur_t;

static inline cur_t ws(cur_t p, cur_t end)
{
    while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

/* one UTF-8 sequence starting at p (first byte >= 0x80); returns its end or NULL when invalid */
static cur_t utf8_seq(cur_t p, cur_t end)
{
    unsigned c = p[0];
    int n;
    unsigned min;
    if (c >= 0xC2 && c <= 0xDF) { n = 1; min = 0x80; }
    else if (c >= 0xE0 && c <= 0xEF) { n = 2; min = 0x800; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 3; min = 0x10000; }
    else return NULL;
    if (end - p <= n)
        return NULL;
    unsigned cp = c & (0x3F >> n);
    for (int i = 1; i <= n; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return NULL;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return NULL;
    return p + n + 1;
}

static inline int hexdig(unsigned c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* p at '"': returns the position after the closing quote (NULL when invalid: a control byte, a bad escape,
 * invalid UTF-8); *plain = the text holds no escape */
static inline __attribute__((always_inline)) cur_t string(cur_t p, cur_t end, cur_t *s0, size_t *len, int *plain)
{
    cur_t q = p + 1;
    int ok = 1;
    while (q < end) {
#ifdef __SSE2__
        /* 16 bytes at a time up to the next byte that needs a look: '"', '\\', a control or a non-ASCII byte */
        while (end - q >= 16) {
            __m128i x = _mm_loadu_si128((const __m128i *)q);
            __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, _mm_set1_epi8('"')),
                                                  _mm_cmpeq_epi8(x, _mm_set1_epi8('\\'))),
                                     _mm_cmplt_epi8(x, _mm_set1_epi8(0x20)));
            unsigned bits = (unsigned)_mm_movemask_epi8(m);
            if (bits) {
                q += __builtin_ctz(bits);
                break;
            }
            q += 16;
        }
        if (q >= end)
            break;
#endif
        unsigned c = *q;
        if (c == '"') {
            *s0 = p + 1;
            *len = (size_t)(q - p - 1);
            *plain = ok;
            return q + 1;
        }
        if (c < 0x20)
            return NULL;
        if (c == '\\') {
            ok = 0;
            if (q + 1 >= end)
                return NULL;
            unsigned e = q[1];
            if (e == 'u') {
                if (end - q < 6 || !hexdig(q[2]) || !hexdig(q[3]) || !hexdig(q[4]) || !hexdig(q[5]))
                    return NULL;
                q += 6;
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                q += 2;
            } else {
                return NULL;
            }
            continue;
        }
        if (c >= 0x80) {
            q = utf8_seq(q, end);
            if (!q)
                return NULL;
            continue;
        }
        q++;
    }
    return NULL;
}

/* strict JSON number; *is_int when it has neither fraction nor exponent */
static inline __attribute__((always_inline)) cur_t number(cur_t p, cur_t end, int *is_int)
{
    cur_t q = p;
    *is_int = 1;
    if (q < end && *q == '-')
        q++;
    if (q >= end)
        return NULL;
    if (*q == '0') {
        q++;
    } else if (*q >= '1' && *q <= '9') {
        while (q < end && *q >= '0' && *q <= '9')
            q++;
    } else {
        return NULL;
    }
    if (q < end && *q == '.') {
        *is_int = 0;
        q++;
        if (q >= end || *q < '0' || *q > '9')
            return NULL;
        while (q < end && *q >= '0' && *q <= '9')
            q++;
    }
    if (q < end && (*q == 'e' || *q == 'E')) {
        *is_int = 0;
        q++;
        if (q < end && (*q == '+' || *q == '-'))
            q++;
        if (q >= end || *q < '0' || *q > '9')
            return NULL;
        while (q < end && *q >= '0' && *q <= '9')
            q++;
    }
    return q;
}

/* an integer's text → int64; 0 when it does not fit */
static int to_int64(cur_t p, cur_t q, int64_t *out)
{
    int neg = *p == '-';
    if (neg)
        p++;
    uint64_t v = 0;
    for (; p < q; p++) {
        unsigned d = *p - '0';
        if (v > (UINT64_MAX - d) / 10)
            return 0;
        v = v * 10 + d;
    }
    if (neg) {
        if (v > (uint64_t)INT64_MAX + 1)
            return 0;
        *out = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
    } else {
        if (v > (uint64_t)INT64_MAX)
            return 0;
        *out = (int64_t)v;
    }
    return 1;
}

static const double POW10[] = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11,
                               1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* a number's text → double, correctly rounded: exact mantissa ≤ 2^53 and a power of ten ≤ 1e22 take one
 * IEEE operation (exact operands, so the result is the correctly rounded one); anything else goes to
 * CPython's correctly rounded parser. 0 when the value is not finite. */
static int to_double(cur_t p, cur_t q, double *out)
{
    cur_t r = p;
    int neg = *r == '-';
    if (neg)
        r++;
    uint64_t m = 0;
    int digits = 0, frac = 0, simple = 1;
    for (; r < q && *r >= '0' && *r <= '9'; r++) {
        if (digits || *r != '0')
            digits++;
        if (digits > 19) { simple = 0; break; }
        m = m * 10 + (unsigned)(*r - '0');
    }
    if (simple && r < q && *r == '.') {
        for (r++; r < q && *r >= '0' && *r <= '9'; r++) {
            if (digits || *r != '0')
                digits++;
            if (digits > 19) { simple = 0; break; }
            m = m * 10 + (unsigned)(*r - '0');
            frac++;
        }
    }
    if (simple && r == q && m <= (1ULL << 53) && frac <= 22) {
        double v = frac ? (double)m / POW10[frac] : (double)m;
        *out = neg ? -v : v;
        return 1;
    }
    char tmp[64];
    size_t n = (size_t)(q - p);
    char *s = n < sizeof(tmp) ? tmp : PyMem_Malloc(n + 1);
    if (!s)
        return 0;
    memcpy(s, p, n);
    s[n] = 0;
    double v = PyOS_string_to_double(s, NULL, NULL);
    if (s != tmp)
        PyMem_Free(s);
    if (v == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (!isfinite(v))
        return 0;
    *out = v;
    return 1;
}

/* after a member or an element: whitespace, then ',' (go on: the cursor past it and the whitespace after it,
 * *done = 0) or the closer (*done = 1, the cursor past it); anything else is not JSON (NULL) */
static cur_t next_member(cur_t p, cur_t end, char closer, int *done)
{
    p = ws(p, end);
    if (p < end && *p == ',') {
        *done = 0;
        return ws(p + 1, end);
    }
    if (p < end && *p == closer) {
        *done = 1;
        return p + 1;
    }
    return NULL;
}

static cur_t skip_value(cur_t p, cur_t end, int depth);

static cur_t skip_object(cur_t p, cur_t end, int depth)
{
    cur_t s0;
    size_t len;
    int plain, done;
    p = ws(p + 1, end);
    if (p < end && *p == '}')
        return p + 1;
    for (;;) {
        if (p >= end || *p != '"' || !(p = string(p, end, &s0, &len, &plain)))
            return NULL;
        p = ws(p, end);
        if (p >= end || *p != ':')
            return NULL;
        p = skip_value(ws(p + 1, end), end, depth + 1);
        if (!p || !(p = next_member(p, end, '}', &done)))
            return NULL;
        if (done)
            return p;
    }
}

static cur_t skip_array(cur_t p, cur_t end, int depth)
{
    int done;
    p = ws(p + 1, end);
    if (p < end && *p == ']')
        return p + 1;
    for (;;) {
        p = skip_value(p, end, depth + 1);
        if (!p || !(p = next_member(p, end, ']', &done)))
            return NULL;
        if (done)
            return p;
    }
}

static cur_t skip_value(cur_t p, cur_t end, int depth)
{
    cur_t s0;
    size_t len;
    int plain, is_int;
    if (p >= end || depth > MAX_DEPTH)
        return NULL;
    switch (*p) {
    case '"':
        return string(p, end, &s0, &len, &plain);
    case '{':
        return skip_object(p, end, depth);
    case '[':
        return skip_array(p, end, depth);
    case 't':
        return end - p >= 4 && !memcmp(p, "true", 4) ? p + 4 : NULL;
    case 'f':
        return end - p >= 5 && !memcmp(p, "false", 5) ? p + 5 : NULL;
    case 'n':
        return end - p >= 4 && !memcmp(p, "null", 4) ? p + 4 : NULL;
    default:
        return number(p, end, &is_int);
    }
}

#define KEY(lit) (len == sizeof(lit) - 1 && !memcmp(s0, lit, sizeof(lit) - 1))

typedef struct {
    cur_t s0;
    size_t len;
    int plain;
} str_t;

typedef struct {
    str_t ph, cat, name;
    int64_t pid, tid, ext, corr, nbytes, graph;
    double ts, dur;
    int special;
} event_t;

/* a typed int field: int64 → value; anything else fails the slice (msgspec would reject it) */
static cur_t typed_int(cur_t p, cur_t end, int64_t *out)
{
    int is_int;
    cur_t q = number(p, end, &is_int);
    if (!q || !is_int || !to_int64(p, q, out))
        return NULL;
    return q;
}

/* an untyped int field (bytes, graph id): an int64 → value, any other value → missing; a big int fails */
static cur_t loose_int(cur_t p, cur_t end, int64_t *out)
{
    if (p < end && (*p == '-' || (*p >= '0' && *p <= '9'))) {
        int is_int;
        cur_t q = number(p, end, &is_int);
        if (!q)
            return NULL;
        if (is_int) {
            if (!to_int64(p, q, out))
                return NULL;
        } else {
            *out = MISSING_INT;
        }
        return q;
    }
    *out = MISSING_INT;
    return skip_value(p, end, 1);
}

/* int or string (pid, tid): a string makes the event special */
static cur_t int_or_str(cur_t p, cur_t end, int64_t *out, int *special)
{
    if (p < end && *p == '"') {
        str_t s;
        *out = MISSING_INT;
        *special = 1;
        return string(p, end, &s.s0, &s.len, &s.plain);
    }
    return typed_int(p, end, out);
}

static cur_t str_field(cur_t p, cur_t end, str_t *s)
{
    if (p >= end || *p != '"')
        return NULL;
    return string(p, end, &s->s0, &s->len, &s->plain);
}

static cur_t float_field(cur_t p, cur_t end, double *out)
{
    int is_int;
    cur_t q = number(p, end, &is_int);
    if (!q || !to_double(p, q, out))
        return NULL;
    return q;
}

static cur_t args_object(cur_t p, cur_t end, event_t *e)
{
    cur_t s0;
    size_t len;
    int plain, done;
    if (p >= end || *p != '{')
        return NULL;
    p = ws(p + 1, end);
    if (p < end && *p == '}')
        return p + 1;
    for (;;) {
        if (p >= end || *p != '"' || !(p = string(p, end, &s0, &len, &plain)) || !plain)
            return NULL;            /* a key with escapes: msgspec decides what it means */
        p = ws(p, end);
        if (p >= end || *p != ':')
            return NULL;
        p = ws(p + 1, end);
        if (KEY("External id"))
            p = typed_int(p, end, &e->ext);
        else if (KEY("correlation"))
            p = typed_int(p, end, &e->corr);
        else if (KEY("bytes"))
            p = loose_int(p, end, &e->nbytes);
        else if (KEY("graph id"))
            p = loose_int(p, end, &e->graph);
        else if (KEY("Collective name")) {
            if (p < end && *p == '"')
                e->special = 1;
            else if (!(end - p >= 4 && !memcmp(p, "null", 4)))
                return NULL;
            p = skip_value(p, end, 2);
        } else
            p = skip_value(p, end, 2);
        if (!p || !(p = next_member(p, end, '}', &done)))
            return NULL;
        if (done)
            return p;
    }
}

static cur_t event(cur_t p, cur_t end, event_t *e)
{
    cur_t s0;
    size_t len;
    int plain, done;
    static const unsigned char empty[1] = {0};
    e->ph.s0 = e->cat.s0 = e->name.s0 = empty;
    e->ph.len = e->cat.len = e->name.len = 0;
    e->pid = e->tid = e->ext = e->corr = e->nbytes = e->graph = MISSING_INT;
    e->ts = e->dur = -INFINITY;
    e->special = 0;
    if (p >= end || *p != '{')
        return NULL;
    p = ws(p + 1, end);
    if (p < end && *p == '}')
        return p + 1;
    for (;;) {
        if (p >= end || *p != '"' || !(p = string(p, end, &s0, &len, &plain)) || !plain)
            return NULL;
        p = ws(p, end);
        if (p >= end || *p != ':')
            return NULL;
        p = ws(p + 1, end);
        if (KEY("ph"))
            p = str_field(p, end, &e->ph);
        else if (KEY("cat"))
            p = str_field(p, end, &e->cat);
        else if (KEY("name"))
            p = str_field(p, end, &e->name);
        else if (KEY("pid"))
            p = int_or_str(p, end, &e->pid, &e->special);
        else if (KEY("tid"))
            p = int_or_str(p, end, &e->tid, &e->special);
        else if (KEY("ts"))
            p = float_field(p, end, &e->ts);
        else if (KEY("dur"))
            p = float_field(p, end, &e->dur);
        else if (KEY("args"))
            p = args_object(p, end, e);
        else
            p = skip_value(p, end, 1);
        if (!p || !(p = next_member(p, end, '}', &done)))
            return NULL;
        if (done)
            return p;
    }
}

/* the output columns: three strings (int32 offsets + text), eight int64 columns (ts / dur as integer ns), the
 * special rows, and the eight int64 columns' validity bitmaps (Arrow's layout: bit i of byte i / 8) */
enum { C_PH_OFF, C_PH, C_CAT_OFF, C_CAT, C_NAME_OFF, C_NAME, C_PID, C_TID, C_TS, C_DUR, C_EXT, C_CORR,
       C_BYTES, C_GRAPH, C_SPECIAL, C_VALID, NCOL = C_VALID + 8 };

#define MAX_US 9.2e15           /* µs: beyond this, ns overflow int64 (the value is absent) */

/* µs → int64 ns exactly as load.py's numpy version: floor, then the fraction's ns rounded half to even */
static inline int64_t us_to_ns(double v)
{
    double w = floor(v);
    return (int64_t)w * 1000 + (int64_t)rint((v - w) * 1000.0);
}

static unsigned hex4(cur_t s)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = s[i];
        v = v * 16 + (c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10);
    }
    return v;
}

/* the text of a validated string with escapes, decoded to UTF-8 (never longer than the escaped text);
 * 1 when it holds a lone surrogate (msgspec decides about those), -1 out of memory */
static int put_unescaped(buf_t *d, cur_t s, size_t len)
{
    cur_t e = s + len;
    if (buf_reserve(d, len) < 0)
        return -1;
    unsigned char *o = (unsigned char *)d->p + d->n;
    while (s < e) {
        if (*s != '\\') {
            *o++ = *s++;
            continue;
        }
        unsigned c = s[1];
        s += 2;
        switch (c) {
        case 'b': *o++ = '\b'; break;
        case 'f': *o++ = '\f'; break;
        case 'n': *o++ = '\n'; break;
        case 'r': *o++ = '\r'; break;
        case 't': *o++ = '\t'; break;
        case 'u': {
            unsigned cp = hex4(s);
            s += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                unsigned lo;
                if (e - s < 6 || s[0] != '\\' || s[1] != 'u' || (lo = hex4(s + 2)) < 0xDC00 || lo > 0xDFFF)
                    return 1;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                s += 6;
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return 1;
            }
            if (cp < 0x80) {
                *o++ = (unsigned char)cp;
            } else if (cp < 0x800) {
                *o++ = (unsigned char)(0xC0 | (cp >> 6));
                *o++ = (unsigned char)(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                *o++ = (unsigned char)(0xE0 | (cp >> 12));
                *o++ = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                *o++ = (unsigned char)(0x80 | (cp & 0x3F));
            } else {
                *o++ = (unsigned char)(0xF0 | (cp >> 18));
                *o++ = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
                *o++ = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
                *o++ = (unsigned char)(0x80 | (cp & 0x3F));
            }
            break;
        }
        default: *o++ = (unsigned char)c; break;      /* '"', '\\', '/' */
        }
    }
    d->n = (size_t)((char *)o - d->p);
    return 0;
}

/* the column buffers, reused by every call (the caller holds the GIL for the whole scan: one call at a time) */
static buf_t cols[NCOL];
#define KEEP_BYTES (4u << 20)

static int put_str(buf_t *off, buf_t *data, const str_t *s)
{
    if (s->plain) {
        if (buf_put(data, s->s0, s->len) < 0)
            return -1;
    } else {
        int r = put_unescaped(data, s->s0, s->len);
        if (r)
            return r;
    }
    int32_t o = (int32_t)data->n;
    return buf_put(off, &o, 4);
}

PyDoc_STRVAR(scan_doc,
"scan(data: bytes) -> tuple | None\n\n"
"One ``[ {event}, ... ]`` slice → (n, ph offsets, ph bytes, cat offsets, cat bytes, name offsets, name bytes,\n"
"pid, tid, ts ns, dur ns, external id, correlation, bytes, graph id, special rows, then the validity bitmaps\n"
"of the eight int64 columns): int32 offsets, int64 columns as bytes, (row, start, end) int64 triples of the\n"
"events to decode with msgspec. None when the slice needs the msgspec decoder.");

static PyObject *scan(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    buf_t *col = cols;
    int done;
    for (int i = 0; i < NCOL; i++)
        col[i].n = 0;
    if (view.len > INT32_MAX - 1)
        goto fallback;
    /* room per column up front (an event takes more than 8 bytes of text): no regrowth copies while scanning;
     * the buffers are kept from one call to the next (no fresh pages to fault in for every slice) */
    for (int i = 0; i < NCOL; i++)
        if (buf_reserve(&col[i], (size_t)view.len / 8 + 64) < 0)
            goto nomem;
    cur_t base = (cur_t)view.buf, end = base + view.len;
    cur_t p = ws(base, end);
    int64_t n = 0;
    int32_t zero = 0;
    if (buf_put(&col[C_PH_OFF], &zero, 4) < 0 || buf_put(&col[C_CAT_OFF], &zero, 4) < 0
        || buf_put(&col[C_NAME_OFF], &zero, 4) < 0)
        goto nomem;
    if (p >= end || *p != '[')
        goto fallback;
    p = ws(p + 1, end);
    if (p < end && *p == ']') {
        p++;
    } else {
        for (;;) {
            event_t e;
            cur_t start = p;
            p = event(p, end, &e);
            if (!p)
                goto fallback;
            if (e.ph.len == 1 && e.ph.s0[0] == 'M')
                e.special = 1;
            int r = put_str(&col[C_PH_OFF], &col[C_PH], &e.ph);
            if (!r)
                r = put_str(&col[C_CAT_OFF], &col[C_CAT], &e.cat);
            if (!r)
                r = put_str(&col[C_NAME_OFF], &col[C_NAME], &e.name);
            if (r > 0)
                goto fallback;
            if (r < 0)
                goto nomem;
            {   /* a gloo collective ("gloo:all_reduce"): its Input Dims / Input type are read by the decoder */
                size_t name0 = ((int32_t *)col[C_NAME_OFF].p)[n], nlen = col[C_NAME].n - name0;
                if (nlen > 5 && !memcmp(col[C_NAME].p + name0, "gloo:", 5))
                    e.special = 1;
            }
            /* bytes only on memcpy / memset rows, graph id only on kernels (the decoded category) */
            size_t cat0 = ((int32_t *)col[C_CAT_OFF].p)[n], clen = col[C_CAT].n - cat0;
            const char *cs = col[C_CAT].p + cat0;
            if (!(clen == 6 && !memcmp(cs, "kernel", 6)))
                e.graph = MISSING_INT;
            if (!((clen == 10 && (!memcmp(cs, "gpu_memcpy", 10) || !memcmp(cs, "gpu_memset", 10)))))
                e.nbytes = MISSING_INT;
            int ts_ok = fabs(e.ts) < MAX_US, dur_ok = fabs(e.dur) < MAX_US;
            int64_t v[8] = {e.pid, e.tid, ts_ok ? us_to_ns(e.ts) : 0, dur_ok ? us_to_ns(e.dur) : 0,
                            e.ext, e.corr, e.nbytes, e.graph};
            int ok[8] = {e.pid != MISSING_INT, e.tid != MISSING_INT, ts_ok, dur_ok, e.ext != MISSING_INT,
                         e.corr != MISSING_INT, e.nbytes != MISSING_INT, e.graph != MISSING_INT};
            for (int i = 0; i < 8; i++) {
                if (buf_put(&col[C_PID + i], &v[i], 8) < 0 || ((n & 7) == 0 && buf_put(&col[C_VALID + i], &zero, 1) < 0))
                    goto nomem;
                if (ok[i])
                    col[C_VALID + i].p[n >> 3] |= (char)(1 << (n & 7));
            }
            if (e.special) {
                int64_t t[3] = {n, (int64_t)(start - base), (int64_t)(p - base)};
                if (buf_put(&col[C_SPECIAL], t, sizeof(t)) < 0)
                    goto nomem;
            }
            n++;
            if (!(p = next_member(p, end, ']', &done)))
                goto fallback;
            if (done)
                break;
        }
    }
    if (ws(p, end) != end)
        goto fallback;
    result = PyTuple_New(NCOL + 1);
    if (!result)
        goto nomem;
    PyTuple_SET_ITEM(result, 0, PyLong_FromLongLong(n));
    for (int i = 0; i < NCOL; i++) {
        PyObject *b = PyBytes_FromStringAndSize(col[i].p ? col[i].p : "", (Py_ssize_t)col[i].n);
        if (!b) {
            Py_CLEAR(result);
            goto done;
        }
        PyTuple_SET_ITEM(result, i + 1, b);
    }
    if (PyErr_Occurred())
        Py_CLEAR(result);
    goto done;
nomem:
    PyErr_NoMemory();
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < NCOL; i++)
        if (col[i].cap > KEEP_BYTES) {       /* an unusually big input: give that memory back */
            free(col[i].p);
            col[i].p = NULL;
            col[i].n = col[i].cap = 0;
        }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_O, scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_scan",
    .m_doc = "Column scanner for slices of Chrome-trace events (see load.py).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__scan(void)
{
    return PyModule_Create(&module);
}
