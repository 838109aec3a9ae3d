/* stg.core._lowering: the compiled loop of lowering's runs (_Nodes.run in stg/core/lowering.py).
 *
 * A run's ops are laid out once (_run_ops: one _RunOp tuple per op); each time the run is
 * lowered, every op becomes a NodeTemplate whose dependencies come from the environment (the
 * nodes that produced its inputs before the run) and from the earlier ops of the run. lay_out
 * does that loop in C over the same objects and makes the templates as _Nodes.run does: the
 * same field values (the same tuples of dependencies, a new attribute dict per node), set
 * straight into the slots of NodeTemplate, whose every field it sets. The Python loop of
 * _Nodes.run is the reference: tests/test_lowering_compiled.py compares the two on whole
 * workloads, and STG_LOWERING=python turns this module off.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define ABI_VERSION 2

/* the fields of NodeTemplate, in the order lay_out fills them */
enum { F_ID, F_NAME, F_TYPE, F_DATA, F_CTRL, F_OPS, F_TENSOR, F_COMM_TYPE, F_COMM_SIZE,
       F_AXES, F_PEER, F_TAG, F_DTYPE, F_RUNTIME, F_ATTRS, F_COUNT };
static const char *field_names[F_COUNT] = {
    "id", "name", "type", "data_deps", "ctrl_deps", "num_ops", "tensor_size", "comm_type",
    "comm_size", "group_axes", "peer_stage", "comm_tag", "dtype", "runtime", "attrs",
};

/* the fields of a _RunOp */
enum { R_NAME, R_TYPE, R_OPS, R_TENSOR, R_COMM_TYPE, R_COMM_SIZE, R_AXES, R_DTYPE, R_ATTRS,
       R_ROLE, R_SHAPE, R_ONLY_OUTSIDE, R_ONLY_INSIDE, R_OUTSIDE, R_INSIDE, R_OUTPUTS,
       R_COUNT };

enum { AFTER_ONE_BEFORE_ONE = 1, AFTER_ONE = 2 };

static PyTypeObject *template_type;
static Py_ssize_t offsets[F_COUNT];
static PyObject *comp, *comm_coll, *role_attr, *zero;

/* NodeTemplate, the node types and the role attribute's name (set once by lowering). */
static PyObject *setup(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *cls, *c, *cc, *ra;
    if (!PyArg_ParseTuple(args, "O!OOU:setup", &PyType_Type, &cls, &c, &cc, &ra))
        return NULL;
    PyObject *slots = PyObject_GetAttrString(cls, "__slots__");
    if (slots == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "NodeTemplate has no __slots__");
        }
        return NULL;
    }
    Py_ssize_t count = PyObject_Length(slots);
    Py_DECREF(slots);
    if (count != F_COUNT) {
        PyErr_Format(PyExc_TypeError, "NodeTemplate has %zd slots, lay_out fills %d", count,
                     F_COUNT);
        return NULL;
    }
    Py_ssize_t found[F_COUNT]; /* committed to offsets only once every field fits */
    for (int f = 0; f < F_COUNT; f++) {
        PyObject *descr = PyDict_GetItemString(((PyTypeObject *)cls)->tp_dict, field_names[f]);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "NodeTemplate.%s is no slot", field_names[f]);
            return NULL;
        }
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "NodeTemplate.%s is no writable object slot",
                         field_names[f]);
            return NULL;
        }
        found[f] = member->offset;
    }
    memcpy(offsets, found, sizeof offsets);
    Py_INCREF(cls);
    Py_XSETREF(template_type, (PyTypeObject *)cls);
    Py_INCREF(c);
    Py_XSETREF(comp, c);
    Py_INCREF(cc);
    Py_XSETREF(comm_coll, cc);
    Py_INCREF(ra);
    Py_XSETREF(role_attr, ra);
    Py_RETURN_NONE;
}

/* tuple(sorted(set(items))) */
static PyObject *sorted_distinct(PyObject *items)
{
    PyObject *set = PySet_New(items);
    if (set == NULL)
        return NULL;
    PyObject *list = PySequence_List(set);
    Py_DECREF(set);
    if (list == NULL)
        return NULL;
    if (PyList_Sort(list) < 0) {
        Py_DECREF(list);
        return NULL;
    }
    PyObject *out = PyList_AsTuple(list);
    Py_DECREF(list);
    return out;
}

/* *deps += extra (a tuple); steals nothing */
static int extend(PyObject **deps, PyObject *extra)
{
    PyObject *joined = PySequence_Concat(*deps, extra);
    if (joined == NULL)
        return -1;
    Py_SETREF(*deps, joined);
    return 0;
}

/* `x not in a and x not in b` */
static int absent(PyObject *x, PyObject *a, PyObject *b)
{
    int in = PySequence_Contains(a, x);
    if (in != 0)
        return in < 0 ? -1 : 0;
    in = PySequence_Contains(b, x);
    return in < 0 ? -1 : !in;
}

static int append_one(PyObject **ctrl, PyObject *x)
{
    PyObject *one = PyTuple_Pack(1, x);
    if (one == NULL)
        return -1;
    int r = extend(ctrl, one);
    Py_DECREF(one);
    return r;
}

/* The data deps of one op (see _Nodes.run). made: the run's nodes so far as 1-tuples. */
static PyObject *data_deps(PyObject *op, PyObject *env, PyObject *made, long shape,
                           Py_ssize_t only_inside, long long first)
{
    PyObject *deps;
    if (shape == AFTER_ONE_BEFORE_ONE || shape == AFTER_ONE) {
        if (only_inside < 0 || only_inside >= PyList_GET_SIZE(made)) {
            PyErr_SetString(PyExc_IndexError, "lay_out: an op's input is no earlier op");
            return NULL;
        }
        PyObject *inner = PyList_GET_ITEM(made, only_inside);
        if (shape == AFTER_ONE)
            return Py_NewRef(inner);
        PyObject *found = PyDict_GetItemWithError(env, PyTuple_GET_ITEM(op, R_ONLY_OUTSIDE));
        if (found == NULL)
            return PyErr_Occurred() ? NULL : Py_NewRef(inner);
        if (PyTuple_CheckExact(found) && PyTuple_GET_SIZE(found) == 1)
            return PySequence_Concat(found, inner);
        deps = sorted_distinct(found);
        if (deps == NULL || extend(&deps, inner) < 0) {
            Py_XDECREF(deps);
            return NULL;
        }
        return deps;
    }
    PyObject *only_outside = PyTuple_GET_ITEM(op, R_ONLY_OUTSIDE);
    PyObject *outside = PyTuple_GET_ITEM(op, R_OUTSIDE);
    if (only_outside != Py_None) {
        PyObject *found = PyDict_GetItemWithError(env, only_outside);
        if (found == NULL && PyErr_Occurred())
            return NULL;
        if (found == NULL) {
            deps = PyTuple_New(0);
        } else {
            Py_ssize_t n = PyObject_Length(found);
            if (n < 0)
                return NULL;
            deps = n > 1 || !PyTuple_CheckExact(found) ? sorted_distinct(found)
                                                         : Py_NewRef(found);
        }
        if (deps == NULL)
            return NULL;
    } else {
        deps = PyTuple_New(0);
        if (deps == NULL)
            return NULL;
        Py_ssize_t keys = PyObject_Length(outside);
        if (keys < 0)
            goto fail;
        if (keys > 0) {
            PyObject *seq = PySequence_Fast(outside, "lay_out: outside is no sequence");
            if (seq == NULL)
                goto fail;
            for (Py_ssize_t j = 0; j < keys; j++) {
                PyObject *found = PyDict_GetItemWithError(env, PySequence_Fast_GET_ITEM(seq, j));
                if (found == NULL) {
                    if (PyErr_Occurred()) {
                        Py_DECREF(seq);
                        goto fail;
                    }
                    continue;
                }
                int truth = PyObject_IsTrue(found);
                if (truth < 0) {
                    Py_DECREF(seq);
                    goto fail;
                }
                if (!truth)
                    continue;
                PyObject *more = PyTuple_CheckExact(found) ? Py_NewRef(found)
                                                           : PySequence_Tuple(found);
                int r = more == NULL ? -1 : extend(&deps, more);
                Py_XDECREF(more);
                if (r < 0) {
                    Py_DECREF(seq);
                    goto fail;
                }
            }
            Py_DECREF(seq);
            Py_ssize_t n = PyTuple_GET_SIZE(deps);
            int unsorted = n > 2;
            if (n == 2) {
                unsorted = PyObject_RichCompareBool(PyTuple_GET_ITEM(deps, 0),
                                                    PyTuple_GET_ITEM(deps, 1), Py_GE);
                if (unsorted < 0)
                    goto fail;
            }
            if (unsorted) {
                PyObject *tidy = sorted_distinct(deps);
                if (tidy == NULL)
                    goto fail;
                Py_SETREF(deps, tidy);
            }
        }
    }
    if (only_inside >= 0) {
        if (only_inside >= PyList_GET_SIZE(made)) {
            PyErr_SetString(PyExc_IndexError, "lay_out: an op's input is no earlier op");
            goto fail;
        }
        if (extend(&deps, PyList_GET_ITEM(made, only_inside)) < 0)
            goto fail;
        return deps;
    }
    PyObject *inside = PyTuple_GET_ITEM(op, R_INSIDE);
    Py_ssize_t count = PyObject_Length(inside);
    if (count < 0)
        goto fail;
    if (count > 0) {
        PyObject *shifted = PyTuple_New(count);
        if (shifted == NULL)
            goto fail;
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject *k = PySequence_GetItem(inside, j);
            long long v = k == NULL ? -1 : PyLong_AsLongLong(k);
            Py_XDECREF(k);
            if (v == -1 && PyErr_Occurred()) {
                Py_DECREF(shifted);
                goto fail;
            }
            PyObject *id = PyLong_FromLongLong(first + v);
            if (id == NULL) {
                Py_DECREF(shifted);
                goto fail;
            }
            PyTuple_SET_ITEM(shifted, j, id);
        }
        int r = extend(&deps, shifted);
        Py_DECREF(shifted);
        if (r < 0)
            goto fail;
    }
    return deps;
fail:
    Py_DECREF(deps);
    return NULL;
}

/* lay_out(ops, env, prefix, after, start, where, first, nodes, pending, last_coll, last_comp)
 * -> (pending, last_comp): _Nodes.run's loop; the templates are appended to nodes. */
static PyObject *lay_out(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *ops_arg, *env, *prefix, *after, *start, *where, *nodes, *pending, *last_coll,
        *last_comp;
    long long first;
    if (!PyArg_ParseTuple(args, "OO!UOOO!LO!OO!O:lay_out", &ops_arg, &PyDict_Type, &env,
                          &prefix, &after, &start, &PyDict_Type, &where, &first, &PyList_Type,
                          &nodes, &pending, &PyDict_Type, &last_coll, &last_comp))
        return NULL;
    if (template_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "lay_out: setup was not called");
        return NULL;
    }
    PyObject *ops = PySequence_Fast(ops_arg, "lay_out: ops is no sequence");
    if (ops == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ops);
    PyObject *made = PyList_New(0), *result = NULL, *deps = NULL, *ctrl = NULL;
    Py_INCREF(pending);
    Py_INCREF(last_comp);
    if (made == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *op = PySequence_Fast_GET_ITEM(ops, j);
        if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != R_COUNT) {
            PyErr_SetString(PyExc_TypeError, "lay_out: an op is no _RunOp");
            goto done;
        }
        long long nid = first + j;
        long shape = PyLong_AsLong(PyTuple_GET_ITEM(op, R_SHAPE));
        Py_ssize_t only_inside = PyLong_AsSsize_t(PyTuple_GET_ITEM(op, R_ONLY_INSIDE));
        if ((shape == -1 || only_inside == -1) && PyErr_Occurred())
            goto done;
        PyObject *node_type = PyTuple_GET_ITEM(op, R_TYPE);
        deps = data_deps(op, env, made, shape, only_inside, first);
        if (deps == NULL)
            goto done;
        if (shape == AFTER_ONE_BEFORE_ONE || shape == AFTER_ONE || only_inside >= 0 ||
            PyObject_Length(PyTuple_GET_ITEM(op, R_INSIDE)) > 0) {
            ctrl = PyTuple_New(0);
        } else if (after != Py_None) {
            /* after in deps: deps is not empty, so start does not apply either */
            int in = PySequence_Contains(deps, after);
            if (in < 0)
                goto done;
            ctrl = in ? PyTuple_New(0) : PyTuple_Pack(1, after);
        } else if (start != Py_None && PyTuple_GET_SIZE(deps) == 0 && node_type == comp) {
            ctrl = PyTuple_Pack(1, start);
        } else {
            ctrl = PyTuple_New(0);
        }
        if (ctrl == NULL || PyErr_Occurred())
            goto done;
        if (pending != Py_None) {
            int missing = absent(pending, deps, ctrl);
            if (missing < 0 || (missing && append_one(&ctrl, pending) < 0))
                goto done;
            Py_SETREF(pending, Py_NewRef(Py_None));
        }
        PyObject *id = PyLong_FromLongLong(nid);
        if (id == NULL)
            goto done;
        if (node_type == comm_coll) {
            PyObject *axes = PyTuple_GET_ITEM(op, R_AXES);
            PyObject *previous = PyDict_GetItemWithError(last_coll, axes);
            int missing = 0;
            if (previous != NULL && previous != Py_None)
                missing = absent(previous, deps, ctrl);
            else if (PyErr_Occurred())
                missing = -1;
            if (missing < 0 || (missing && append_one(&ctrl, previous) < 0) ||
                PyDict_SetItem(last_coll, axes, id) < 0) {
                Py_DECREF(id);
                goto done;
            }
        } else if (node_type == comp) {
            Py_SETREF(last_comp, Py_NewRef(id));
        }
        PyObject *attrs = PyDict_Copy(PyTuple_GET_ITEM(op, R_ATTRS));
        if (attrs == NULL || PyDict_Update(attrs, where) < 0) {
            Py_XDECREF(attrs);
            Py_DECREF(id);
            goto done;
        }
        PyObject *role = PyTuple_GET_ITEM(op, R_ROLE);
        if (role != Py_None && PyDict_SetItem(attrs, role_attr, role) < 0) {
            Py_DECREF(attrs);
            Py_DECREF(id);
            goto done;
        }
        PyObject *name = PyUnicode_Concat(prefix, PyTuple_GET_ITEM(op, R_NAME));
        PyObject *node = name == NULL ? NULL : template_type->tp_alloc(template_type, 0);
        if (node == NULL) {
            Py_XDECREF(name);
            Py_DECREF(attrs);
            Py_DECREF(id);
            goto done;
        }
        PyObject *values[F_COUNT] = {
            id, name, node_type, deps, ctrl, PyTuple_GET_ITEM(op, R_OPS),
            PyTuple_GET_ITEM(op, R_TENSOR), PyTuple_GET_ITEM(op, R_COMM_TYPE),
            PyTuple_GET_ITEM(op, R_COMM_SIZE), PyTuple_GET_ITEM(op, R_AXES), Py_None, Py_None,
            PyTuple_GET_ITEM(op, R_DTYPE), zero, attrs,
        };
        for (int f = 0; f < F_COUNT; f++)
            *(PyObject **)((char *)node + offsets[f]) = Py_NewRef(values[f]);
        Py_DECREF(name);
        Py_DECREF(attrs);
        Py_CLEAR(deps);
        Py_CLEAR(ctrl);
        int r = PyList_Append(nodes, node);
        Py_DECREF(node);
        PyObject *own = r < 0 ? NULL : PyTuple_Pack(1, id);
        Py_DECREF(id);
        if (own == NULL)
            goto done;
        r = PyList_Append(made, own);
        PyObject *outputs = PyTuple_GET_ITEM(op, R_OUTPUTS);
        PyObject *seq = r < 0 ? NULL : PySequence_Fast(outputs, "lay_out: outputs");
        if (seq == NULL) {
            Py_DECREF(own);
            goto done;
        }
        for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq) && r == 0; k++)
            r = PyDict_SetItem(env, PySequence_Fast_GET_ITEM(seq, k), own);
        Py_DECREF(seq);
        Py_DECREF(own);
        if (r < 0)
            goto done;
    }
    result = PyTuple_Pack(2, pending, last_comp);
done:
    Py_XDECREF(deps);
    Py_XDECREF(ctrl);
    Py_XDECREF(made);
    Py_DECREF(pending);
    Py_DECREF(last_comp);
    Py_DECREF(ops);
    return result;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS, "NodeTemplate, NodeType.COMP, NodeType.COMM_COLL, ROLE_ATTR."},
    {"lay_out", lay_out, METH_VARARGS, "_Nodes.run's loop over a run's laid-out ops."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "stg.core._lowering",
    "The compiled loop of lowering's runs (stg/core/lowering.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__lowering(void)
{
    zero = PyLong_FromLong(0);
    if (zero == NULL)
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
