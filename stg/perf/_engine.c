/* stg.perf._engine: the compiled parts of the replay engine (stg/perf/replay.py) and of the
 * periodic check (stg/perf/periodic.py).
 *
 * run_loop: _Sim.run keeps its state in plain per-unit Python lists and drives the replay with
 * one event loop. This runs that same loop in C over the same objects: it pops the events of
 * each instant, ends their nodes, counts down their children's pending dependencies, readies
 * them, and starts the next node of every stream touched at that instant. The common cases (a
 * compute node ends, starts, or is slowed by the NCCL kernels of transfers in flight; a
 * collective within a unit whose ports are its stream's alone starts and ends; a node joins
 * its stream's queue) are done here; every other case calls back the very closures of
 * _Sim.run (make_ready for a receive, dispatch, a stream node's end, a transfer step's end,
 * the state copy), in the order the Python loop calls them. Events are heap entries
 * (instant, tick, unit, node) whose ticks are unique, the heaps are heapq's (the same layout
 * and moves), so the events and their order are those of the Python loop, and so is every
 * result, bit for bit.
 *
 * earlier_dependencies, cost_key, compute_costs (of _Sim._prepare), flops and bases (of the
 * periodic check) are passes over a unit's nodes; each returns what its Python counterpart
 * returns, or NotImplemented where a node is unusual (then the Python code decides).
 *
 * The Python code is the reference: tests/test_engine_compiled.py compares the two, and
 * STG_ENGINE=python turns this module off.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define ABI_VERSION 2

enum { COMPUTE = 0, COLL = 1, SEND = 2, RECV = 3, INSTANT = 4, COPY = 5 };

static PyObject *one;

typedef struct {
    PyObject *heap, *kinds, *ends_at, *busy, *touched, *compute_stream, *children, *pending,
        *ready_times, *ready_causes, *queue_key, *ready, *starts, *last_on_stream, *causes,
        *transfer_starts, *durations, *contending, *at_key, *tick, *make_ready, *dispatch,
        *ended, *flow_event, *capture, *states_at, *streams, *coll_keys, *coll_seq,
        *coll_needed, *private_, *all_steps, *comm_link, *contended, *contenders, *contender,
        *contended_cost;
    Py_ssize_t units;
} Loop;

/* lists[u][i], borrowed */
static inline PyObject *at2(PyObject *lists, Py_ssize_t u, Py_ssize_t i)
{
    return PyList_GET_ITEM(PyList_GET_ITEM(lists, u), i);
}

/* lists[u][i] = value (a new reference to value is taken) */
static inline void set2(PyObject *lists, Py_ssize_t u, Py_ssize_t i, PyObject *value)
{
    PyObject *row = PyList_GET_ITEM(lists, u);
    PyObject *old = PyList_GET_ITEM(row, i);
    Py_INCREF(value);
    PyList_SET_ITEM(row, i, value);
    Py_DECREF(old);
}

/* a < b, as Python compares them, quickly for the engine's keys: floats, ints, and event tuples
 * (instant, tick, unit, node) whose ticks are unique; anything else as Python does. */
static int less(PyObject *a, PyObject *b)
{
    if (PyTuple_CheckExact(a) && PyTuple_CheckExact(b) && PyTuple_GET_SIZE(a) >= 2 &&
        PyTuple_GET_SIZE(b) >= 2) {
        PyObject *x = PyTuple_GET_ITEM(a, 0), *y = PyTuple_GET_ITEM(b, 0);
        if (PyFloat_CheckExact(x) && PyFloat_CheckExact(y)) {
            double dx = PyFloat_AS_DOUBLE(x), dy = PyFloat_AS_DOUBLE(y);
            if (dx < dy)
                return 1;
            if (dx > dy)
                return 0;
            if (dx == dy) {
                x = PyTuple_GET_ITEM(a, 1);
                y = PyTuple_GET_ITEM(b, 1);
                if (PyLong_CheckExact(x) && PyLong_CheckExact(y)) {
                    int ox, oy;
                    long long lx = PyLong_AsLongLongAndOverflow(x, &ox);
                    long long ly = PyLong_AsLongLongAndOverflow(y, &oy);
                    if (!ox && !oy && lx != ly)
                        return lx < ly;
                }
            }
        }
    } else if (PyLong_CheckExact(a) && PyLong_CheckExact(b)) {
        int oa, ob;
        long long la = PyLong_AsLongLongAndOverflow(a, &oa);
        long long lb = PyLong_AsLongLongAndOverflow(b, &ob);
        if (!oa && !ob)
            return la < lb;
    } else if (PyFloat_CheckExact(a) && PyFloat_CheckExact(b)) {
        return PyFloat_AS_DOUBLE(a) < PyFloat_AS_DOUBLE(b);
    }
    return PyObject_RichCompareBool(a, b, Py_LT);
}

/* The binary min-heap of Python's heapq (the same layout and moves, so the Python code that
 * shares these lists through heapq sees the same heaps): the item at pos moves up. */
static int sift_up_from(PyObject *heap, Py_ssize_t pos)
{
    /* heapq's _siftdown(heap, 0, pos): items swap, so the list stays a permutation of its
     * items whatever a comparison does (raises, or runs Python code that resizes the list) */
    Py_ssize_t size = PyList_GET_SIZE(heap);
    while (pos > 0) {
        Py_ssize_t parent = (pos - 1) >> 1;
        PyObject **items = ((PyListObject *)heap)->ob_item;
        PyObject *item = Py_NewRef(items[pos]), *up = Py_NewRef(items[parent]);
        int lt = less(item, up);
        Py_DECREF(up);
        Py_DECREF(item);
        if (lt < 0)
            return -1;
        if (size != PyList_GET_SIZE(heap)) {
            PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
            return -1;
        }
        if (!lt)
            break;
        items = ((PyListObject *)heap)->ob_item;
        item = items[pos];
        items[pos] = items[parent];
        items[parent] = item;
        pos = parent;
    }
    return 0;
}

static int push(PyObject *heap, PyObject *item)
{
    if (PyList_Append(heap, item) < 0)
        return -1;
    return sift_up_from(heap, PyList_GET_SIZE(heap) - 1);
}

/* heappop: the last item replaces the first, goes down to a leaf along the smaller children,
 * then up to its place. */
static PyObject *pop(PyObject *heap)
{
    Py_ssize_t n = PyList_GET_SIZE(heap);
    if (n == 0) {
        PyErr_SetString(PyExc_IndexError, "index out of range");
        return NULL;
    }
    PyObject **items = ((PyListObject *)heap)->ob_item;
    PyObject *last = items[n - 1];
    Py_INCREF(last);
    if (PyList_SetSlice(heap, n - 1, n, NULL) < 0) {
        Py_DECREF(last);
        return NULL;
    }
    n -= 1;
    if (n == 0)
        return last;
    items = ((PyListObject *)heap)->ob_item;
    PyObject *first = items[0];
    items[0] = last; /* the list's reference to first passes to the caller */
    Py_ssize_t pos = 0, limit = n >> 1;
    while (pos < limit) {
        Py_ssize_t child = 2 * pos + 1;
        if (child + 1 < n) {
            PyObject *a = Py_NewRef(items[child]), *b = Py_NewRef(items[child + 1]);
            int lt = less(a, b);
            Py_DECREF(a);
            Py_DECREF(b);
            if (lt < 0)
                goto fail;
            if (n != PyList_GET_SIZE(heap)) {
                PyErr_SetString(PyExc_RuntimeError, "list changed size during iteration");
                goto fail;
            }
            items = ((PyListObject *)heap)->ob_item;
            if (!lt)
                child += 1;
        }
        PyObject *up = items[child]; /* the smaller child moves up, the item down */
        items[child] = items[pos];
        items[pos] = up;
        pos = child;
    }
    if (sift_up_from(heap, pos) < 0)
        goto fail;
    return first;
fail:
    Py_DECREF(first); /* the heap keeps its other items, as heapq does on a failed compare */
    return NULL;
}

static int call(PyObject *fn, PyObject *const *args, Py_ssize_t n)
{
    PyObject *r = PyObject_Vectorcall(fn, args, n, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* x > y for two numbers (floats in practice) */
static inline int greater(PyObject *x, PyObject *y)
{
    if (PyFloat_CheckExact(x) && PyFloat_CheckExact(y))
        return PyFloat_AS_DOUBLE(x) > PyFloat_AS_DOUBLE(y);
    return PyObject_RichCompareBool(x, y, Py_GT);
}

static int index_of(PyObject *obj, Py_ssize_t size, Py_ssize_t *out)
{
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v >= size) {
        PyErr_Format(PyExc_IndexError, "engine index %zd out of range (%zd)", v, size);
        return -1;
    }
    *out = v;
    return 0;
}

/* The stream's position in a unit's per-stream lists (HOST_COPY_STREAM, -1, is the last). */
static int stream_of(PyObject *obj, Py_ssize_t width, Py_ssize_t *out)
{
    Py_ssize_t s = PyLong_AsSsize_t(obj);
    if (s == -1 && PyErr_Occurred())
        return -1;
    if (s < 0)
        s += width;
    if (s < 0 || s >= width) {
        PyErr_SetString(PyExc_IndexError, "engine stream out of range");
        return -1;
    }
    *out = s;
    return 0;
}

/* dispatch's start of the node at the head of ready[u][s] (queue) at t: it is taken from the
 * queue, its stream becomes busy, and its start and cause are set. *io: the node (new ref). */
static int begin(Loop *L, Py_ssize_t u, PyObject *uo, Py_ssize_t s, PyObject *queue,
                 PyObject *t, PyObject **io_out, Py_ssize_t *i_out)
{
    PyObject *key = pop(queue);
    if (key == NULL)
        return -1;
    PyObject *io = key;
    if (PyFloat_CheckExact(key)) {
        io = PyDict_GetItemWithError(PyList_GET_ITEM(L->at_key, u), key);
        if (io == NULL) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, key);
            Py_DECREF(key);
            return -1;
        }
    }
    Py_INCREF(io);
    Py_DECREF(key);
    Py_ssize_t i;
    if (index_of(io, PyList_GET_SIZE(PyList_GET_ITEM(L->kinds, u)), &i) < 0)
        goto fail;
    set2(L->busy, u, s, Py_True);
    set2(L->starts, u, i, t);
    PyObject *last = at2(L->last_on_stream, u, s);
    int later = 0;
    if (last != Py_None) {
        later = greater(t, at2(L->ready_times, u, i));
        if (later < 0)
            goto fail;
    }
    set2(L->causes, u, i, later ? last : at2(L->ready_causes, u, i));
    PyObject *pair = PyTuple_Pack(2, uo, io);
    if (pair == NULL)
        goto fail;
    PyObject *lrow = PyList_GET_ITEM(L->last_on_stream, u);
    PyObject *old = PyList_GET_ITEM(lrow, s);
    PyList_SET_ITEM(lrow, s, pair);
    Py_DECREF(old);
    *io_out = io;
    *i_out = i;
    return 0;
fail:
    Py_DECREF(io);
    return -1;
}

/* Push the event (end, tick(), u, node); steals end and io. */
static int push_event(Loop *L, PyObject *end, PyObject *uo, PyObject *io)
{
    if (end == NULL) {
        Py_DECREF(io);
        return -1;
    }
    PyObject *tick = PyObject_CallNoArgs(L->tick);
    PyObject *event = tick == NULL ? NULL : PyTuple_New(4);
    if (event == NULL) {
        Py_XDECREF(tick);
        Py_DECREF(end);
        Py_DECREF(io);
        return -1;
    }
    Py_INCREF(uo);
    PyTuple_SET_ITEM(event, 0, end);
    PyTuple_SET_ITEM(event, 1, tick);
    PyTuple_SET_ITEM(event, 2, uo);
    PyTuple_SET_ITEM(event, 3, io);
    int r = push(L->heap, event);
    Py_DECREF(event);
    return r;
}

/* dispatch's commonest case: the next compute node of unit u starts at t (stream 0 free, no
 * transfer contending). queue: ready[u][0], not empty. */
static int start_compute(Loop *L, Py_ssize_t u, PyObject *uo, PyObject *queue, PyObject *t)
{
    PyObject *io;
    Py_ssize_t i;
    if (begin(L, u, uo, 0, queue, t, &io, &i) < 0)
        return -1;
    set2(L->transfer_starts, u, i, t);
    PyObject *duration = at2(L->durations, u, i);
    PyObject *end;
    if (PyFloat_CheckExact(t) && PyFloat_CheckExact(duration))
        end = PyFloat_FromDouble(PyFloat_AS_DOUBLE(t) + PyFloat_AS_DOUBLE(duration));
    else
        end = PyNumber_Add(t, duration);
    return push_event(L, end, uo, io);
}

static PyObject *str_link, *str_finish, *str_tail;

/* dispatch's case of a compute node while transfers whose NCCL kernels slow the unit's compute
 * run (compute_duration): per link, the latest projected end of those running over it; the
 * kernel runs slowed (contended_cost(u, i, link)) until that end, at full speed after it. */
static int start_contended(Loop *L, Py_ssize_t u, PyObject *uo, PyObject *queue, PyObject *t)
{
    PyObject *io;
    Py_ssize_t i;
    if (begin(L, u, uo, 0, queue, t, &io, &i) < 0)
        return -1;
    set2(L->transfer_starts, u, i, t);
    PyObject *contending = PyList_GET_ITEM(L->contending, u);
    Py_ssize_t count = PyList_GET_SIZE(contending), links = 0;
    PyObject **link_of = PyMem_New(PyObject *, count + 1);
    double *until = PyMem_New(double, count + 1);
    double free = PyFloat_AsDouble(at2(L->durations, u, i)), now = PyFloat_AsDouble(t);
    if (link_of == NULL || until == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    if ((free == -1.0 || now == -1.0) && PyErr_Occurred())
        goto fail;
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *f = PyList_GET_ITEM(contending, j);
        PyObject *link = PyObject_GetAttr(f, str_link);
        if (link == NULL)
            goto fail;
        PyObject *finish = PyObject_GetAttr(f, str_finish), *tail = PyObject_GetAttr(f, str_tail);
        double end = 0.0;
        int bad = finish == NULL || tail == NULL;
        if (!bad) {
            end = PyFloat_AsDouble(finish) + PyFloat_AsDouble(tail);
            bad = PyErr_Occurred() != NULL;
        }
        Py_XDECREF(finish);
        Py_XDECREF(tail);
        if (bad) {
            Py_DECREF(link);
            goto fail;
        }
        if (link == Py_None) {
            Py_DECREF(link);
            continue;
        }
        Py_ssize_t k = 0;
        for (; k < links; k++) {
            int same = link_of[k] == link ? 1 : PyObject_RichCompareBool(link_of[k], link, Py_EQ);
            if (same < 0) {
                Py_DECREF(link);
                goto fail;
            }
            if (same)
                break;
        }
        if (k == links && end > -1.0) { /* until.get(link, -1.0) */
            link_of[links] = link; /* the reference passes to link_of */
            until[links++] = end;
            continue;
        }
        if (k < links && end > until[k])
            until[k] = end;
        Py_DECREF(link);
    }
    double worst = free;
    for (Py_ssize_t k = 0; k < links; k++) {
        if (until[k] <= now)
            continue;
        PyObject *args3[3] = {uo, io, link_of[k]};
        PyObject *r = PyObject_Vectorcall(L->contended_cost, args3, 3, NULL);
        double slow = r == NULL ? -1.0 : PyFloat_AsDouble(r);
        Py_XDECREF(r);
        if (slow == -1.0 && PyErr_Occurred())
            goto fail;
        if (slow <= free)
            continue;
        double window = until[k] - now;
        double done = window * free / slow;
        double took = done >= free ? slow : window + free - done;
        if (took > worst)
            worst = took;
    }
    for (Py_ssize_t k = 0; k < links; k++)
        Py_DECREF(link_of[k]);
    PyMem_Free(link_of);
    PyMem_Free(until);
    PyObject *duration = PyFloat_FromDouble(worst);
    if (duration == NULL) {
        Py_DECREF(io);
        return -1;
    }
    set2(L->durations, u, i, duration);
    Py_DECREF(duration);
    return push_event(L, PyFloat_FromDouble(now + worst), uo, io);
fail:
    if (link_of != NULL)
        for (Py_ssize_t k = 0; k < links; k++)
            Py_DECREF(link_of[k]);
    PyMem_Free(link_of);
    PyMem_Free(until);
    Py_DECREF(io);
    return -1;
}

/* Whether node i of unit u is a collective within the unit whose ports are its stream's
 * alone (_Sim._private_collectives), issued as soon as it starts (one member). */
static int is_private(Loop *L, Py_ssize_t u, PyObject *io, Py_ssize_t i)
{
    long k = PyLong_AsLong(at2(L->kinds, u, i));
    if (k == -1 && PyErr_Occurred())
        return -1;
    if (k != COLL)
        return 0;
    int in = PySet_Contains(PyList_GET_ITEM(L->private_, u), io);
    if (in <= 0)
        return in;
    PyObject *needed = PyDict_GetItemWithError(PyList_GET_ITEM(L->coll_needed, u), io);
    if (needed == NULL)
        return PyErr_Occurred() ? -1 : 0;
    long count = PyLong_AsLong(needed);
    if (count == -1 && PyErr_Occurred())
        return -1;
    return count == 1;
}

/* dispatch's case of such a collective (is_private) at the head of ready[u][s]: its end is
 * known when it starts, its steps each at full bandwidth, added in order. */
static int start_private(Loop *L, Py_ssize_t u, PyObject *uo, Py_ssize_t s, PyObject *queue,
                         PyObject *t)
{
    PyObject *io;
    Py_ssize_t i;
    if (begin(L, u, uo, s, queue, t, &io, &i) < 0)
        return -1;
    PyObject *group_key = PyDict_GetItemWithError(PyList_GET_ITEM(L->coll_keys, u), io);
    if (group_key == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, io);
        goto fail;
    }
    PyObject *seq_key = PyTuple_Pack(2, uo, group_key);
    if (seq_key == NULL)
        goto fail;
    PyObject *seq = PyDict_GetItemWithError(L->coll_seq, seq_key);
    PyObject *next = NULL;
    if (seq != NULL)
        next = PyNumber_Add(seq, one);
    else if (!PyErr_Occurred())
        next = PyLong_FromLong(1);
    int r = next == NULL ? -1 : PyDict_SetItem(L->coll_seq, seq_key, next);
    Py_XDECREF(next);
    Py_DECREF(seq_key);
    if (r < 0)
        goto fail;
    set2(L->transfer_starts, u, i, t);
    double end = PyFloat_AsDouble(t);
    if (end == -1.0 && PyErr_Occurred())
        goto fail;
    PyObject *steps = at2(L->all_steps, u, i);
    if (steps != Py_None) {
        if (!PyTuple_Check(steps)) {
            PyErr_SetString(PyExc_TypeError, "engine: a transfer's steps are no tuple");
            goto fail;
        }
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(steps); j++) {
            PyObject *step = PyTuple_GET_ITEM(steps, j);
            if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != 2) {
                PyErr_SetString(PyExc_TypeError, "engine: a transfer step is no pair");
                goto fail;
            }
            double seconds = PyFloat_AsDouble(PyTuple_GET_ITEM(step, 1));
            if (seconds == -1.0 && PyErr_Occurred())
                goto fail;
            end += seconds;
        }
    }
    PyObject *endo = PyFloat_FromDouble(end);
    if (endo == NULL)
        goto fail;
    PyObject *link = at2(L->comm_link, u, i);
    if (link != Py_None) {
        int contends = PySequence_Contains(L->contended, link);
        if (contends < 0)
            goto fail_end;
        if (contends) {
            PyObject *where = PyTuple_Pack(2, uo, io);
            if (where == NULL)
                goto fail_end;
            PyObject *contender = PyObject_CallFunctionObjArgs(L->contender, link, endo, where,
                                                               NULL);
            int bad = contender == NULL ||
                      PyList_Append(PyList_GET_ITEM(L->contending, u), contender) < 0 ||
                      PyDict_SetItem(L->contenders, where, contender) < 0;
            Py_XDECREF(contender);
            Py_DECREF(where);
            if (bad)
                goto fail_end;
        }
    }
    return push_event(L, endo, uo, io);
fail_end:
    Py_DECREF(endo);
fail:
    Py_DECREF(io);
    return -1;
}

/* The end of such a collective (is_private) at t: its stream frees, its duration is what it
 * took, and it no longer slows the unit's compute. */
static int end_private(Loop *L, Py_ssize_t u, PyObject *uo, PyObject *io, Py_ssize_t i,
                       PyObject *t)
{
    PyObject *so = at2(L->streams, u, i);
    PyObject *queues = PyList_GET_ITEM(L->ready, u);
    Py_ssize_t s;
    if (stream_of(so, PyList_GET_SIZE(queues), &s) < 0)
        return -1;
    set2(L->busy, u, s, Py_False);
    PyObject *entry = PyTuple_Pack(3, s == 0 ? Py_True : Py_False, uo, so);
    if (entry == NULL)
        return -1;
    int r = PySet_Add(L->touched, entry);
    Py_DECREF(entry);
    if (r < 0)
        return -1;
    PyObject *took = PyNumber_Subtract(t, at2(L->transfer_starts, u, i));
    if (took == NULL)
        return -1;
    set2(L->durations, u, i, took);
    Py_DECREF(took);
    PyObject *where = PyTuple_Pack(2, uo, io);
    if (where == NULL)
        return -1;
    PyObject *contender = PyDict_GetItemWithError(L->contenders, where);
    if (contender == NULL) {
        Py_DECREF(where);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_INCREF(contender);
    r = PyDict_DelItem(L->contenders, where);
    Py_DECREF(where);
    if (r == 0) {
        PyObject *done = PyObject_CallMethod(PyList_GET_ITEM(L->contending, u), "remove", "O",
                                             contender);
        r = done == NULL ? -1 : 0;
        Py_XDECREF(done);
    }
    Py_DECREF(contender);
    return r;
}

/* One touched stream (a (is compute, unit, stream) tuple) at instant t, as dispatch does. */
static int touch(Loop *L, PyObject *entry, PyObject *t)
{
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) {
        PyErr_SetString(PyExc_TypeError, "engine: a touched stream is no (bool, unit, stream)");
        return -1;
    }
    PyObject *uo = PyTuple_GET_ITEM(entry, 1), *so = PyTuple_GET_ITEM(entry, 2);
    Py_ssize_t u, s;
    if (index_of(uo, L->units, &u) < 0)
        return -1;
    PyObject *queues = PyList_GET_ITEM(L->ready, u);
    if (stream_of(so, PyList_GET_SIZE(queues), &s) < 0)
        return -1;
    PyObject *queue = PyList_GET_ITEM(queues, s);
    if (!PyList_CheckExact(queue)) {
        PyErr_SetString(PyExc_TypeError, "engine: a ready queue is no list");
        return -1;
    }
    if (PyList_GET_SIZE(queue) == 0)
        return 0;
    int busy = PyObject_IsTrue(at2(L->busy, u, s));
    if (busy)
        return busy < 0 ? -1 : 0;
    if (s == 0) {
        /* the queue's first entry is a compute node: stream 0 holds only those */
        if (PyList_GET_SIZE(PyList_GET_ITEM(L->contending, u)) == 0)
            return start_compute(L, u, uo, queue, t);
        return start_contended(L, u, uo, queue, t);
    } else {
        PyObject *io = PyList_GET_ITEM(queue, 0);
        if (PyFloat_CheckExact(io)) {
            io = PyDict_GetItemWithError(PyList_GET_ITEM(L->at_key, u), io);
            if (io == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, PyList_GET_ITEM(queue, 0));
                return -1;
            }
        }
        Py_ssize_t i;
        if (index_of(io, PyList_GET_SIZE(PyList_GET_ITEM(L->kinds, u)), &i) < 0)
            return -1;
        int own = is_private(L, u, io, i);
        if (own < 0)
            return -1;
        if (own)
            return start_private(L, u, uo, s, queue, t);
    }
    PyObject *args[3] = {uo, so, t};
    return call(L->dispatch, args, 3);
}

/* make_ready for a node that is neither compute nor a receive: a collective, send or host copy
 * joins its stream's queue, any other node (instant) ends at once. */
static int ready_other(Loop *L, Py_ssize_t u, PyObject *uo, PyObject *co, Py_ssize_t c, long k,
                       PyObject *t, PyObject *cause)
{
    set2(L->ready_times, u, c, t);
    set2(L->ready_causes, u, c, cause);
    if (k < RECV || k == COPY) {
        PyObject *so = at2(L->streams, u, c);
        PyObject *queues = PyList_GET_ITEM(L->ready, u);
        Py_ssize_t s;
        if (stream_of(so, PyList_GET_SIZE(queues), &s) < 0)
            return -1;
        PyObject *queue = PyList_GET_ITEM(queues, s);
        PyObject *keyed = PyList_GET_ITEM(L->queue_key, u);
        PyObject *key = co;
        if (keyed != Py_None) {
            key = PyDict_GetItemWithError(keyed, co);
            if (key == NULL) {
                if (PyErr_Occurred())
                    return -1;
                key = co;
            }
        }
        if (!PyList_CheckExact(queue) || push(queue, key) < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "engine: a ready queue is no list");
            return -1;
        }
        PyObject *entry = PyTuple_Pack(3, s == 0 ? Py_True : Py_False, uo, so);
        if (entry == NULL)
            return -1;
        int r = PySet_Add(L->touched, entry);
        Py_DECREF(entry);
        return r;
    }
    set2(L->starts, u, c, t);
    set2(L->causes, u, c, cause);
    Py_INCREF(co);
    return push_event(L, Py_NewRef(t), uo, co);
}

/* The events of one instant: each node ends, its children's dependencies count down. */
static int instant(Loop *L, PyObject *t)
{
    PyObject *heap = L->heap;
    while (PyList_GET_SIZE(heap) > 0) {
        PyObject *head = PyList_GET_ITEM(heap, 0);
        if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 4) {
            PyErr_SetString(PyExc_TypeError, "engine: an event is no 4-tuple");
            return -1;
        }
        PyObject *when = PyTuple_GET_ITEM(head, 0);
        int same = when == t;
        if (!same) {
            same = PyObject_RichCompareBool(when, t, Py_EQ);
            if (same < 0)
                return -1;
        }
        if (!same)
            return 0;
        PyObject *item = pop(heap);
        if (item == NULL)
            return -1;
        PyObject *uo = PyTuple_GET_ITEM(item, 2), *io = PyTuple_GET_ITEM(item, 3);
        Py_ssize_t u = PyLong_AsSsize_t(uo);
        if (u == -1 && PyErr_Occurred())
            goto fail;
        if (u < 0) { /* a transfer's step ends (unless superseded by a new rate) */
            PyObject *args[3] = {uo, io, t};
            if (call(L->flow_event, args, 3) < 0)
                goto fail;
            Py_DECREF(item);
            continue;
        }
        if (u >= L->units) {
            PyErr_SetString(PyExc_IndexError, "engine: unit out of range");
            goto fail;
        }
        PyObject *ukinds = PyList_GET_ITEM(L->kinds, u);
        Py_ssize_t n = PyList_GET_SIZE(ukinds), i;
        if (index_of(io, n, &i) < 0)
            goto fail;
        Py_INCREF(ukinds); /* the rows stay ours whatever the callbacks below assign */
        set2(L->ends_at, u, i, t);
        long k = PyLong_AsLong(PyList_GET_ITEM(ukinds, i));
        if (k == -1 && PyErr_Occurred())
            goto fail_kinds;
        if (k == COMPUTE) {
            set2(L->busy, u, 0, Py_False);
            if (PySet_Add(L->touched, PyList_GET_ITEM(L->compute_stream, u)) < 0)
                goto fail_kinds;
        } else if (k < RECV || k == COPY) {
            int own = k == COLL ? is_private(L, u, io, i) : 0;
            if (own < 0)
                goto fail_kinds;
            if (own) {
                if (end_private(L, u, uo, io, i, t) < 0)
                    goto fail_kinds;
            } else {
                PyObject *args[4] = {uo, io, PyList_GET_ITEM(ukinds, i), t};
                if (call(L->ended, args, 4) < 0)
                    goto fail_kinds;
            }
        }
        PyObject *children = at2(L->children, u, i);
        if (!PyList_CheckExact(children)) {
            PyErr_SetString(PyExc_TypeError, "engine: a node's children are no list");
            goto fail_kinds;
        }
        Py_INCREF(children);
        PyObject *pend = Py_NewRef(PyList_GET_ITEM(L->pending, u));
        PyObject *cause = NULL;
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(children); j++) {
            PyObject *co = PyList_GET_ITEM(children, j);
            Py_ssize_t c;
            if (index_of(co, n, &c) < 0)
                goto fail_children;
            long left = PyLong_AsLong(PyList_GET_ITEM(pend, c));
            if (left == -1 && PyErr_Occurred())
                goto fail_children;
            PyObject *count = PyLong_FromLong(left - 1);
            if (count == NULL)
                goto fail_children;
            PyObject *old = PyList_GET_ITEM(pend, c);
            PyList_SET_ITEM(pend, c, count);
            Py_DECREF(old);
            if (left - 1 != 0)
                continue;
            if (cause == NULL) {
                cause = PyTuple_Pack(2, uo, io);
                if (cause == NULL)
                    goto fail_children;
            }
            long ck = PyLong_AsLong(PyList_GET_ITEM(ukinds, c));
            if (ck == -1 && PyErr_Occurred())
                goto fail_children;
            if (ck == COMPUTE) { /* make_ready's commonest case */
                set2(L->ready_times, u, c, t);
                set2(L->ready_causes, u, c, cause);
                PyObject *keyed = PyList_GET_ITEM(L->queue_key, u);
                PyObject *key = co;
                if (keyed != Py_None) {
                    key = PyDict_GetItemWithError(keyed, co);
                    if (key == NULL) {
                        if (PyErr_Occurred())
                            goto fail_children;
                        key = co;
                    }
                }
                if (push(PyList_GET_ITEM(PyList_GET_ITEM(L->ready, u), 0), key) < 0)
                    goto fail_children;
                if (PySet_Add(L->touched, PyList_GET_ITEM(L->compute_stream, u)) < 0)
                    goto fail_children;
            } else if (ck != RECV) {
                if (ready_other(L, u, uo, co, c, ck, t, cause) < 0)
                    goto fail_children;
            } else {
                PyObject *args[4] = {uo, co, t, cause};
                if (call(L->make_ready, args, 4) < 0)
                    goto fail_children;
            }
        }
        Py_XDECREF(cause);
        Py_DECREF(children);
        Py_DECREF(pend);
        Py_DECREF(ukinds);
        Py_DECREF(item);
        continue;
    fail_children:
        Py_XDECREF(cause);
        Py_DECREF(children);
        Py_DECREF(pend);
    fail_kinds:
        Py_DECREF(ukinds);
    fail:
        Py_DECREF(item);
        return -1;
    }
    return 0;
}

/* The streams touched at instant t start their next node, in sorted order. */
static int start_touched(Loop *L, PyObject *t)
{
    Py_ssize_t count = PySet_GET_SIZE(L->touched);
    if (count == 0)
        return 0;
    if (count == 1) {
        PyObject *entry = PySet_Pop(L->touched);
        if (entry == NULL)
            return -1;
        int r = touch(L, entry, t);
        Py_DECREF(entry);
        return r;
    }
    PyObject *order = PySequence_List(L->touched);
    if (order == NULL)
        return -1;
    if (PyList_Sort(order) < 0) {
        Py_DECREF(order);
        return -1;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(order); j++) {
        if (touch(L, PyList_GET_ITEM(order, j), t) < 0) {
            Py_DECREF(order);
            return -1;
        }
    }
    Py_DECREF(order);
    return PySet_Clear(L->touched);
}

/* Copy the engine's state (capture(t)) for every watched (unit, node) that has started;
 * *watched: how many have, *u and *i: the next one's (-1 until read). */
static int watch(Loop *L, Py_ssize_t *watched, Py_ssize_t *u, Py_ssize_t *i, PyObject *t)
{
    Py_ssize_t total = PySequence_Fast_GET_SIZE(L->states_at);
    while (*watched < total) {
        if (*u < 0) {
            PyObject *pair = PySequence_Fast_GET_ITEM(L->states_at, *watched);
            PyObject *uo = PySequence_GetItem(pair, 0), *io = PySequence_GetItem(pair, 1);
            int bad = uo == NULL || io == NULL || index_of(uo, L->units, u) < 0 ||
                      index_of(io, PyList_GET_SIZE(PyList_GET_ITEM(L->starts, *u)), i) < 0;
            Py_XDECREF(uo);
            Py_XDECREF(io);
            if (bad)
                return -1;
        }
        double s = PyFloat_AsDouble(at2(L->starts, *u, *i));
        if (s == -1.0 && PyErr_Occurred())
            return -1;
        if (s < 0)
            return 0;
        *watched += 1;
        *u = *i = -1;
        PyObject *args[1] = {t};
        if (call(L->capture, args, 1) < 0)
            return -1;
    }
    return 0;
}

static int check_rows(PyObject *outer, Py_ssize_t units, const char *what)
{
    if (!PyList_CheckExact(outer) || PyList_GET_SIZE(outer) != units) {
        PyErr_Format(PyExc_TypeError, "engine: %s is no list of one entry per unit", what);
        return -1;
    }
    return 0;
}

/* The rows of a per-node table, each a list as long as the unit's kinds. */
static int check_table(PyObject *outer, PyObject *kinds, const char *what)
{
    Py_ssize_t units = PyList_GET_SIZE(kinds);
    if (check_rows(outer, units, what) < 0)
        return -1;
    for (Py_ssize_t u = 0; u < units; u++) {
        PyObject *row = PyList_GET_ITEM(outer, u);
        if (!PyList_CheckExact(row) ||
            PyList_GET_SIZE(row) != PyList_GET_SIZE(PyList_GET_ITEM(kinds, u))) {
            PyErr_Format(PyExc_TypeError, "engine: %s of unit %zd is no list per node", what, u);
            return -1;
        }
    }
    return 0;
}

static PyObject *run_loop(PyObject *self, PyObject *args)
{
    Loop L;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O!O!O!O!O!O!O!O!O!O!O!O!OOOOOOOO!O!O!O!O!O!O!O!O!OO:run_loop",
                          &PyList_Type, &L.heap, &PyList_Type, &L.kinds, &PyList_Type,
                          &L.ends_at, &PyList_Type, &L.busy, &PySet_Type, &L.touched,
                          &PyList_Type, &L.compute_stream, &PyList_Type, &L.children,
                          &PyList_Type, &L.pending, &PyList_Type, &L.ready_times, &PyList_Type,
                          &L.ready_causes, &PyList_Type, &L.queue_key, &PyList_Type, &L.ready,
                          &PyList_Type, &L.starts, &PyList_Type, &L.last_on_stream,
                          &PyList_Type, &L.causes, &PyList_Type, &L.transfer_starts,
                          &PyList_Type, &L.durations, &PyList_Type, &L.contending,
                          &PyList_Type, &L.at_key, &L.tick, &L.make_ready, &L.dispatch,
                          &L.ended, &L.flow_event, &L.capture, &L.states_at, &PyList_Type,
                          &L.streams, &PyList_Type, &L.coll_keys, &PyDict_Type, &L.coll_seq,
                          &PyList_Type, &L.coll_needed, &PyList_Type, &L.private_,
                          &PyList_Type, &L.all_steps, &PyList_Type, &L.comm_link, &PyDict_Type,
                          &L.contended, &PyDict_Type, &L.contenders, &L.contender,
                          &L.contended_cost))
        return NULL;
    Py_ssize_t units = L.units = PyList_GET_SIZE(L.kinds);
    for (Py_ssize_t u = 0; u < units; u++) {
        if (!PyList_CheckExact(PyList_GET_ITEM(L.kinds, u))) {
            PyErr_SetString(PyExc_TypeError, "engine: a unit's kinds are no list");
            return NULL;
        }
    }
    if (check_table(L.ends_at, L.kinds, "ends") < 0 ||
        check_table(L.children, L.kinds, "children") < 0 ||
        check_table(L.pending, L.kinds, "pending") < 0 ||
        check_table(L.ready_times, L.kinds, "ready times") < 0 ||
        check_table(L.ready_causes, L.kinds, "ready causes") < 0 ||
        check_table(L.starts, L.kinds, "starts") < 0 ||
        check_table(L.causes, L.kinds, "causes") < 0 ||
        check_table(L.transfer_starts, L.kinds, "transfer starts") < 0 ||
        check_table(L.durations, L.kinds, "durations") < 0 ||
        check_rows(L.busy, units, "busy") < 0 || check_rows(L.ready, units, "ready") < 0 ||
        check_rows(L.last_on_stream, units, "last on stream") < 0 ||
        check_rows(L.compute_stream, units, "compute streams") < 0 ||
        check_rows(L.queue_key, units, "queue keys") < 0 ||
        check_rows(L.contending, units, "contending") < 0 ||
        check_rows(L.at_key, units, "at keys") < 0 ||
        check_table(L.streams, L.kinds, "streams") < 0 ||
        check_table(L.all_steps, L.kinds, "steps") < 0 ||
        check_table(L.comm_link, L.kinds, "links") < 0 ||
        check_rows(L.coll_keys, units, "collective keys") < 0 ||
        check_rows(L.coll_needed, units, "collective members") < 0 ||
        check_rows(L.private_, units, "private collectives") < 0)
        return NULL;
    for (Py_ssize_t u = 0; u < units; u++) {
        PyObject *queues = PyList_GET_ITEM(L.ready, u), *busy = PyList_GET_ITEM(L.busy, u);
        PyObject *last = PyList_GET_ITEM(L.last_on_stream, u);
        PyObject *keyed = PyList_GET_ITEM(L.queue_key, u);
        if (!PyList_CheckExact(queues) || PyList_GET_SIZE(queues) < 1 ||
            !PyList_CheckExact(busy) || PyList_GET_SIZE(busy) != PyList_GET_SIZE(queues) ||
            !PyList_CheckExact(last) || PyList_GET_SIZE(last) != PyList_GET_SIZE(queues) ||
            !PyList_CheckExact(PyList_GET_ITEM(queues, 0)) ||
            !PyList_CheckExact(PyList_GET_ITEM(L.contending, u)) ||
            !PyDict_CheckExact(PyList_GET_ITEM(L.at_key, u)) ||
            !PyDict_CheckExact(PyList_GET_ITEM(L.coll_keys, u)) ||
            !PyDict_CheckExact(PyList_GET_ITEM(L.coll_needed, u)) ||
            !PyAnySet_CheckExact(PyList_GET_ITEM(L.private_, u)) ||
            (keyed != Py_None && !PyDict_CheckExact(keyed))) {
            PyErr_Format(PyExc_TypeError, "engine: the streams of unit %zd are malformed", u);
            return NULL;
        }
    }
    PyObject *states_at = PySequence_Fast(L.states_at, "engine: states_at is no sequence");
    if (states_at == NULL)
        return NULL;
    L.states_at = states_at;
    Py_ssize_t watched = 0, watched_unit = -1, watched_node = -1;
    while (PyList_GET_SIZE(L.heap) > 0) {
        PyObject *head = PyList_GET_ITEM(L.heap, 0);
        if (!PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 4) {
            PyErr_SetString(PyExc_TypeError, "engine: an event is no 4-tuple");
            goto fail;
        }
        PyObject *t = PyTuple_GET_ITEM(head, 0);
        Py_INCREF(t);
        int r = instant(&L, t);
        if (r == 0)
            r = start_touched(&L, t);
        if (r == 0)
            r = watch(&L, &watched, &watched_unit, &watched_node, t);
        Py_DECREF(t);
        if (r < 0)
            goto fail;
    }
    Py_DECREF(states_at);
    return PyLong_FromSsize_t(watched);
fail:
    Py_DECREF(states_at);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* The dependencies of a unit's nodes (stg.perf.replay._earlier_dependencies).                   */

static PyObject *str_id, *str_data_deps, *str_ctrl_deps;

static int compare_ssize(const void *a, const void *b)
{
    Py_ssize_t x = *(const Py_ssize_t *)a, y = *(const Py_ssize_t *)b;
    return (x > y) - (x < y);
}

/* Append the positions in deps (a tuple or list of ints) to buf[*count]; 1: done, 0: a
 * position outside [0, i), -1: something unusual (NotImplemented: the caller decides). */
static int collect(PyObject *deps, Py_ssize_t i, Py_ssize_t **buf, Py_ssize_t *count,
                   Py_ssize_t *cap)
{
    if (!PyTuple_CheckExact(deps) && !PyList_CheckExact(deps))
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(deps);
    PyObject **items = PySequence_Fast_ITEMS(deps);
    if (*count + n > *cap) {
        Py_ssize_t grown = 2 * (*count + n) + 8;
        Py_ssize_t *more = PyMem_Realloc(*buf, grown * sizeof(Py_ssize_t));
        if (more == NULL)
            return -2;
        *buf = more;
        *cap = grown;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (!PyLong_CheckExact(items[j]))
            return -1;
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(items[j], &overflow);
        if (overflow)
            return 0;
        if (v < 0 || v >= i)
            return 0;
        (*buf)[(*count)++] = (Py_ssize_t)v;
    }
    return 1;
}

static PyObject *earlier_dependencies(PyObject *self, PyObject *nodes_arg)
{
    (void)self;
    PyObject *nodes = PySequence_Fast(nodes_arg, "nodes is no sequence");
    if (nodes == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(nodes);
    PyObject **items = PySequence_Fast_ITEMS(nodes);
    PyObject *children = PyList_New(n), *pending = PyList_New(n), *result = NULL;
    Py_ssize_t *buf = NULL, cap = 0;
    if (children == NULL || pending == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *row = PyList_New(0);
        if (row == NULL)
            goto done;
        PyList_SET_ITEM(children, i, row);
        Py_INCREF(Py_None);
        PyList_SET_ITEM(pending, i, Py_None);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = items[i];
        PyObject *id = PyObject_GetAttr(node, str_id);
        if (id == NULL)
            goto done;
        if (!PyLong_CheckExact(id)) {
            Py_DECREF(id);
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(id, &overflow);
        Py_DECREF(id);
        if (overflow || v != i) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        Py_ssize_t count = 0;
        PyObject *data = PyObject_GetAttr(node, str_data_deps);
        if (data == NULL)
            goto done;
        int r = collect(data, i, &buf, &count, &cap);
        Py_DECREF(data);
        if (r == 1) {
            PyObject *ctrl = PyObject_GetAttr(node, str_ctrl_deps);
            if (ctrl == NULL)
                goto done;
            r = collect(ctrl, i, &buf, &count, &cap);
            Py_DECREF(ctrl);
        }
        if (r == -2) {
            PyErr_NoMemory();
            goto done;
        }
        if (r <= 0) {
            result = Py_NewRef(r == 0 ? Py_None : Py_NotImplemented);
            goto done;
        }
        if (count > 1)
            qsort(buf, count, sizeof(Py_ssize_t), compare_ssize);
        PyObject *position = PyLong_FromSsize_t(i);
        if (position == NULL)
            goto done;
        Py_ssize_t distinct = 0;
        for (Py_ssize_t j = 0; j < count; j++) {
            if (j > 0 && buf[j] == buf[j - 1])
                continue;
            distinct++;
            if (PyList_Append(PyList_GET_ITEM(children, buf[j]), position) < 0) {
                Py_DECREF(position);
                goto done;
            }
        }
        Py_DECREF(position);
        PyObject *left = PyLong_FromSsize_t(distinct);
        if (left == NULL)
            goto done;
        PyObject *old = PyList_GET_ITEM(pending, i);
        PyList_SET_ITEM(pending, i, left);
        Py_DECREF(old);
    }
    result = PyTuple_Pack(2, children, pending);
done:
    PyMem_Free(buf);
    Py_XDECREF(children);
    Py_XDECREF(pending);
    Py_DECREF(nodes);
    return result;
}

/* ------------------------------------------------------------------------------------------ */
/* A compute node's cost key (stg.perf.replay.compute_cost_key).                                */

enum { K_OP, K_STEP, K_MICRO_BATCH, K_ROLE, K_GEMM, K_ATTENTION, K_SCALING, K_LAUNCHES, K_SHARE,
       K_COUNT };
static PyObject *cost_names[K_COUNT];
static PyObject *str_attrs, *str_runtime, *str_name, *str_num_ops, *str_tensor_size, *str_dtype;
static PyObject *str_type;
static PyObject *zero;

static PyObject *set_cost_key_names(PyObject *self, PyObject *names)
{
    (void)self;
    if (!PyTuple_CheckExact(names) || PyTuple_GET_SIZE(names) != K_COUNT) {
        PyErr_Format(PyExc_TypeError, "cost key names: a tuple of %d strings", K_COUNT);
        return NULL;
    }
    for (int k = 0; k < K_COUNT; k++) {
        PyObject *name = PyTuple_GET_ITEM(names, k);
        if (!PyUnicode_CheckExact(name)) {
            PyErr_SetString(PyExc_TypeError, "cost key names: strings");
            return NULL;
        }
        Py_INCREF(name);
        Py_XSETREF(cost_names[k], name);
    }
    Py_RETURN_NONE;
}

/* attrs.get(name) as a new reference (None where absent) */
static PyObject *attr_get(PyObject *attrs, PyObject *name)
{
    PyObject *v = PyDict_GetItemWithError(attrs, name);
    if (v == NULL)
        return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    return Py_NewRef(v);
}

static PyObject *cost_key(PyObject *self, PyObject *node)
{
    (void)self;
    if (cost_names[0] == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "cost key names not set");
        return NULL;
    }
    PyObject *attrs = PyObject_GetAttr(node, str_attrs);
    if (attrs == NULL)
        return NULL;
    if (!PyDict_CheckExact(attrs)) {
        Py_DECREF(attrs);
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *key = PyTuple_New(12), *v;
    if (key == NULL)
        goto fail;
    PyObject *op = PyDict_GetItemWithError(attrs, cost_names[K_OP]);
    if (op == NULL && PyErr_Occurred())
        goto fail;
    if (op != NULL && PyUnicode_CheckExact(op) && PyUnicode_GET_LENGTH(op) > 0)
        v = Py_NewRef(op);
    else
        v = PyObject_GetAttr(node, str_name);
    if (v == NULL)
        goto fail;
    PyTuple_SET_ITEM(key, 0, v);
    if ((v = attr_get(attrs, cost_names[K_ROLE])) == NULL)
        goto fail;
    PyTuple_SET_ITEM(key, 1, v);
    PyObject *step = PyDict_GetItemWithError(attrs, cost_names[K_STEP]);
    if (step == NULL && PyErr_Occurred())
        goto fail;
    int placed = step != NULL && PyLong_CheckExact(step);
    if (!placed) {
        PyObject *mb = PyDict_GetItemWithError(attrs, cost_names[K_MICRO_BATCH]);
        if (mb == NULL && PyErr_Occurred())
            goto fail;
        if (mb != NULL && PyLong_CheckExact(mb)) {
            placed = PyObject_RichCompareBool(mb, zero, Py_NE);
            if (placed < 0)
                goto fail;
        }
    }
    PyTuple_SET_ITEM(key, 2, Py_NewRef(placed ? Py_True : Py_False));
    PyObject *fields[3] = {str_num_ops, str_tensor_size, str_dtype};
    for (int j = 0; j < 3; j++) {
        if ((v = PyObject_GetAttr(node, fields[j])) == NULL)
            goto fail;
        PyTuple_SET_ITEM(key, 3 + j, v);
    }
    v = PyObject_GetAttr(node, str_runtime);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            goto fail;
        PyErr_Clear();
        v = PyLong_FromLong(0);
        if (v == NULL)
            goto fail;
    }
    PyTuple_SET_ITEM(key, 6, v);
    int rest[5] = {K_GEMM, K_ATTENTION, K_SCALING, K_LAUNCHES, K_SHARE};
    for (int j = 0; j < 5; j++) {
        if ((v = attr_get(attrs, cost_names[rest[j]])) == NULL)
            goto fail;
        PyTuple_SET_ITEM(key, 7 + j, v);
    }
    Py_DECREF(attrs);
    return key;
fail:
    Py_XDECREF(key);
    Py_DECREF(attrs);
    return NULL;
}

/* _Sim._prepare's compute nodes: compute_costs(nodes, comp, keyed, price, kind, duration,
 * cost_key) sets each compute node's kind (0), duration and interned cost key, its key looked
 * up in keyed (key -> (interned key, cost)) or priced by price(node, key) (key NotImplemented
 * where cost_key could not work it out), and returns the positions of the other nodes. */
static PyObject *compute_costs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *nodes_arg, *comp, *keyed, *price, *kind, *duration, *keys;
    if (!PyArg_ParseTuple(args, "OOO!OO!O!O!:compute_costs", &nodes_arg, &comp, &PyDict_Type,
                          &keyed, &price, &PyList_Type, &kind, &PyList_Type, &duration,
                          &PyList_Type, &keys))
        return NULL;
    PyObject *nodes = PySequence_Tuple(nodes_arg); /* price may run any Python code */
    if (nodes == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(nodes);
    if (PyList_GET_SIZE(kind) != n || PyList_GET_SIZE(duration) != n ||
        PyList_GET_SIZE(keys) != n) {
        PyErr_SetString(PyExc_ValueError, "compute_costs: one entry per node");
        Py_DECREF(nodes);
        return NULL;
    }
    PyObject **items = &PyTuple_GET_ITEM(nodes, 0);
    PyObject *others = PyList_New(0), *compute_kind = PyLong_FromLong(COMPUTE);
    if (others == NULL || compute_kind == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = items[i];
        PyObject *type = PyObject_GetAttr(node, str_type);
        if (type == NULL)
            goto fail;
        Py_DECREF(type);
        if (type != comp) {
            PyObject *position = PyLong_FromSsize_t(i);
            int r = position == NULL ? -1 : PyList_Append(others, position);
            Py_XDECREF(position);
            if (r < 0)
                goto fail;
            continue;
        }
        PyObject *key = cost_key(NULL, node), *found;
        if (key == NULL)
            goto fail;
        found = key == Py_NotImplemented ? NULL : PyDict_GetItemWithError(keyed, key);
        if (found != NULL) {
            Py_INCREF(found);
        } else if (PyErr_Occurred()) {
            Py_DECREF(key);
            goto fail;
        } else {
            PyObject *args2[2] = {node, key};
            found = PyObject_Vectorcall(price, args2, 2, NULL);
            if (found == NULL) {
                Py_DECREF(key);
                goto fail;
            }
        }
        Py_DECREF(key);
        if (!PyTuple_CheckExact(found) || PyTuple_GET_SIZE(found) != 2) {
            Py_DECREF(found);
            PyErr_SetString(PyExc_TypeError, "compute_costs: a price is no (key, cost)");
            goto fail;
        }
        if (PyList_GET_SIZE(kind) != n || PyList_GET_SIZE(duration) != n ||
            PyList_GET_SIZE(keys) != n) {
            Py_DECREF(found);
            PyErr_SetString(PyExc_RuntimeError, "compute_costs: a list changed size");
            goto fail;
        }
        PyObject *old = PyList_GET_ITEM(kind, i);
        PyList_SET_ITEM(kind, i, Py_NewRef(compute_kind));
        Py_DECREF(old);
        old = PyList_GET_ITEM(keys, i);
        PyList_SET_ITEM(keys, i, Py_NewRef(PyTuple_GET_ITEM(found, 0)));
        Py_DECREF(old);
        old = PyList_GET_ITEM(duration, i);
        PyList_SET_ITEM(duration, i, Py_NewRef(PyTuple_GET_ITEM(found, 1)));
        Py_DECREF(old);
        Py_DECREF(found);
    }
    Py_DECREF(compute_kind);
    Py_DECREF(nodes);
    return others;
fail:
    Py_XDECREF(others);
    Py_XDECREF(compute_kind);
    Py_DECREF(nodes);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* The periodic check's passes over nodes (stg/perf/periodic.py).                               */

/* getattr(node, name, None) as a new reference */
static PyObject *getattr_or_none(PyObject *node, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(node, name);
    if (v == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        v = Py_NewRef(Py_None);
    }
    return v;
}

/* _flops(nodes): (hardware, model) FLOPs; NotImplemented where a node is unusual. Arguments:
 * nodes, the compute type, Role.ORTHOGONALIZE, the role and phase attribute names, and
 * is_recompute(node) (called once per distinct phase code). */
static PyObject *flops(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *nodes_arg, *comp, *orthogonalize, *role_name, *phase_name, *is_recompute;
    if (!PyArg_ParseTuple(args, "OOOUUO:flops", &nodes_arg, &comp, &orthogonalize, &role_name,
                          &phase_name, &is_recompute))
        return NULL;
    PyObject *nodes = PySequence_Tuple(nodes_arg); /* is_recompute may run any Python code */
    if (nodes == NULL)
        return NULL;
    PyObject *hardware = PyLong_FromLong(0), *model = PyLong_FromLong(0);
    PyObject *recomputed = PyDict_New(), *result = NULL;
    if (hardware == NULL || model == NULL || recomputed == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(nodes);
    PyObject **items = &PyTuple_GET_ITEM(nodes, 0);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *node = items[j];
        PyObject *type = PyObject_GetAttr(node, str_type);
        if (type == NULL)
            goto done;
        Py_DECREF(type);
        if (type != comp)
            continue;
        PyObject *ops = PyObject_GetAttr(node, str_num_ops);
        if (ops == NULL)
            goto done;
        if (!PyLong_CheckExact(ops)) {
            Py_DECREF(ops);
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        int positive = PyObject_RichCompareBool(ops, zero, Py_GT);
        if (positive <= 0) {
            Py_DECREF(ops);
            if (positive < 0)
                goto done;
            continue;
        }
        PyObject *sum = PyNumber_Add(hardware, ops);
        if (sum == NULL) {
            Py_DECREF(ops);
            goto done;
        }
        Py_SETREF(hardware, sum);
        PyObject *attrs = getattr_or_none(node, str_attrs);
        if (attrs == NULL) {
            Py_DECREF(ops);
            goto done;
        }
        if (attrs != Py_None && !PyDict_CheckExact(attrs)) {
            Py_DECREF(attrs);
            Py_DECREF(ops);
            result = Py_NewRef(Py_NotImplemented);
            goto done;
        }
        int counts = 1;
        if (attrs != Py_None && PyDict_GET_SIZE(attrs) > 0) {
            PyObject *role = PyDict_GetItemWithError(attrs, role_name);
            int own = 0;
            if (role != NULL)
                own = PyObject_RichCompareBool(role, orthogonalize, Py_EQ);
            else if (PyErr_Occurred())
                own = -1;
            PyObject *code = own ? NULL : PyDict_GetItemWithError(attrs, phase_name);
            if (own == 0 && code == NULL && PyErr_Occurred())
                own = -1;
            if (own == 0 && code != NULL &&
                (PyLong_CheckExact(code) || PyUnicode_CheckExact(code))) {
                PyObject *again = PyDict_GetItemWithError(recomputed, code);
                if (again == NULL) {
                    if (PyErr_Occurred()) {
                        own = -1;
                    } else {
                        PyObject *args1[1] = {node};
                        PyObject *r = PyObject_Vectorcall(is_recompute, args1, 1, NULL);
                        int truth = r == NULL ? -1 : PyObject_IsTrue(r);
                        Py_XDECREF(r);
                        if (truth < 0 || PyDict_SetItem(recomputed, code,
                                                        truth ? Py_True : Py_False) < 0)
                            own = -1;
                        else
                            counts = !truth;
                    }
                } else {
                    counts = again != Py_True;
                }
            }
            if (own < 0) {
                Py_DECREF(attrs);
                Py_DECREF(ops);
                goto done;
            }
            if (own)
                counts = 0;
        }
        Py_DECREF(attrs);
        if (counts) {
            sum = PyNumber_Add(model, ops);
            if (sum == NULL) {
                Py_DECREF(ops);
                goto done;
            }
            Py_SETREF(model, sum);
        }
        Py_DECREF(ops);
    }
    result = PyTuple_Pack(2, hardware, model);
done:
    Py_XDECREF(hardware);
    Py_XDECREF(model);
    Py_XDECREF(recomputed);
    Py_DECREF(nodes);
    return result;
}

/* Every node's _base, as _Indexed.base works it out: alike nodes (the same raw values of the
 * attributes it reads, and their types) share one entry of `shared`. Arguments: nodes,
 * shared, _base, and the op, layer, part, phase and role attribute names. NotImplemented
 * where a node's attributes are no dict. */
static PyObject *bases(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *nodes_arg, *shared, *base_fn, *names;
    if (!PyArg_ParseTuple(args, "OO!OO!:bases", &nodes_arg, &PyDict_Type, &shared, &base_fn,
                          &PyTuple_Type, &names))
        return NULL;
    if (PyTuple_GET_SIZE(names) != 5) {
        PyErr_SetString(PyExc_TypeError, "bases: five attribute names");
        return NULL;
    }
    PyObject *nodes = PySequence_Tuple(nodes_arg); /* callbacks may change a list */
    if (nodes == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(nodes);
    PyObject **items = &PyTuple_GET_ITEM(nodes, 0);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *node = items[j];
        PyObject *attrs = getattr_or_none(node, str_attrs), *found = NULL;
        if (attrs == NULL)
            goto fail;
        int truth = PyObject_IsTrue(attrs);
        if (truth < 0) {
            Py_DECREF(attrs);
            goto fail;
        }
        if (!truth) {
            Py_DECREF(attrs);
            PyObject *args1[1] = {node};
            found = PyObject_Vectorcall(base_fn, args1, 1, NULL);
            if (found == NULL)
                goto fail;
            PyList_SET_ITEM(out, j, found);
            continue;
        }
        if (!PyDict_CheckExact(attrs)) {
            Py_DECREF(attrs);
            Py_DECREF(out);
            Py_DECREF(nodes);
            Py_RETURN_NOTIMPLEMENTED;
        }
        PyObject *raw = PyTuple_New(10);
        PyObject *type = raw == NULL ? NULL : PyObject_GetAttr(node, str_type);
        if (type == NULL) {
            Py_XDECREF(raw);
            Py_DECREF(attrs);
            goto fail;
        }
        PyTuple_SET_ITEM(raw, 0, type);
        int bad = 0;
        for (int k = 0; k < 5; k++) {
            PyObject *v = attr_get(attrs, PyTuple_GET_ITEM(names, k));
            if (v == NULL) {
                bad = 1;
                break;
            }
            /* raw: (type, op, layer, part, phase, role, type(layer), ..., type(role)) */
            if (k > 0)
                PyTuple_SET_ITEM(raw, 5 + k, Py_NewRef((PyObject *)Py_TYPE(v)));
            PyTuple_SET_ITEM(raw, 1 + k, v);
        }
        Py_DECREF(attrs);
        if (!bad) {
            found = PyDict_GetItemWithError(shared, raw);
            if (found != NULL) {
                Py_INCREF(found);
            } else if (!PyErr_Occurred()) {
                PyObject *args1[1] = {node};
                found = PyObject_Vectorcall(base_fn, args1, 1, NULL);
                if (found != NULL && PyDict_SetItem(shared, raw, found) < 0)
                    Py_CLEAR(found);
            }
        }
        Py_DECREF(raw);
        if (found == NULL && !bad && PyErr_ExceptionMatches(PyExc_TypeError)) {
            /* an unhashable attribute: the Python code works out this node's base only if
             * it is asked for it (and raises then) */
            PyErr_Clear();
            Py_DECREF(out);
            Py_DECREF(nodes);
            Py_RETURN_NOTIMPLEMENTED;
        }
        if (found == NULL)
            goto fail;
        PyList_SET_ITEM(out, j, found);
    }
    Py_DECREF(nodes);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(nodes);
    return NULL;
}

static PyObject *heap_push(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *heap, *item;
    if (!PyArg_ParseTuple(args, "O!O:heappush", &PyList_Type, &heap, &item))
        return NULL;
    if (push(heap, item) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *heap_pop(PyObject *self, PyObject *heap)
{
    (void)self;
    if (!PyList_Check(heap)) {
        PyErr_SetString(PyExc_TypeError, "heappop: a list");
        return NULL;
    }
    return pop(heap);
}

static PyMethodDef methods[] = {
    {"run_loop", run_loop, METH_VARARGS,
     "Run the replay engine's event loop over _Sim.run's state (see stg/perf/replay.py)."},
    {"set_cost_key_names", set_cost_key_names, METH_O,
     "The attribute names compute_cost_key reads (op, step, micro-batch, role, gemm, ...)."},
    {"cost_key", cost_key, METH_O,
     "compute_cost_key's key, or NotImplemented where the node's attributes are no dict."},
    {"heappush", heap_push, METH_VARARGS, "The engine's heapq.heappush (tested against it)."},
    {"heappop", heap_pop, METH_O, "The engine's heapq.heappop (tested against it)."},
    {"compute_costs", compute_costs, METH_VARARGS,
     "_Sim._prepare's compute nodes: their kinds, durations and keys; the other positions."},
    {"flops", flops, METH_VARARGS, "periodic._flops's sums, or NotImplemented."},
    {"bases", bases, METH_VARARGS, "Every node's periodic._base, or NotImplemented."},
    {"earlier_dependencies", earlier_dependencies, METH_O,
     "_earlier_dependencies's result, or NotImplemented where the nodes are unusual."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "stg.perf._engine",
    "The compiled event loop of the replay engine (stg/perf/replay.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__engine(void)
{
    one = PyLong_FromLong(1);
    str_id = PyUnicode_InternFromString("id");
    str_data_deps = PyUnicode_InternFromString("data_deps");
    str_ctrl_deps = PyUnicode_InternFromString("ctrl_deps");
    str_attrs = PyUnicode_InternFromString("attrs");
    str_runtime = PyUnicode_InternFromString("runtime");
    str_name = PyUnicode_InternFromString("name");
    str_num_ops = PyUnicode_InternFromString("num_ops");
    str_tensor_size = PyUnicode_InternFromString("tensor_size");
    str_dtype = PyUnicode_InternFromString("dtype");
    zero = PyLong_FromLong(0);
    str_type = PyUnicode_InternFromString("type");
    str_link = PyUnicode_InternFromString("link");
    str_finish = PyUnicode_InternFromString("finish");
    str_tail = PyUnicode_InternFromString("tail");
    if (str_id == NULL || str_data_deps == NULL || str_ctrl_deps == NULL || str_attrs == NULL ||
        str_runtime == NULL || str_name == NULL || str_num_ops == NULL ||
        str_tensor_size == NULL || str_dtype == NULL || zero == NULL || str_type == NULL ||
        one == NULL || str_link == NULL || str_finish == NULL || str_tail == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
